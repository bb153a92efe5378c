"""DeformConv inside onnxruntime through its C custom-op API, on onnxruntime's own pool.

``session``'s other route, onnxruntime-extensions' Python operators, runs a node in
Python on the thread that reached it: its inputs and output are copied, the GIL
taken, and numba_ops' parallel kernels would need numba's pool beside onnxruntime's,
which contend for the cores (see ``_ort.SPINNING``). Here a float32 or float64
DeformConv node of any rank is an ``OrtCustomOp`` whose compute is compiled code
(a numba ``cfunc``): it reads the node's inputs where onnxruntime holds them,
writes the output into onnxruntime's buffer, and runs the tiled kernel's pool
rounds (``kernels.cpu.deform_conv.task``) through ``KernelContext_ParallelFor`` on
onnxruntime's intra-op threads, the ones its own nodes use. Python runs only when
a node's input shapes change (``_Node.plan``: the function's checks, the tiling,
the workspaces), under the GIL.

How the pieces meet:

- onnxruntime registers custom operators from a shared library's
  ``RegisterCustomOps``. ``SHIM`` is that library, seven lines of C compiled
  once per machine with the C compiler (``cc``) into numba_ops' cache; it hands
  the call to ``_register``, a ctypes callback, which declares the operators.
  Without a compiler ``library()`` is None, and where the registration fails
  (onnxruntime older than API version 17) ``reason()`` says why: DeformConv
  nodes then take the Python route.
- The C API is a table of function pointers (``OrtApi``); ``API`` names the
  positions used here, which onnxruntime never moves (new functions are appended).
  The compiled compute calls them through ``_call`` (an indirect call), so it
  holds no address of this process and numba caches it on disk.
- Each node is a ``_Node`` whose int64 array ``S`` is the kernel object onnxruntime
  passes back: the input shapes seen last, pointers, the tiling's schedule and the
  workspaces. A node's compute holds the array's lock (concurrent ``run`` calls
  take turns on a node).
- A run-time error (an input shape the op refuses) is raised by ``plan`` inside
  a callback: it is recorded as the Python route records its errors
  (``_ort.record``) and an ``OrtStatus`` fails the node, so ``run`` raises the
  function's error and the process lives on.
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic, overload

from ..deform_conv import checked_params
from ..kernels.cpu import deform_conv as dc
from ..kernels.cpu._deform_plan import state
from ..kernels.cpu._opaque import INTERNAL, opaque

#: the custom-op domain of the nodes that run here
DOMAIN = "numba_ops.capi"

SHIM = r"""
typedef void *(*numba_ops_register_fn)(void *options, const void *api_base);
static numba_ops_register_fn registrar;
void numba_ops_set_registrar(numba_ops_register_fn f) { registrar = f; }
void *RegisterCustomOps(void *options, const void *api_base) {
    return registrar ? registrar(options, api_base) : (void *)0;
}
"""

#: positions in onnxruntime's OrtApi table (API version 17: KernelContext_ParallelFor)
API_VERSION = 17
API = dict(CreateStatus=0, GetErrorMessage=2, CreateCustomOpDomain=26, CustomOpDomain_Add=27, AddCustomOpDomain=28,
           GetTensorMutableData=51, GetDimensionsCount=61, GetDimensions=62, GetTensorTypeAndShape=65,
           KernelInfoGetAttribute_string=87, KernelContext_GetInput=90, KernelContext_GetOutput=91,
           ReleaseStatus=93, ReleaseTensorTypeAndShapeInfo=99, KernelContext_ParallelFor=274)
API_LEN = max(API.values()) + 1
# (the positions the compiled code calls, as plain globals: numba freezes them as constants)
_GET_INPUT, _GET_OUTPUT, _TYPE_AND_SHAPE = API["KernelContext_GetInput"], API["KernelContext_GetOutput"], \
    API["GetTensorTypeAndShape"]
_DIMS_COUNT, _GET_DIMS, _RELEASE_INFO = API["GetDimensionsCount"], API["GetDimensions"], \
    API["ReleaseTensorTypeAndShapeInfo"]
_DATA, _PARALLEL_FOR = API["GetTensorMutableData"], API["KernelContext_ParallelFor"]
_FAIL = 1  # OrtErrorCode ORT_FAIL
_FLOAT, _DOUBLE = 1, 11  # ONNXTensorElementDataType
_REQUIRED, _OPTIONAL = 0, 1  # OrtCustomOpInputOutputCharacteristic

# --- a node's state array ``S`` (int64) ---------------------------------------------------
LOCK, READY, TABLE, MODE, RD, N0, FN, NTH, REPLAN, NSCHED, SCHED, TMP, TMP2 = range(13)
PTR = 16  # + i: input i's data (X, W, offset, B, mask), + 5: Y's
META, NMETA, FWS, NFWS, IWS, NIWS, NOB = range(24, 31)
DIMS = 32  # + 8 * i: input i's rank (-1: absent) and sizes; i = 5: Y's
TDIMS = 80  # sizes read from onnxruntime, to compare
NS = 96
#: MODE: the tiled rounds on onnxruntime's pool, the tiled path on the caller's thread,
#: the direct loops (tiny calls; see ``deform_conv.launch``), nothing (an empty output)
TILED, SERIAL, DIRECT, EMPTY = range(4)


@intrinsic
def _vp(typingctx, a):
    """An integer address as a pointer."""
    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(types.int64), codegen


@intrinsic
def _addr(typingctx, p):
    """A pointer as an integer."""
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], ir.IntType(64))
    return types.int64(types.voidptr), codegen


@intrinsic
def _call(typingctx, fn, args):
    """Call the C function at address ``fn`` with the int64 tuple ``args`` (pointers and
    sizes as integers, as the x86-64 and AArch64 calling conventions pass them) and
    return its result as an int64 (a status pointer; garbage for a void function)."""
    if not isinstance(args, types.UniTuple) or args.dtype != types.int64:
        return None

    def codegen(context, builder, sig, a):
        i64 = ir.IntType(64)
        fty = ir.FunctionType(i64, [i64] * args.count)
        f = builder.inttoptr(a[0], fty.as_pointer())
        return builder.call(f, [builder.extract_value(a[1], i) for i in range(args.count)])
    return types.int64(types.int64, args), codegen


@intrinsic
def _swap(typingctx, p, v):
    """Atomically store ``v`` at the int64 address ``p``; returns what it held."""
    def codegen(context, builder, sig, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("xchg", ptr, args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


@njit(cache=True)
def _inputs(S, base, table, ctx):
    """Read the five inputs' pointers and sizes into ``S``; 0, or an error status.
    Marks ``S`` not READY where a shape changed."""
    for i in range(5):
        st = _call(table[_GET_INPUT], (ctx, np.int64(i), base + 8 * TMP))
        if st:
            return st
        v = S[TMP]
        d0 = DIMS + 8 * i
        if v == 0:  # an absent optional input
            if S[d0] != -1:
                S[d0], S[READY] = -1, 0
            S[PTR + i] = 0
            continue
        st = _call(table[_TYPE_AND_SHAPE], (v, base + 8 * TMP2))
        if st:
            return st
        info = S[TMP2]
        _call(table[_DIMS_COUNT], (info, base + 8 * TMP))
        nd = S[TMP]
        if nd > 7:  # no DeformConv input: ``plan`` says so
            S[d0], S[READY] = 8, 0
        else:
            _call(table[_GET_DIMS], (info, base + 8 * TDIMS, nd))
            if S[d0] != nd:
                S[d0], S[READY] = nd, 0
            for k in range(nd):
                if S[d0 + 1 + k] != S[TDIMS + k]:
                    S[d0 + 1 + k], S[READY] = S[TDIMS + k], 0
        _call(table[_RELEASE_INFO], (info,))
        st = _call(table[_DATA], (v, base + 8 * (PTR + i)))
        if st:
            return st
    return np.int64(0)


@njit(cache=True)
def _run(S, base, table, ctx):
    st = _inputs(S, base, table, ctx)
    if st:
        return st
    if not S[READY]:
        st = _call(S[REPLAN], (base,))
        if st:
            return st
    y = DIMS + 8 * 5
    st = _call(table[_GET_OUTPUT], (ctx, np.int64(0), base + 8 * (y + 1), S[y], base + 8 * TMP))
    if st:
        return st
    st = _call(table[_DATA], (S[TMP], base + 8 * (PTR + 5)))
    if st or S[MODE] == EMPTY:
        return st
    pf = table[_PARALLEL_FOR]
    if S[MODE] != TILED:  # on this thread (ParallelFor runs a single item in place)
        return _call(pf, (ctx, S[FN], np.int64(1), np.int64(0), base))
    sched = carray(_vp(S[SCHED]), (2 * S[NSCHED],), np.int64)
    for k in range(S[NSCHED]):
        S[N0], S[RD] = sched[2 * k], sched[2 * k + 1]
        st = _call(pf, (ctx, S[FN], S[NTH], np.int64(0), base))
        if st:
            return st
    return np.int64(0)


@cfunc(types.int64(types.voidptr, types.voidptr), cache=True)
def _compute(kernel, ctx):
    """The node's ``KernelComputeV2``: 0 or an ``OrtStatus``."""
    S = carray(kernel, (NS,), np.int64)
    base = _addr(kernel)
    while _swap(base + 8 * LOCK, np.int64(1)):  # another run is in this node
        pass
    st = _run(S, base, carray(_vp(S[TABLE]), (API_LEN,), np.int64), _addr(ctx))
    _swap(base + 8 * LOCK, np.int64(0))
    return st



# --- a node's compiled task: its arrays from ``S``, one pool item --------------------------

@njit(cache=True, inline="always")
def _t1(S, a):
    return (S[a],)


@njit(cache=True, inline="always")
def _t3(S, a):
    return (S[a], S[a + 1], S[a + 2])


@njit(cache=True, inline="always")
def _t4(S, a):
    return (S[a], S[a + 1], S[a + 2], S[a + 3])


@njit(cache=True, inline="always")
def _t5(S, a):
    return (S[a], S[a + 1], S[a + 2], S[a + 3], S[a + 4])


def _shape(S, a, n):
    """``(S[a], ..., S[a + n - 1])`` for a literal ``n``."""


@overload(_shape, prefer_literal=True, inline="always")
def _shape_ol(S, a, n):
    f = {1: _t1, 3: _t3, 4: _t4, 5: _t5}[n.literal_value]
    return lambda S, a, n: f(S, a)


def _task(S, th, dt, nd):
    """Pool item ``th`` of the node: its arrays (``nd`` dims, dtype ``dt``) from ``S``."""


@overload(_task, prefer_literal=True, inline="always")
def _task_ol(S, th, dt, nd):
    n = nd.literal_value

    def impl(S, th, dt, nd):
        x = carray(_vp(S[PTR]), _shape(S, DIMS + 1, n), dt)
        w = carray(_vp(S[PTR + 1]), _shape(S, DIMS + 9, n), dt)
        off = carray(_vp(S[PTR + 2]), _shape(S, DIMS + 17, n), dt)
        b = carray(_vp(S[PTR + 3] if S[PTR + 3] else S[NOB]), (S[DIMS + 25] if S[PTR + 3] else 0,), dt)
        m = off  # (never read without a mask)
        if S[PTR + 4]:
            m = carray(_vp(S[PTR + 4]), _shape(S, DIMS + 33, n), dt)
        y = carray(_vp(S[PTR + 5]), _shape(S, DIMS + 41, n), dt)
        meta = carray(_vp(S[META]), (S[NMETA],), np.int64)
        mode = S[MODE]
        if mode == TILED:
            fws = carray(_vp(S[FWS]), (S[NFWS],), dt)
            iws = carray(_vp(S[IWS]), (S[NIWS],), np.int64)
            dc.task(x, w, off, m, b, y, meta, fws, iws, np.int64(th), S[RD], S[N0])
        else:
            dc.on_caller(x, w, off, m, b, y, meta, mode == DIRECT)
    return impl


# one compiled task per dtype and rank, each a module-level function of its own (numba's
# disk cache keeps them apart); ``_task_fn`` wraps one in a small C callback on first use,
# compiled in the process and calling the task through its own code (``_opaque``: numba
# loads a cached callback without publishing the symbols it calls)
@njit(**INTERNAL)
def _f1(usr, th):
    _task(carray(usr, (NS,), np.int64), th, np.float32, 3)


@njit(**INTERNAL)
def _f2(usr, th):
    _task(carray(usr, (NS,), np.int64), th, np.float32, 4)


@njit(**INTERNAL)
def _f3(usr, th):
    _task(carray(usr, (NS,), np.int64), th, np.float32, 5)


@njit(**INTERNAL)
def _d1(usr, th):
    _task(carray(usr, (NS,), np.int64), th, np.float64, 3)


@njit(**INTERNAL)
def _d2(usr, th):
    _task(carray(usr, (NS,), np.int64), th, np.float64, 4)


@njit(**INTERNAL)
def _d3(usr, th):
    _task(carray(usr, (NS,), np.int64), th, np.float64, 5)


_TASKS = {(np.float32, 1): _f1, (np.float32, 2): _f2, (np.float32, 3): _f3, (np.float64, 1): _d1,
          (np.float64, 2): _d2, (np.float64, 3): _d3}
