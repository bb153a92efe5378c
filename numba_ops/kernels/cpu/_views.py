"""Views of C-contiguous arrays for the CPU kernels, made without numba's ``reshape``.

numba's ``reshape`` checks that the sizes agree and may raise, and the code for it
is a large share of a small kernel's compile time (AffineGrid's row function, 2-D:
0.41-0.61 s with one ``reshape``, 0.22 s with ``flat``) and 30-50 ns per array on
tiny calls. These intrinsics only re-describe the memory: the caller guarantees
that the array is C-contiguous (numba's type says so, or they refuse it) and, for
``shaped``, that the new shape holds exactly its elements. ``prefetch`` asks for
an element's cache line ahead of its use.
"""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .._compat import cgutils, struct_value


def _view(context, builder, aty, arr, rt, shape):
    """The C-contiguous view ``rt`` of array ``arr`` (type ``aty``) with extents ``shape``."""
    src = context.make_array(aty)(context, builder, arr)
    out = context.make_array(rt)(context, builder)
    strides = [src.itemsize]
    for extent in reversed(shape[1:]):
        strides.insert(0, builder.mul(strides[0], extent))
    context.populate_array(out, data=src.data, shape=cgutils.pack_array(builder, shape),
                           strides=cgutils.pack_array(builder, strides), itemsize=src.itemsize,
                           meminfo=src.meminfo, parent=src.parent)
    res = struct_value(out)
    context.nrt.incref(builder, rt, res)
    return res


def _merged(a, keep):
    """Typing and code of a view of ``a`` that keeps its first ``keep`` axes and merges the rest."""
    if not isinstance(a, types.Array) or a.layout != "C" or a.ndim < keep + 1:
        return None
    rt = a.copy(ndim=keep + 1)

    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        extents = cgutils.unpack_tuple(builder, context.make_array(aty)(context, builder, args[0]).shape, aty.ndim)
        n = context.get_constant(types.intp, 1)
        for extent in extents[keep:]:
            n = builder.mul(n, extent)
        return _view(context, builder, aty, args[0], rt, list(extents[:keep]) + [n])
    return rt(a), codegen


@intrinsic
def flat(typingctx, a):
    """The 1-D view of a C-contiguous array."""
    return _merged(a, 0)


@intrinsic
def flat3(typingctx, a):
    """The (d0, d1, rest) view of a C-contiguous array of rank 3 or more (DeformConv:
    images by channels by sites or positions, whatever the spatial rank)."""
    return _merged(a, 2)


@intrinsic
def shaped(typingctx, a, shape):
    """A C-contiguous array ``a`` (a 1-D slice of a workspace, say) viewed with the
    extents of the integer tuple ``shape``, whose product must be ``a.size``."""
    if not isinstance(a, types.Array) or a.layout != "C" or not isinstance(shape, types.BaseTuple) \
            or len(shape) == 0 or not all(isinstance(t, types.Integer) for t in shape):
        return None
    rt = a.copy(ndim=len(shape))

    def codegen(context, builder, sig, args):
        extents = [context.cast(builder, v, t, types.intp)
                   for v, t in zip(cgutils.unpack_tuple(builder, args[1], len(shape)), sig.args[1])]
        return _view(context, builder, sig.args[0], args[0], rt, extents)
    return rt(a, shape), codegen


@intrinsic
def carve(typingctx, buf, start, like, shape):
    """A C-contiguous array of ``like``'s type (a number or a bool) with the extents of
    the integer tuple ``shape``, over the bytes of ``buf`` (a C-contiguous uint8
    array) from byte ``start`` on; it keeps ``buf``'s memory alive. The caller keeps it
    aligned and inside ``buf``. One allocation then serves arrays of several dtypes and
    ranks, where numba compiles ``np.zeros`` once per dtype and rank (0.15-0.2 s each:
    GridSample's segment buffers took 1.3 s of its first call's compilation)."""
    if not isinstance(buf, types.Array) or buf.layout != "C" or buf.dtype != types.uint8 \
            or not isinstance(start, types.Integer) or not isinstance(like, (types.Number, types.Boolean)) \
            or not isinstance(shape, types.BaseTuple) or len(shape) == 0 \
            or not all(isinstance(t, types.Integer) for t in shape):
        return None
    dtype = types.unliteral(like)
    rt = types.Array(dtype, len(shape), "C")

    def codegen(context, builder, sig, args):
        bty = sig.args[0]
        src = context.make_array(bty)(context, builder, args[0])
        out = context.make_array(rt)(context, builder)
        itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(dtype)))
        extents = [context.cast(builder, v, t, types.intp)
                   for v, t in zip(cgutils.unpack_tuple(builder, args[3], len(shape)), sig.args[3])]
        strides = [itemsize]
        for extent in reversed(extents[1:]):
            strides.insert(0, builder.mul(strides[0], extent))
        first = context.cast(builder, args[1], sig.args[1], types.intp)
        data = builder.bitcast(builder.gep(src.data, [first]), context.get_data_type(dtype).as_pointer())
        context.populate_array(out, data=data, shape=cgutils.pack_array(builder, extents),
                               strides=cgutils.pack_array(builder, strides), itemsize=itemsize,
                               meminfo=src.meminfo, parent=src.parent)
        res = struct_value(out)
        context.nrt.incref(builder, rt, res)
        return res
    return rt(buf, start, like, shape), codegen


def layout(*parts):
    """``(offsets, total)``: the byte offsets of buffers of ``parts`` (each ``(elements,
    itemsize)``) laid out one after another in one allocation, each 64-byte aligned
    (for ``carve``), and the bytes in all."""
    offsets, o = [], 0
    for n, size in parts:
        offsets.append(o)
        o += -(-n * size // 64) * 64
    return tuple(offsets), o


@intrinsic
def prefetch(typingctx, a, i):
    """Ask the CPU to bring the cache line of ``a[i]`` (a 1-D C-contiguous array, ``i``
    an integer) into cache for reading: LLVM's ``prefetch`` hint, which never faults,
    whatever the address. Gathers whose addresses are known some steps ahead issue it
    for their later steps, so that several lines are on their way at once."""
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        at = builder.gep(arr.data, [context.cast(builder, args[1], sig.args[1], types.intp)])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                              "llvm.prefetch.p0")
        builder.call(hint, [builder.bitcast(at, i8p), i32(0), i32(3), i32(1)])  # read, keep in all levels, data
        return context.get_dummy_value()
    return types.void(a, i), codegen
