"""GridSample's samples for a block of positions at a time, with gathers.

LLVM does not vectorise a loop of loads at computed indices (numba's loops over
the taps stay scalar): ``gathered`` writes the vector code itself. For
``lanes(pw)`` consecutive positions of a segment's plan that are all interior
(taps from their ``base``) or all padded (taps at ``pidx``; zeros padding's
masked by ``pok``), it loads their weights and offsets as vectors, gathers each
tap of one channel for all of them (``llvm.masked.gather`` from one base with
32-bit offsets: ``vgatherdps``/``vgatherdpd`` on CPUs with AVX2 or AVX-512, 16
lanes an instruction; 16-bit and uint8 elements, which no x86 CPU gathers, as the
32-bit words they start, truncated: ``gather_safe``),
widens them to the compute type as the scalar ``load_sample`` does, and combines
them with the operations and in the order of the scalar sample
(``grid_sample._s1``/``_s2``/``_s3``): the block's samples are those of the scalar
code, bit for bit, written to a buffer in the compute type that the caller stores
(``store_sample``: rounded or cast as one position's sample is).

Why: on an AVX-512 Xeon (one thread, data in L2) a bilinear sample's 4 taps
gathered run 2.4-2.5x faster than by scalar loads. On a Zen 5 gathers were
measured at the cost of scalar loads (an earlier probe, not this kernel).
"""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .._compat import cgutils, insert


def lanes(pw):
    """Positions per block for the compute type of the weights ``pw`` (16 float32,
    8 float64: one AVX-512 register)."""
    return 16 if pw.dtype.itemsize == 4 else 8


@overload(lanes, jit_options={"inline": "always"})
def _lanes(pw):
    n = 16 if pw.dtype == types.float32 else 8
    return lambda pw: n


def gather_safe(xf, end, xs):
    """Whether ``gathered`` may read the channel images of ``xs`` elements before
    ``xf[end]``: its offsets are 32-bit (``xs < 2**31``), and 16-bit and uint8
    elements are gathered as 32-bit words, which reach up to 3 bytes past the
    element's first (so not in the last images of ``xf``)."""
    return xs < 2 ** 31 and (xf.itemsize >= 4 or end + 3 <= xf.size)


@overload(gather_safe, jit_options={"inline": "always"})
def _gather_safe(xf, end, xs):
    if xf.dtype.bitwidth >= 32:
        return lambda xf, end, xs: xs < 2 ** 31
    return lambda xf, end, xs: xs < 2 ** 31 and end + 3 <= xf.size


def _splat(builder, v, n):
    vec = builder.insert_element(ir.Constant(ir.VectorType(v.type, n), ir.Undefined), v,
                                 ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n))


class _VectorGEP(ir.Instruction):
    """``getelementptr`` of one pointer by a vector of indices: a vector of pointers
    (llvmlite's builder takes scalar indices only). With 32-bit indices from one base
    the x86 backend emits ``vgatherdps`` (16 lanes an instruction; 64-bit addresses
    make it two ``vgatherqps``)."""

    def __init__(self, parent, ptr, idx):
        super().__init__(parent, ir.VectorType(ptr.type, idx.type.count), "getelementptr", [ptr, idx])

    def descr(self, buf):
        ptr, idx = self.operands
        buf.append("getelementptr %s, %s %s, %s %s\n" % (ptr.type.pointee, ptr.type, ptr.get_reference(),
                                                        idx.type, idx.get_reference()))


def _widen(builder, v, storage, ct, V):
    """Gathered elements ``v`` of ``x``'s storage type as the compute type ``ct``
    (as ``load_sample``: 16-bit bit patterns widened exactly, uint8 converted)."""
    if storage == types.int16:  # float16 bits
        return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), V)), ir.VectorType(ct, V))
    if storage == types.uint16:  # bfloat16 bits
        wide = builder.shl(builder.zext(v, ir.VectorType(ir.IntType(32), V)),
                           ir.Constant(ir.VectorType(ir.IntType(32), V), [16] * V))
        return builder.bitcast(wide, ir.VectorType(ir.FloatType(), V))
    if storage == types.uint8:
        return builder.uitofp(v, ir.VectorType(ct, V))
    return v


def direct(out, pw):
    """Whether ``gathered`` stores a block's samples straight into ``out``: ``out``
    holds the compute type of the weights ``pw`` (float32 or float64 results), so a
    sample needs no rounding or cast (``store_sample``)."""
    return out.dtype == pw.dtype


@overload(direct, jit_options={"inline": "always"})
def _direct(out, pw):
    same = out.dtype == pw.dtype
    return lambda out, pw: same