_TASK_FNS = {}
_TASK_LOCK = threading.Lock()


def _callback_of(task):
    call = opaque(task)

    @cfunc(types.void(types.voidptr, types.uintp))
    def fn(usr, th):
        call(usr, np.int64(th))
    return fn


def warm_task(kind, dtype, rank, device="cpu"):
    """Compile (or load from numba's disk cache) the task that a ``session``'s DeformConv
    node of float dtype name ``dtype`` (16-bit ones run the float32 kernel) and ``rank``
    runs (``numba_ops.warm`` calls it, ``kind`` naming it in its report)."""
    dt = np.float64 if dtype == "float64" else np.float32
    _TASKS[(dt, rank)].compile((types.voidptr, types.int64))


def _task_fn(dtype, rank):
    """The address of the C callback running pool item ``th`` of a node of ``dtype``
    and ``rank`` (``fn(S's address, th)``, as ``KernelContext_ParallelFor`` calls it)."""
    key = (dtype, rank)
    with _TASK_LOCK:
        f = _TASK_FNS.get(key)
        if f is None:
            f = _TASK_FNS[key] = _callback_of(_TASKS[key])
    return f.address


# --- the nodes ------------------------------------------------------------------------------

class _Node:
    """A DeformConv node's kernel object: its state array ``S`` (whose address
    onnxruntime holds) and what ``S`` points into."""

    def __init__(self, spec, text, dtype, threads):
        self.spec, self.text, self.dtype, self.threads = spec, text, np.dtype(dtype), threads
        self.S = np.zeros(NS, np.int64)
        self.S[TABLE] = _STATE["table"]
        self.S[REPLAN] = _REPLAN_ADDR
        self.S[DIMS:DIMS + 48:8] = -2  # nothing seen yet
        self.nob = np.empty(0, self.dtype)
        self.S[NOB] = self.nob.ctypes.data
        self.keep = ()

    def plan(self):
        """The node's checks and tiling for the input shapes in ``S`` (see ``deform_conv``)."""
        S, dt = self.S, self.dtype
        shapes = []
        for i in range(5):
            nd = int(S[DIMS + 8 * i])
            if nd > 7:
                raise ValueError(f"input {i} of DeformConv has more than 7 dimensions")
            shapes.append(None if nd < 0 else tuple(int(v) for v in S[DIMS + 8 * i + 1:DIMS + 8 * i + 1 + nd]))
        x, w, off, b, m = (None if s is None else np.lib.stride_tricks.as_strided(np.zeros(1, dt), s, (0,) * len(s))
                           for s in shapes)
        p = checked_params(x, w, off, b, m, **_attrs(self.spec.attrs))
        if x.ndim - 2 not in (1, 2, 3):
            raise ValueError(f"X must have 1 to 3 spatial dims; got shape {x.shape}")
        st = state(x, w, p)
        y = DIMS + 40
        S[y] = len(st.yshape)
        S[y + 1:y + 1 + len(st.yshape)] = st.yshape
        i = (2 if m is not None else 0) + (1 if b is not None else 0)
        keep = []
        if st.empty:
            S[MODE] = EMPTY
        elif st.small:
            S[MODE] = DIRECT if st.direct else SERIAL
            meta = st.tilings[1].metas[i]
            keep.append(meta)
        else:
            t = st.tiling(self.threads, x, w)
            S[MODE] = TILED
            meta = t.metas[i]
            fws, iws = np.empty(max(1, t.nf), dt), np.empty(max(1, t.ni), np.int64)
            sched = np.asarray(dc.schedule(st, t), np.int64).reshape(-1)
            keep += [meta, fws, iws, sched]
            S[FWS], S[NFWS], S[IWS], S[NIWS] = fws.ctypes.data, fws.size, iws.ctypes.data, iws.size
            S[SCHED], S[NSCHED], S[NTH] = sched.ctypes.data, sched.size // 2, t.plan.nth
        if not st.empty:
            S[META], S[NMETA] = meta.ctypes.data, meta.size
            S[FN] = _task_fn(dt.type, x.ndim - 2)
        self.keep = keep  # (the previous shapes' buffers are no longer pointed to)
        S[READY] = 1


def _attrs(attrs):
    """The function's keyword arguments from a DeformConv node's attributes."""
    a = dict(attrs)
    return dict(kernel_shape=a.get("kernel_shape"), strides=a.get("strides"), pads=a.get("pads"),
                dilations=a.get("dilations"), group=1 if a.get("group") is None else a["group"],
                offset_group=1 if a.get("offset_group") is None else a["offset_group"])


_NODES = {}  # S's address -> _Node
_STATE = {}  # "table": the OrtApi table's address, "lib": the shim's path, "error": why not available
_KEEP = []  # ctypes callbacks and structs that must outlive every session
_LOCK = threading.Lock()


def _callback(restype, *argtypes):
    def deco(f):
        c = ctypes.CFUNCTYPE(restype, *argtypes)(f)
        _KEEP.append(c)
        return ctypes.cast(c, ctypes.c_void_p).value
    return deco


def _fn(name, restype, *argtypes):
    return ctypes.CFUNCTYPE(restype, *argtypes)(ctypes.cast(_STATE["table"], ctypes.POINTER(ctypes.c_void_p))
                                                [API[name]])


def _status(exc):
    """An ``OrtStatus`` (as an int) failing the node with ``exc``'s message."""
    try:
        return _fn("CreateStatus", ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)(
            _FAIL, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace"))
    except BaseException:  # noqa: B036 (nothing may escape into onnxruntime)
        return None


@_callback(ctypes.c_int64, ctypes.c_int64)
def _replan(addr):
    node = _NODES.get(addr)
    try:
        node.plan()
        return 0
    except BaseException as exc:  # noqa: B036 (an exception escaping a callback is lost)
        from ._ort import record
        try:
            record(node.spec, node.text, exc)
        except BaseException:  # noqa: B036
            pass
        return _status(exc) or 0


_REPLAN_ADDR = _replan


class _OrtCustomOp(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32)] + [(f, ctypes.c_void_p) for f in (
        "CreateKernel", "GetName", "GetExecutionProviderType", "GetInputType", "GetInputTypeCount", "GetOutputType",
        "GetOutputTypeCount", "KernelCompute", "KernelDestroy", "GetInputCharacteristic", "GetOutputCharacteristic",
        "GetInputMemoryType", "GetVariadicInputMinArity", "GetVariadicInputHomogeneity", "GetVariadicOutputMinArity",
        "GetVariadicOutputHomogeneity", "CreateKernelV2", "KernelComputeV2", "InferOutputShapeFn", "GetStartVersion",
        "GetEndVersion", "GetMayInplace", "ReleaseMayInplace", "GetAliasMap", "ReleaseAliasMap")]


def op_type(dtype):
    """The custom op's type name for a DeformConv node computing in ``dtype``."""
    return f"DeformConv_{np.dtype(dtype).name}"


def _make_op(dtype):
    elem = _FLOAT if dtype == np.float32 else _DOUBLE
    name = ctypes.create_string_buffer(op_type(dtype).encode())
    ep = ctypes.create_string_buffer(b"CPUExecutionProvider")
    _KEEP.extend([name, ep])

    @_callback(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64))
    def create(op, api, info, out):
        try:
            size = ctypes.c_size_t(0)
            get = _fn("KernelInfoGetAttribute_string", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                      ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t))
            get(info, b"numba_ops", None, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            st = get(info, b"numba_ops", buf, ctypes.byref(size))
            if st:
                return st
            from ._ort import spec_of
            text = buf.value.decode()
            spec = spec_of(text)
            node = _Node(spec, text, dtype, spec.pool)
            addr = node.S.ctypes.data
            with _LOCK:
                _NODES[addr] = node
            out[0] = addr
            return None
        except BaseException as exc:  # noqa: B036
            return _status(exc)

    @_callback(None, ctypes.c_int64)
    def destroy(kernel):
        with _LOCK:
            _NODES.pop(kernel, None)

    c = ctypes.c_void_p
    op = _OrtCustomOp(
        version=16, CreateKernelV2=create, KernelComputeV2=_compute.address, KernelDestroy=destroy,
        GetName=_callback(c, c)(lambda op: ctypes.addressof(name)),
        GetExecutionProviderType=_callback(c, c)(lambda op: ctypes.addressof(ep)),
        GetInputType=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda op, i: elem),
        GetInputTypeCount=_callback(ctypes.c_size_t, c)(lambda op: 5),
        GetOutputType=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda op, i: elem),
        GetOutputTypeCount=_callback(ctypes.c_size_t, c)(lambda op: 1),
        GetInputCharacteristic=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda op, i: _OPTIONAL if i >= 3
                                                                            else _REQUIRED),
        GetOutputCharacteristic=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda op, i: _REQUIRED),
        GetInputMemoryType=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda op, i: 0),
        GetVariadicInputMinArity=_callback(ctypes.c_int, c)(lambda op: 1),
        GetVariadicInputHomogeneity=_callback(ctypes.c_int, c)(lambda op: 1),
        GetVariadicOutputMinArity=_callback(ctypes.c_int, c)(lambda op: 1),
        GetVariadicOutputHomogeneity=_callback(ctypes.c_int, c)(lambda op: 1))
    _KEEP.append(op)
    return op


@_callback(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
def _register(options, api_base):
    """``RegisterCustomOps``: the domain and its ops into ``options``."""
    try:
        get_api = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)(
            ctypes.cast(api_base, ctypes.POINTER(ctypes.c_void_p))[0])
        table = get_api(API_VERSION)
        if not table:
            raise RuntimeError(f"onnxruntime does not offer C API version {API_VERSION}")
        if _STATE.get("table") not in (None, table):
            raise RuntimeError("a second onnxruntime in this process")
        _STATE["table"] = table
        c = ctypes.c_void_p
        domain = c()
        st = _fn("CreateCustomOpDomain", c, ctypes.c_char_p, ctypes.POINTER(c))(DOMAIN.encode(), ctypes.byref(domain))
        if st:
            return st
        ops = _STATE.setdefault("ops", [_make_op(np.float32), _make_op(np.float64)])
        for op in ops:
            st = _fn("CustomOpDomain_Add", c, c, c)(domain, ctypes.addressof(op))
            if st:
                return st
        return _fn("AddCustomOpDomain", c, c, c)(options, domain)
    except BaseException as exc:  # noqa: B036
        _STATE["error"] = f"{type(exc).__name__}: {exc}"
        return _status(exc) if _STATE.get("table") else None


def _cache_dir():
    from numba import config
    root = config.CACHE_DIR or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                            "numba_ops")
    return os.path.join(root, "onnxruntime")


def _build():
    """The shim's path (compiled once into the cache), or raise why not."""
    tag = hashlib.sha256((SHIM + sys.platform + sysconfig.get_platform()).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"numba_ops_capi_{tag}.so")
    if os.path.exists(path):
        return path
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        cc = "cc"
        if shutil.which(cc) is None:
            raise RuntimeError("no C compiler (cc) to build numba_ops' onnxruntime shim")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "shim.c"), os.path.join(tmp, "shim.so")
        with open(src, "w") as f:
            f.write(SHIM)
        r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", out, src], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cc} could not build numba_ops' onnxruntime shim: {r.stderr.strip()[-500:]}")
        os.replace(out, path)  # (atomic: processes building at once each install a whole file)
    return path


def library():
    """The path of the shim to register in SessionOptions, or None where this route is
    not available (``reason()`` says why)."""
    with _LOCK:
        if "lib" not in _STATE and "error" not in _STATE:
            try:
                if sys.platform != "linux" or sys.maxsize <= 2 ** 32:
                    raise RuntimeError("onnxruntime's C API route is built for 64-bit Linux only")
                path = _build()
                lib = ctypes.CDLL(path)
                lib.numba_ops_set_registrar(ctypes.c_void_p(_register))
                _STATE["lib"] = path
                _KEEP.append(lib)
            except Exception as exc:
                _STATE["error"] = f"{type(exc).__name__}: {exc}"
    return _STATE.get("lib")


def reason():
    """Why DeformConv nodes take the Python route in this process (None if they do not)."""
    return _STATE.get("error")