@intrinsic
def gathered(typingctx, x, xf, res, out, o, xb, base, pidx, pw, pok, j, mtok, s1, s2, interior, masked):
    """Sample ``j + l`` of the plan in the channel image at ``xf[xb:]``, for
    ``l < lanes(pw)``, in the compute type, stored as one vector: into ``out[o + l]``
    where ``direct(out, pw)``, else into ``res[l]`` (the caller rounds or casts
    them into ``out``). ``interior`` (a literal
    bool), taps from ``base`` (``xb + base[j] + tz * s2 + ty * s1 + tx``), else the
    padded offsets ``pidx`` (``xb + pidx[0, tz, j] + ...``), zeroed where ``pok`` is
    False if ``masked`` (a literal bool). ``x`` gives the rank, ``mtok`` the mode
    (taps per axis), ``s1``/``s2`` the strides of the second and third axes from the
    innermost.

    With ``pw`` a pair ``(w, d)`` of such weights (the backward's weights and their
    derivatives, ``(3, 4, n)`` each), each tap is gathered once and the ``r``
    samples ``q``, with axis ``q``'s weights ``d`` and the others' ``w`` (the
    derivative along axis ``q``), are stored at ``out[o + q * n + l]`` (``direct``
    only): each the bits of a call with those weights."""
    if not (isinstance(interior, types.BooleanLiteral) and isinstance(masked, types.BooleanLiteral)):
        return None
    r = x.ndim - 2
    multi = isinstance(pw, types.BaseTuple)
    wty = pw[0] if multi else pw
    R = r if multi else 1
    T = (1, 2, 4)[len(mtok)]
    V = 16 if wty.dtype == types.float32 else 8
    inner, mask_taps = interior.literal_value, masked.literal_value
    sig = types.void(x, xf, res, out, o, xb, base, pidx, pw, pok, j, mtok, s1, s2, interior, masked)

    def codegen(context, builder, sig, args):
        ta = sig.args
        intp = context.get_value_type(types.intp)
        o_, xb_, j_, s1_, s2_ = (context.cast(builder, args[i], ta[i], types.intp) for i in (4, 5, 10, 12, 13))
        arrays = {i: context.make_array(ta[i])(context, builder, args[i]) for i in (1, 2, 3, 6, 7, 9)}
        wts = [context.make_array(wty)(context, builder, builder.extract_value(args[8], i) if multi else args[8])
               for i in range(2 if multi else 1)]
        st = context.get_value_type(ta[1].dtype)  # x's storage element
        ct = context.get_value_type(wty.dtype)  # the compute type
        size = context.get_abi_sizeof(st)
        vs, vc, vi = ir.VectorType(st, V), ir.VectorType(ct, V), ir.VectorType(intp, V)
        vbool = ir.VectorType(ir.IntType(1), V)
        # 16-bit and uint8 elements are gathered as the 32-bit words they start (x86 gathers
        # no narrower elements; the caller makes sure that the word's other bytes lie
        # within ``xf``: ``gather_safe``) and truncated
        gt = st if size >= 4 else ir.IntType(32)
        vg = ir.VectorType(gt, V)
        vptr = ir.VectorType(gt.as_pointer(), V)
        elem = {ir.FloatType: "f32", ir.DoubleType: "f64"}.get(type(gt)) or "i32"
        name = "llvm.masked.gather.v%d%s.v%dp0" % (V, elem, V)
        gather = builder.module.globals.get(name) or ir.Function(
            builder.module, ir.FunctionType(vg, [vptr, ir.IntType(32), vbool, vg]), name)
        const = lambda v: ir.Constant(intp, v)  # noqa: E731
        zero = ir.Constant(vc, [ir.Constant(ct, 0.0)] * V)
        all_lanes = ir.Constant(vbool, [1] * V)

        def vector(i, k=None, t=None, ty=None):  # array i's elements [k, t, j:j + V] (or [j:j + V]) as a vector
            idx = [j_] if k is None else [const(k), const(t), j_]
            ptr = cgutils.get_item_pointer(context, builder, ta[i], arrays[i], idx)
            return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1)

        # element offsets from the channel image's first element, 32-bit (``gather_safe``:
        # the image holds fewer than 2**31 elements)
        i32 = ir.IntType(32)
        vo = ir.VectorType(i32, V)
        first = builder.gep(arrays[1].data, [xb_])
        start = vector(6, ty=vo) if inner else ir.Constant(vo, [0] * V)  # (base: int32)
        strides = (s2_, s1_, const(1))[3 - r:]

        def offset(k, t):  # tap t of axis k: its element offset, per lane
            if inner:
                return _splat(builder, builder.trunc(builder.mul(const(t), strides[k]), i32), V)
            return builder.trunc(vector(7, k, t, vi), vo)

        def inside(k, t):
            v8 = ir.VectorType(ir.IntType(8), V)
            return builder.icmp_unsigned("!=", vector(9, k, t, v8), ir.Constant(v8, [0] * V))

        # interior taps of the innermost axis are consecutive: ``G`` of them are gathered as
        # one word of ``G * size`` bytes (at least 4: the narrow elements' 32-bit words)
        # and split, so that fewer elements are gathered (the x86 code LLVM makes for
        # Zen's slow gathers is a scalar load a lane)
        G = min(T, max(1, 8 // size)) if inner else 1
        pair = ir.IntType(8 * max(4, G * size))
        gather_pair = None
        if G > 1:
            pname = "llvm.masked.gather.v%di%d.v%dp0" % (V, pair.width, V)
            vpair = ir.VectorType(pair, V)
            gather_pair = builder.module.globals.get(pname) or ir.Function(
                builder.module, ir.FunctionType(vpair, [ir.VectorType(pair.as_pointer(), V), ir.IntType(32), vbool,
                                                        vpair]), pname)

        def taps(off, t):  # the innermost axis' taps t .. t + G - 1 at offsets ``off`` from tap t's, per lane
            ptrs = _VectorGEP(builder.block, first, off)
            insert(builder, ptrs)
            if G == 1:
                if size < 4:
                    ptrs = builder.bitcast(ptrs, vptr)
                v = builder.call(gather, [ptrs, ir.Constant(ir.IntType(32), size),  # (the element's alignment)
                                          all_lanes, ir.Constant(vg, ir.Undefined)])
                return [builder.trunc(v, vs) if size < 4 else v]
            ptrs = builder.bitcast(ptrs, ir.VectorType(pair.as_pointer(), V))
            w = builder.call(gather_pair, [ptrs, ir.Constant(ir.IntType(32), size), all_lanes,
                                           ir.Constant(ir.VectorType(pair, V), ir.Undefined)])
            bits = ir.IntType(8 * size)
            out = []
            for e in range(G):
                sh = builder.lshr(w, ir.Constant(ir.VectorType(pair, V), [8 * size * e] * V)) if e else w
                v = builder.trunc(sh, ir.VectorType(bits, V))
                out.append(v if bits == st else builder.bitcast(v, vs))
            return out

        def weight(k, t, q):  # sample q's weights of tap t on axis k, [k, t, j:j + V] as a vector
            ptr = cgutils.get_item_pointer(context, builder, wty, wts[1 if multi and k == q else 0],
                                           [const(k), const(t), j_])
            return builder.load(builder.bitcast(ptr, vc.as_pointer()), align=1)

        def axis(k, off, ok):  # the R samples over axes k.. (0: the outermost)
            acc = [zero] * R
            if k == r - 1 and G > 1:
                for t0 in range(0, T, G):
                    for e, v in enumerate(taps(builder.add(off, offset(k, t0)), t0)):
                        v = _widen(builder, v, ta[1].dtype, ct, V)
                        acc = [builder.fadd(acc[q], builder.fmul(weight(k, t0 + e, q), v)) for q in range(R)]
                return acc
            for t in range(T):
                o2 = builder.add(off, offset(k, t))
                ok2 = builder.and_(ok, inside(k, t)) if mask_taps else ok
                if k == r - 1:
                    v = _widen(builder, taps(o2, t)[0], ta[1].dtype, ct, V)
                    if mask_taps:
                        v = builder.select(ok2, v, zero)
                    v = [v] * R
                else:
                    v = axis(k + 1, o2, ok2)
                acc = [builder.fadd(acc[q], builder.fmul(weight(k, t, q), v[q])) for q in range(R)]
            return acc

        samples = axis(0, start, all_lanes)
        if multi:  # sample q at out[o + q * n]
            n = cgutils.unpack_tuple(builder, wts[0].shape, 3)[2]
            for q in range(R):
                dest = builder.gep(arrays[3].data, [builder.add(o_, builder.mul(const(q), n))])
                builder.store(samples[q], builder.bitcast(dest, vc.as_pointer()), align=1)
            return context.get_dummy_value()
        if ta[3].dtype == wty.dtype:  # ``direct``
            dest = builder.gep(arrays[3].data, [o_])
        else:
            dest = arrays[2].data
        builder.store(samples[0], builder.bitcast(dest, vc.as_pointer()), align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def prefetch(typingctx, a, i):
    """Ask the CPU to bring the cache line of ``a[i]`` (a C-contiguous array, any
    index, also past its end: a prefetch never faults) into its caches
    (``llvm.prefetch``: a read, kept in every level)."""
    sig = types.void(a, i)

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        idx = context.cast(builder, args[1], sig.args[1], types.intp)
        ptr = builder.bitcast(builder.gep(arr.data, [idx]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = builder.module.globals.get("llvm.prefetch.p0") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0")
        builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen
