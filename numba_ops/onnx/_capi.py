"""numba_ops' nodes inside onnxruntime as compiled code on onnxruntime's own pool.

``session``'s compiled route (the other one, onnxruntime-extensions' Python
operators in ``_ort``, is the fallback). Every taken node (DeformConv, GridSample,
AffineGrid, AffineWarp, MMCVMultiScaleDeformableAttention; MMDeploy's nodes run as
the first two and the last) is an ``OrtCustomOp`` whose compute is compiled code (a
numba ``cfunc``): it reads the node's inputs where onnxruntime holds them, writes the
output into onnxruntime's buffer, and deals the kernel's units of work (GridSample's
segments, AffineGrid's rows, DeformConv's tiled rounds, multi-scale deformable
attention's query rows) onto onnxruntime's intra-op threads through
``KernelContext_ParallelFor``: the threads its own nodes use, no second pool, no
GIL, no copies. Python runs only when a node's input shapes change, or the values
of the small int64 inputs that shape its work (AffineGrid's size, the attention's
level shapes and starts: they key the plan) (``_Node.plan``: the function's own
checks, and the kernel's launch plan, the one its launcher runs by:
``launch_plan``/``plan`` in ``kernels/cpu``), under the GIL.

How the pieces meet:

- onnxruntime registers custom operators from a shared library's
  ``RegisterCustomOps``. ``SHIM`` is that library, seven lines of C compiled
  once per machine with the C compiler (``cc``) into numba_ops' cache (``numba-ops
  warm`` builds it); it hands the call to ``_register``, a ctypes callback, which
  adds the one domain of operators (made once per process) to the options.
  Without a compiler ``library()`` is None and ``reason()`` says why; nodes then
  take the Python route, and ``session`` warns.
- The C API is a table of function pointers (``OrtApi``); ``API`` names the
  positions used here by onnxruntime's names (``OrtApiSlots``), which onnxruntime
  never moves (new functions are appended).
  The compiled compute calls them through ``_call`` (an indirect call), so it
  holds no address of this process and numba caches it on disk.
- Each node is a ``_Node`` whose int64 array ``S`` is the kernel object onnxruntime
  passes back: the input shapes planned for and the plan (thread items, rounds,
  the kernel's packed parameters, a workspace; each op's own words of it, and its
  inputs, named once: ``DeformConvWords``, ``DeformConvInputs``...). A run copies
  what it needs into an array of its own (``L``: its inputs' and output's
  addresses, its round), under ``S``'s lock for the few instructions of the copy
  (and the plan, when the shapes changed), then computes without any lock:
  concurrent ``run`` calls of one session compute in parallel. The first run
  takes the node's workspace, a concurrent one allocates its own. Plans that a
  run in flight may still read are kept until none is.
- Each (op, dtypes, rank, mode, padding) variant is a compiled task (``_task_fn``)
  made when the first session needs it, from numba's disk cache after the first
  time. A plan names its task's variant; the run that finds it not compiled yet
  compiles it (``_compile``) with the node's lock released, and the runs that need
  it meanwhile wait on a Python lock, not spinning on the node's.
- A run-time error (an input shape the op refuses) is raised by ``plan`` inside
  a callback: it is recorded as the Python route records its errors
  (``_specs.record``) and an ``OrtStatus`` fails the node, so ``run`` raises the
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
from typing import NamedTuple

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic, overload

from ..affine_grid import checked as affine_grid_checked
from ..affine_warp import checked_call as affine_warp_checked
from ..grid_sample import checked_call as grid_sample_checked, parse_attrs
from ..deform_conv import checked_params
from ..ms_deform_attn import checked_call as ms_deform_attn_checked
from ..kernels._sample import as_compute
from . import MSDA, sample_kwargs
from ._specs import record, spec_of
from ..kernels.cpu import affine_grid as ag, affine_warp as aw, deform_conv as dc, grid_sample as gs
from ..kernels.cpu import ms_deform_attn as msda
from ..kernels.cpu._deform_plan import state
from ..kernels.cpu._opaque import INTERNAL, opaque
from ..kernels.cpu._runtime import pool_items

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

class OrtApiSlots(NamedTuple):
    """The positions of the functions used here in onnxruntime's ``OrtApi`` table, by
    their names there (onnxruntime_c_api.h; API version 17: KernelContext_ParallelFor).
    A global of this type is a constant to numba: ``table[API.CreateStatus]``."""
    CreateStatus: int = 0
    GetErrorMessage: int = 2
    CreateCustomOpDomain: int = 26
    CustomOpDomain_Add: int = 27
    AddCustomOpDomain: int = 28
    GetTensorMutableData: int = 51
    GetDimensionsCount: int = 61
    GetDimensions: int = 62
    GetTensorTypeAndShape: int = 65
    KernelInfoGetAttribute_string: int = 87
    KernelContext_GetInput: int = 90
    KernelContext_GetOutput: int = 91
    ReleaseStatus: int = 93
    ReleaseTensorTypeAndShapeInfo: int = 99
    KernelContext_ParallelFor: int = 274


API_VERSION = 17
API = OrtApiSlots()
API_LEN = max(API) + 1
_FAIL = 1  # OrtErrorCode ORT_FAIL
#: what the planner callback returns where it failed and onnxruntime made no status for its
#: error: the compiled code makes one of its own (never 0, which would be a success)
NO_STATUS = -1
_FLOAT, _UINT8, _INT64, _DOUBLE = 1, 2, 7, 11  # ONNXTensorElementDataType
_REQUIRED, _OPTIONAL = 0, 1  # OrtCustomOpInputOutputCharacteristic

# --- a node's state ``S`` and a run's ``L`` (int64 arrays of one layout) -------------------
# S only: the lock, the runs in flight, the plan's validity, the OrtApi table, the planner
# and compiler callbacks, the input count, the inputs whose values key the plan (a bit per
# input: AffineGrid's and AffineWarp's size, the attention's level shapes and starts), the
# node's workspace (busy?, addresses), the messages of a task's failure and of a plan's
# failure that had no status (C strings' addresses)
LOCK, INFLIGHT, READY, TABLE, REPLAN, COMPILE, NIN, KEYED, WSBUSY, CFWS, CIWS, ERRMSG, PLANMSG = range(13)
# the plan, copied into L by each run: the task (0 until it is compiled) and its variant
# (``_variant_id``), how it runs (``MODE``), items per pool round, DeformConv's rounds and
# packed vector, workspace words; then the op's own words (``OPW``: below)
PLAN0 = 13
FN, VARIANT, MODE, ITEMS, NSCHED, SCHED, META, NMETA, NFWS, NIWS, OPW = range(PLAN0, PLAN0 + 11)
OP_WORDS = 7
PLAN1 = OPW + OP_WORDS
# L only: the round under way, the workspaces' addresses, scratch for the C API's outputs,
# a task's failure
N0, RD, FWS, IWS, TMP, TMP2, FAILED = range(PLAN1, PLAN1 + 7)
MAXIN = 5
PTR = FAILED + 1  # + i: input i's data; + MAXIN: the output's
OUT = PTR + MAXIN  # the output's data
#: the words of an input's shape: its rank (-1: absent; 8: more than 7; 9: too many key
#: values), then its sizes
SHAPE_WORDS = 8
DIMS = OUT + 1  # + SHAPE_WORDS * i: input i's shape
YD = DIMS + SHAPE_WORDS * MAXIN  # the output's rank and sizes (part of the plan)
TDIMS = YD + SHAPE_WORDS  # sizes read from onnxruntime
KEYS = TDIMS + 8  # the keyed inputs' values, input after input (int64)
#: the keyed inputs' most values, all together (16 levels of 3-D shapes and their starts)
KEY_MAX = 64
NS = KEYS + KEY_MAX
#: MODE: nothing (an empty output), one item on the calling thread, items on the pool
EMPTY, ONE, POOL = range(3)
#: the most spatial axes of a node here (7 dimensions: ``_inputs`` reads up to 7)
MAX_RANK = 5


def _shape_words(i):
    return DIMS + SHAPE_WORDS * i


#: where input i's data address (``DATA[i]``), rank (``RANK[i]``) and first size
#: (``SIZES[i]``) are in ``L``; the output's sizes from ``YSIZES``
DATA = tuple(PTR + i for i in range(MAXIN))
RANK = tuple(_shape_words(i) for i in range(MAXIN))
SIZES = tuple(_shape_words(i) + 1 for i in range(MAXIN))
YSIZES = YD + 1


# --- each op: its inputs (ONNX's names, in order) and its words of the plan ----------------

class DeformConvInputs(NamedTuple):
    X: int = 0
    W: int = 1
    offset: int = 2
    B: int = 3
    mask: int = 4


class DeformConvWords(NamedTuple):
    how: int  # the launch plan's mode (kernels/cpu/deform_conv: DIRECT, SERIAL, TILED)
    nf: int  # the float workspace's elements
    nob: int  # the address of an empty bias (a node without B)


class GridSampleInputs(NamedTuple):
    X: int = 0
    grid: int = 1


class GridSampleWords(NamedTuple):
    units: int  # segments of output positions (the pool's items share them)
    align: int  # align_corners
    padding: int  # the padding's code (a run-time value of the kernels)
    grid_size: int  # the grid's elements
    out_size: int  # the output's elements


class AffineWarpInputs(NamedTuple):
    X: int = 0
    theta: int = 1
    size: int = 2  # (keyed)


class AffineWarpWords(NamedTuple):
    units: int
    align: int
    padding: int
    out_size: int
    depth: int  # the output's spatial sizes (depth 1 in 2-D)
    height: int
    width: int


class AffineGridInputs(NamedTuple):
    theta: int = 0
    size: int = 1  # (keyed)


class AffineGridWords(NamedTuple):
    rows: int  # output rows (the pool's items share them)
    align: int
    out_size: int


class MSDAInputs(NamedTuple):
    value: int = 0
    spatial_shapes: int = 1  # (keyed)
    level_start_index: int = 2  # (keyed)
    sampling_locations: int = 3
    attention_weights: int = 4


class MSDAWords(NamedTuple):
    rows: int  # query rows (the pool's items share them)
    levels: int  # the address of the plan's level table (kernels/_msda.level_table)
    nlevels: int


def _words(block):
    """The op's words of the plan, from ``OPW`` on (numba freezes the named tuple)."""
    assert len(block._fields) <= OP_WORDS
    return block(*range(OPW, OPW + len(block._fields)))


DC_IN, DC_W = DeformConvInputs(), _words(DeformConvWords)
GS_IN, GS_W = GridSampleInputs(), _words(GridSampleWords)
AW_IN, AW_W = AffineWarpInputs(), _words(AffineWarpWords)
AG_IN, AG_W = AffineGridInputs(), _words(AffineGridWords)
MS_IN, MS_W = MSDAInputs(), _words(MSDAWords)
#: the inputs whose values key an op's plan (a bit per input)
KEYED_INPUTS = {"AffineGrid": 1 << AG_IN.size, "AffineWarp": 1 << AW_IN.size,
                MSDA: 1 << MS_IN.spatial_shapes | 1 << MS_IN.level_start_index}

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


def _atomic(op):
    """An intrinsic ``f(p, v)``: LLVM's atomic ``op`` of ``v`` on the int64 at address
    ``p``; returns what it held."""
    @intrinsic
    def f(typingctx, p, v):
        def codegen(context, builder, sig, args):
            ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
            return builder.atomic_rmw(op, ptr, args[1], "seq_cst")
        return types.int64(types.int64, types.int64), codegen
    return f


_swap = _atomic("xchg")  # store v
_add = _atomic("add")


@njit(cache=True)
def _inputs(L, base, nin, keyed, table, ctx):
    """Read the inputs' addresses and sizes (and the keyed inputs' values) into ``L``;
    0 or an error status."""
    nkey = 0
    for i in range(nin):
        st = _call(table[API.KernelContext_GetInput], (ctx, np.int64(i), base + 8 * TMP))
        if st:
            return st
        v = L[TMP]
        d0 = RANK[i]
        if v == 0:  # an absent optional input
            L[d0], L[DATA[i]] = -1, 0
            continue
        st = _call(table[API.GetTensorTypeAndShape], (v, base + 8 * TMP2))
        if st:
            return st
        info = L[TMP2]
        _call(table[API.GetDimensionsCount], (info, base + 8 * TMP))
        nd = L[TMP]
        if nd > 7:  # no input of these ops: ``plan`` says so
            L[d0] = 8
        else:
            _call(table[API.GetDimensions], (info, base + 8 * TDIMS, nd))
            L[d0] = nd
            for k in range(nd):
                L[d0 + 1 + k] = L[TDIMS + k]
        _call(table[API.ReleaseTensorTypeAndShapeInfo], (info,))
        st = _call(table[API.GetTensorMutableData], (v, base + 8 * DATA[i]))
        if st:
            return st
        if (keyed >> i) & 1 and nd <= 7:  # the values decide the work: they key the plan
            count = np.int64(1)
            for k in range(nd):
                count *= L[d0 + 1 + k]
            if nkey + count > KEY_MAX:
                L[d0] = 9  # (``plan`` says what is wrong)
            else:
                vals = carray(_vp(L[DATA[i]]), (count,), np.int64)
                for k in range(count):
                    L[KEYS + nkey + k] = vals[k]
                nkey += count
    return np.int64(0)


@njit(cache=True)
def _lock(sbase):
    while _swap(sbase + 8 * LOCK, np.int64(1)):  # held for a copy (or a new plan)
        pass


@njit(cache=True)
def _failure(st, S, table):
    """The status a run fails with where a callback returned ``st`` (not 0)."""
    if st == NO_STATUS:
        return _call(table[API.CreateStatus], (np.int64(_FAIL), S[PLANMSG]))
    return st


@njit(cache=True)
def _begin(S, sbase, L, lbase, table, ctx):
    """A run's inputs, and the plan for their shapes (made where they changed) copied
    into ``L``, under ``S``'s lock; counts the run in flight. 0 or an error status.
    A plan whose task is not compiled yet (``FN`` 0) has it compiled without the lock
    held (seconds: ``_compile``), then is looked at again: the runs that need it wait
    for that compilation in Python, on a lock, not spinning here."""
    nin = S[NIN]
    st = _inputs(L, lbase, nin, S[KEYED], table, ctx)
    if st:
        return st
    while True:
        _lock(sbase)
        same = S[READY] != 0
        for k in range(DIMS, DIMS + SHAPE_WORDS * nin):
            if S[k] != L[k]:
                S[k] = L[k]
                same = False
        if S[KEYED]:
            for k in range(KEYS, KEYS + KEY_MAX):
                if S[k] != L[k]:
                    S[k] = L[k]
                    same = False
        if not same:
            S[READY] = 0
            st = _call(S[REPLAN], (sbase,))
            if st:  # (READY stays 0: the next run plans again)
                _swap(sbase + 8 * LOCK, np.int64(0))
                return _failure(st, S, table)
            S[READY] = 1
        if S[FN] != 0 or S[MODE] == EMPTY:
            break
        variant = S[VARIANT]
        _swap(sbase + 8 * LOCK, np.int64(0))
        st = _call(S[COMPILE], (sbase, variant, lbase + 8 * TMP))
        if st:
            return _failure(st, S, table)
        _lock(sbase)
        if S[VARIANT] == variant and S[FN] == 0:  # (a plan made meanwhile for the same variant too)
            S[FN] = L[TMP]
        _swap(sbase + 8 * LOCK, np.int64(0))
    for k in range(PLAN0, PLAN1):
        L[k] = S[k]
    for k in range(YD, YD + SHAPE_WORDS):
        L[k] = S[k]
    L[FWS] = L[IWS] = 0
    if L[NFWS] + L[NIWS] > 0 and S[WSBUSY] == 0:  # the node's workspace, else the run's own
        S[WSBUSY] = 1
        L[FWS], L[IWS] = S[CFWS], S[CIWS]
    S[INFLIGHT] += 1
    _swap(sbase + 8 * LOCK, np.int64(0))
    return np.int64(0)


@njit(cache=True)
def _exec(L, lbase, table, ctx, fw, iw):
    """The output, then the plan's items on onnxruntime's pool; 0 or an error status.
    ``fw``/``iw``: the run's own workspaces where it has not the node's."""
    st = _call(table[API.KernelContext_GetOutput], (ctx, np.int64(0), lbase + 8 * YSIZES, L[YD], lbase + 8 * TMP))
    if st:
        return st
    st = _call(table[API.GetTensorMutableData], (L[TMP], lbase + 8 * OUT))
    if st or L[MODE] == EMPTY:
        return st
    if L[FWS] == 0 and L[NFWS] + L[NIWS] > 0:
        L[FWS], L[IWS] = fw.ctypes.data, iw.ctypes.data
    pf = table[API.KernelContext_ParallelFor]
    if L[MODE] == ONE:  # (ParallelFor runs a single item in place)
        return _call(pf, (ctx, L[FN], np.int64(1), np.int64(0), lbase))
    if L[NSCHED] == 0:
        return _call(pf, (ctx, L[FN], L[ITEMS], np.int64(0), lbase))
    sched = carray(_vp(L[SCHED]), (2 * L[NSCHED],), np.int64)
    for k in range(L[NSCHED]):  # DeformConv's rounds, in order
        L[N0], L[RD] = sched[2 * k], sched[2 * k + 1]
        st = _call(pf, (ctx, L[FN], L[ITEMS], np.int64(0), lbase))
        if st or L[FAILED]:
            return st
    return np.int64(0)


@cfunc(types.int64(types.voidptr, types.voidptr), cache=True)
def _compute(kernel, ctx):
    """A node's ``KernelComputeV2``: 0 or an ``OrtStatus``."""
    S = carray(kernel, (NS,), np.int64)
    sbase = _addr(kernel)
    L = np.zeros(NS, np.int64)
    lbase = np.int64(L.ctypes.data)
    table = carray(_vp(S[TABLE]), (API_LEN,), np.int64)
    c = _addr(ctx)
    st = _begin(S, sbase, L, lbase, table, c)
    if st:
        return st
    took = L[FWS] != 0
    own = L[NFWS] + L[NIWS] > 0 and not took
    fw = np.empty(L[NFWS] if own else 0, np.int64)  # (8-byte words: enough for either float)
    iw = np.empty(L[NIWS] if own else 0, np.int64)
    st = _exec(L, lbase, table, c, fw, iw)
    if st == 0 and L[FAILED]:  # a task raised (never expected: the plan checked the inputs)
        st = _call(table[API.CreateStatus], (np.int64(_FAIL), S[ERRMSG]))
    if took:
        _swap(sbase + 8 * WSBUSY, np.int64(0))
    _add(sbase + 8 * INFLIGHT, np.int64(-1))
    return st


# --- the tasks: one pool item of a node's run, its arrays from ``L`` ------------------------

def _dims(L, a, tok):
    """``(L[a], ..., L[a + n - 1])``, ``n = len(tok)``."""


@overload(_dims, inline="always")
def _dims_ol(L, a, tok):
    n = len(tok)
    src = "def f(L, a, tok):\n    return (" + "".join(f"L[a + {k}], " for k in range(n)) + ")\n"
    ns = {}
    exec(src, ns)  # noqa: S102 (a tuple of n loads, n known when the overload types)
    return ns["f"]


def _arr(p, shape, z):
    """The array of ``shape`` at address ``p``, of ``z``'s dtype."""


@overload(_arr, inline="always")
def _arr_ol(p, shape, z):
    dt = getattr(np, str(z))  # (numba's float32, float64, uint8: NumPy's of the name)
    return lambda p, shape, z: carray(_vp(p), shape, dt)


@njit(**INTERNAL)
def _grid_sample_task(usr, th, xz, gz, xtok, mtok):
    L = carray(usr, (NS,), np.int64)
    x = _arr(L[DATA[GS_IN.X]], _dims(L, SIZES[GS_IN.X], xtok), xz)
    xf = _arr(L[DATA[GS_IN.X]], (x.size,), xz)
    gf = _arr(L[DATA[GS_IN.grid]], (L[GS_W.grid_size],), gz)
    out = _arr(L[OUT], (L[GS_W.out_size],), xz)
    gs.units_task(x, xf, gf, out, mtok, L[GS_W.padding], L[GS_W.align] != 0, gz, th, L[ITEMS], L[GS_W.units])


@njit(**INTERNAL)
def _affine_warp_task(usr, th, xz, tz, xtok, mtok):
    L = carray(usr, (NS,), np.int64)
    x = _arr(L[DATA[AW_IN.X]], _dims(L, SIZES[AW_IN.X], xtok), xz)
    xf = _arr(L[DATA[AW_IN.X]], (x.size,), xz)
    r = x.ndim - 2
    theta = _arr(L[DATA[AW_IN.theta]], (x.shape[0], r, r + 1), tz)
    out = _arr(L[OUT], (L[AW_W.out_size],), xz)
    aw.units_task(x, xf, theta, out, L[AW_W.depth], L[AW_W.height], L[AW_W.width], mtok, L[AW_W.padding],
                  L[AW_W.align] != 0, tz, th, L[ITEMS], L[AW_W.units])


@njit(**INTERNAL)
def _affine_grid_2d_task(usr, th, tz):
    L = carray(usr, (NS,), np.int64)
    theta = _arr(L[DATA[AG_IN.theta]], (L[SIZES[AG_IN.theta]], 2, 3), tz)
    grid = _arr(L[OUT], (L[YSIZES], L[YSIZES + 1], L[YSIZES + 2], 2), tz)
    ag.rows_task(theta, grid, 1, L[YSIZES + 1], L[YSIZES + 2], L[AG_W.align] != 0, as_compute(tz, 1), th, L[ITEMS],
                 L[AG_W.rows])


@njit(**INTERNAL)
def _affine_grid_3d_task(usr, th, tz):
    L = carray(usr, (NS,), np.int64)
    theta = _arr(L[DATA[AG_IN.theta]], (L[SIZES[AG_IN.theta]], 3, 4), tz)
    grid = _arr(L[OUT], (L[AG_W.out_size],), tz)
    ag.rows_task(theta, grid, L[YSIZES + 1], L[YSIZES + 2], L[YSIZES + 3], L[AG_W.align] != 0, as_compute(tz, 1), th,
                 L[ITEMS], L[AG_W.rows])


@njit(**INTERNAL)
def _ms_deform_attn_task(usr, th, z):
    L = carray(usr, (NS,), np.int64)
    d, dl, da = SIZES[MS_IN.value], SIZES[MS_IN.sampling_locations], SIZES[MS_IN.attention_weights]
    v = _arr(L[DATA[MS_IN.value]], (L[d], L[d + 1], L[d + 2], L[d + 3]), z)
    loc = _arr(L[DATA[MS_IN.sampling_locations]], (L[dl], L[dl + 1], L[dl + 2], L[dl + 3], L[dl + 4], L[dl + 5]), z)
    attn = _arr(L[DATA[MS_IN.attention_weights]], (L[da], L[da + 1], L[da + 2], L[da + 3], L[da + 4]), z)
    levels = carray(_vp(L[MS_W.levels]), (L[MS_W.nlevels], 3), np.int64)  # the plan's table, innermost first
    starts = carray(_vp(L[DATA[MS_IN.level_start_index]]), (L[MS_W.nlevels],), np.int64)
    out = _arr(L[OUT], (v.shape[0], loc.shape[1], v.shape[2], v.shape[3]), z)
    msda.rows_task(v, levels, starts, loc, attn, out, as_compute(z, 1), th, L[ITEMS], L[MS_W.rows])


@njit(**INTERNAL)
def _deform_conv_task(usr, th, z, xtok):
    L = carray(usr, (NS,), np.int64)
    x = _arr(L[DATA[DC_IN.X]], _dims(L, SIZES[DC_IN.X], xtok), z)
    w = _arr(L[DATA[DC_IN.W]], _dims(L, SIZES[DC_IN.W], xtok), z)
    off = _arr(L[DATA[DC_IN.offset]], _dims(L, SIZES[DC_IN.offset], xtok), z)
    pb = L[DATA[DC_IN.B]]
    b = _arr(pb if pb else L[DC_W.nob], (L[SIZES[DC_IN.B]] if pb else 0,), z)
    m = off  # (never read without a mask)
    if L[DATA[DC_IN.mask]]:
        m = _arr(L[DATA[DC_IN.mask]], _dims(L, SIZES[DC_IN.mask], xtok), z)
    y = _arr(L[OUT], _dims(L, YSIZES, xtok), z)
    meta = carray(_vp(L[META]), (L[NMETA],), np.int64)
    how = L[DC_W.how]
    if how == dc.TILED:
        fws = _arr(L[FWS], (L[DC_W.nf],), z)
        iws = carray(_vp(L[IWS]), (L[NIWS],), np.int64)
        dc.task(x, w, off, m, b, y, meta, fws, iws, th, L[RD], L[N0])
    else:
        dc.on_caller(x, w, off, m, b, y, meta, how == dc.DIRECT)


_TASK_FNS = {}
_TASK_LOCK = threading.Lock()


def _variant(op, elems, rank, attrs):
    """The compiled task of a node (``op``, its inputs' element types, X's rank, its
    attributes): ``(task, its constant arguments)``."""
    z = {_FLOAT: np.float32(0), _DOUBLE: np.float64(0), _UINT8: np.uint8(0)}
    if op == MSDA:  # (one task for levels of every rank)
        return _ms_deform_attn_task, (z[elems[0]],)
    if op == "AffineGrid":
        return (_affine_grid_2d_task if rank == 2 else _affine_grid_3d_task), (z[elems[0]],)
    tok = (0,) * (rank + 2)
    if op == "DeformConv":
        return _deform_conv_task, (z[elems[0]], tok)
    mode, _, _ = parse_attrs(*_sample_attrs(attrs))  # (the padding: a word of the plan, as align)
    task = _grid_sample_task if op == "GridSample" else _affine_warp_task
    return task, (z[elems[0]], z[elems[1]], tok, gs.TOKEN[mode])


def _sample_attrs(attrs):
    """(mode, padding_mode, align_corners) of a GridSample or AffineWarp node's attributes."""
    kw = sample_kwargs(**attrs)
    return kw["mode"], kw["padding_mode"], kw["align_corners"]


def _item_callback(call, extra):
    """The C callback ``fn(usr, th)`` that runs ``call(usr, th, *extra)`` (an
    ``opaque(task, failed=True)``: it says whether the task raised) and marks the run
    FAILED where it raised (nothing may escape into onnxruntime's thread). The
    constants are spelt out as globals of a generated function (a ``cfunc`` is small to
    compile: about 0.04 s, each variant once per process)."""
    names = ", ".join(f"e{i}" for i in range(len(extra)))
    src = (f"def fn(usr, th):\n    if call(usr, np.int64(th), {names}):\n"
           "        _swap(_addr(usr) + 8 * FAILED, np.int64(1))\n")
    ns = dict(call=call, np=np, _swap=_swap, _addr=_addr, FAILED=FAILED, **{f"e{i}": e for i, e in enumerate(extra)})
    exec(src, ns)  # noqa: S102 (a call with len(extra) constant arguments)
    return cfunc(types.void(types.voidptr, types.uintp))(ns["fn"])


def _task_key(task, extra):
    return task.py_func.__name__, tuple(type(e).__name__ if np.isscalar(e) else e for e in extra)


def _task_fn(op, elems, rank, attrs):
    """The address of the C callback running one pool item of a node's run
    (``fn(L's address, item)``, as ``KernelContext_ParallelFor`` calls it): compiled
    (or loaded from numba's disk cache) on first use in the process, one variant at a
    time (the others wait on ``_TASK_LOCK``)."""
    task, extra = _variant(op, elems, rank, attrs)
    key = _task_key(task, extra)
    with _TASK_LOCK:
        f = _TASK_FNS.get(key)
        if f is None:
            f = _TASK_FNS[key] = _item_callback(opaque(task, failed=True), extra)
    return f.address


def _compiled_task(op, elems, rank, attrs):
    """``_task_fn``'s address where that task is compiled in this process already, else 0."""
    f = _TASK_FNS.get(_task_key(*_variant(op, elems, rank, attrs)))
    return 0 if f is None else f.address


_VARIANTS = []  # a plan's VARIANT - 1 -> _task_fn's arguments
_VARIANT_IDS = {}
_VARIANT_LOCK = threading.Lock()  # (not _TASK_LOCK: a plan, under a node's lock, never waits for a compilation)


def _variant_id(op, elems, rank, attrs):
    """The number (from 1) that a plan holds for the task ``_task_fn(op, elems, rank,
    attrs)``, which ``_compile`` compiles outside the node's lock."""
    key = (op, tuple(elems), rank, tuple(sorted((k, repr(v)) for k, v in attrs.items())))
    with _VARIANT_LOCK:
        i = _VARIANT_IDS.get(key)
        if i is None:
            _VARIANTS.append((op, elems, rank, attrs))
            i = _VARIANT_IDS[key] = len(_VARIANTS)
    return i


def warm_calls(op, dtype):
    """``warm_task``'s arguments (after ``kind``) for every variant of the session's
    nodes of function ``op`` (``"grid_sample"``...) whose float inputs have dtype name
    ``dtype`` (16-bit: float32, as the session runs them): every rank, and for
    GridSample and AffineWarp X of that dtype and uint8, every mode and padding."""
    t = _DOUBLE if dtype == "float64" else _FLOAT
    if op == "ms_deform_attn":
        return [(MSDA, (t, _INT64, _INT64, t, t), 0, {})]
    onnx_op = "".join(w.capitalize() for w in op.split("_"))
    if onnx_op == "DeformConv":
        return [(onnx_op, (t,) * 5, r, {}) for r in (1, 2, 3)]
    if onnx_op == "AffineGrid":
        return [(onnx_op, (t, _INT64), r, {}) for r in (2, 3)]
    ranks = (1, 2, 3) if onnx_op == "GridSample" else (2, 3)
    return [(onnx_op, (x, t) if onnx_op == "GridSample" else (x, t, _INT64), r, {"mode": m, "padding_mode": p})
            for x in (t, _UINT8) for r in ranks for m in ("linear", "nearest", "cubic")
            for p in ("zeros", "border", "reflection")]


def warm_task(kind, op, elems, rank, attrs, device="cpu"):
    """Compile (or load from numba's disk cache) the task that a ``session``'s node of
    ``op`` (its inputs' ONNX element types, X's rank, its attributes) runs, and build
    the shim (``numba_ops.warm`` calls it, ``kind`` naming it in its report)."""
    library()
    _task_fn(op, elems, rank, attrs)


# --- the nodes ------------------------------------------------------------------------------

def dummy(shape, dtype):
    """A read-only array of ``shape`` and ``dtype`` that takes no memory (the checks read
    shapes and dtypes only)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape), writeable=False)


class _Node:
    """A node's kernel object: its state array ``S`` (whose address onnxruntime holds)
    and what ``S`` points into."""

    def __init__(self, spec, text, op_info):
        self.spec, self.text = spec, text
        self.op, self.elems = op_info
        self.dtypes = [None if e is None else np.dtype(_NP[e]) for e in self.elems]
        self.S = np.zeros(NS, np.int64)
        self.S[TABLE] = _STATE["table"]
        self.S[REPLAN] = _REPLAN_ADDR
        self.S[COMPILE] = _COMPILE_ADDR
        self.S[ERRMSG] = ctypes.addressof(_TASK_FAILED)
        self.S[PLANMSG] = ctypes.addressof(_PLAN_FAILED)
        self.S[NIN] = len(self.elems)
        self.S[KEYED] = KEYED_INPUTS.get(self.op, 0)
        self.S[DIMS:YD:SHAPE_WORDS] = -2  # nothing seen yet
        self.nob = np.empty(0, self.dtypes[0])
        self.keep = []  # what the plans that runs may still read point into

    def _shapes(self):
        """The inputs' shapes in ``S`` (None: absent), and the keyed inputs' values (by
        input index, arrays of their shapes)."""
        S, out, values, nkey = self.S, [], {}, 0
        for i in range(len(self.elems)):
            d0 = RANK[i]
            nd = int(S[d0])
            if nd == 8:
                raise ValueError(f"input {i} of {self.op} has more than 7 dimensions")
            if nd == 9:
                raise ValueError(f"{self.op}'s integer inputs (sizes, level shapes and starts) may hold at most "
                                 f"{KEY_MAX} values in all here; input {i} takes more")
            if nd < 0:
                out.append(None)
                continue
            out.append(tuple(int(v) for v in S[d0 + 1:d0 + 1 + nd]))
            if (int(S[KEYED]) >> i) & 1:
                count = int(np.prod(out[-1], dtype=np.int64))
                values[i] = S[KEYS + nkey:KEYS + nkey + count].copy().reshape(out[-1])
                nkey += count
        return out, values

    def plan(self):
        """The node's checks and launch plan for the input shapes in ``S``; called with
        ``S``'s lock held, from the compiled compute."""
        S = self.S
        shapes, values = self._shapes()
        a = self.spec.attrs
        keep = []
        S[PLAN0:PLAN1] = 0
        if self.op == "DeformConv":
            x, w, off, b, m = (None if s is None else dummy(s, dt) for s, dt in zip(shapes, self.dtypes))
            p = checked_params(x, w, off, b, m, **_deform_attrs(a))
            if x.ndim - 2 > MAX_RANK:
                raise ValueError(f"X must have at most {MAX_RANK} spatial dims here; got shape {x.shape}")
            st = state(x, w, p)
            lp = dc.plan(st, x, w, m is not None, b is not None, self.spec.pool)
            yshape, rank, S[DC_W.how], S[DC_W.nob] = st.yshape, x.ndim - 2, lp.mode, self.nob.ctypes.data
            S[MODE] = EMPTY if lp.mode == dc.EMPTY else POOL if lp.mode == dc.TILED else ONE
            if lp.meta is not None:
                keep.append(lp.meta)
                S[META], S[NMETA] = lp.meta.ctypes.data, lp.meta.size
            if lp.mode == dc.TILED:
                t = lp.tiling
                sched = np.asarray(dc.schedule(st, t), np.int64).reshape(-1)
                fws, iws = np.empty(max(1, t.nf), np.int64), np.empty(max(1, t.ni), np.int64)
                keep += [sched, fws, iws]
                S[SCHED], S[NSCHED], S[ITEMS] = sched.ctypes.data, sched.size // 2, t.plan.nth
                S[DC_W.nf], S[NFWS], S[NIWS] = t.nf, fws.size, iws.size
                S[CFWS], S[CIWS] = fws.ctypes.data, iws.ctypes.data
        elif self.op == MSDA:
            value, loc, attn = (dummy(shapes[i], self.dtypes[i])
                                for i in (MS_IN.value, MS_IN.sampling_locations, MS_IN.attention_weights))
            level_shapes, starts = values[MS_IN.spatial_shapes], values[MS_IN.level_start_index]
            *_, yshape = ms_deform_attn_checked(value, level_shapes, starts, loc, attn, "cpu")
            _, work, rows = msda.launch_plan(value.shape, loc.shape)
            levels = msda.level_table(level_shapes)
            keep.append(levels)
            rank = 0  # (one task for every rank)
            S[ITEMS] = pool_items(work, rows, self.spec.pool)
            S[MS_W.rows], S[MS_W.levels], S[MS_W.nlevels] = rows, levels.ctypes.data, levels.shape[0]
            S[MODE] = EMPTY if not int(np.prod(yshape)) else ONE if S[ITEMS] == 1 else POOL
        elif self.op == "AffineGrid":
            theta = shapes[AG_IN.theta]
            mode_args = affine_grid_checked(dummy(theta, self.dtypes[AG_IN.theta]), values[AG_IN.size].tolist(),
                                            a.get("align_corners") or 0)
            yshape, work, rows = ag.launch_plan(mode_args[1])
            rank = len(yshape) - 2
            S[ITEMS] = pool_items(work, rows, self.spec.pool)
            S[AG_W.rows], S[AG_W.align], S[AG_W.out_size] = rows, mode_args[2], int(np.prod(yshape))
            S[MODE] = EMPTY if not work else ONE if S[ITEMS] == 1 else POOL
        else:
            mode, padding, align = _sample_attrs(a)
            xi, oi = (GS_IN.X, GS_IN.grid) if self.op == "GridSample" else (AW_IN.X, AW_IN.theta)
            x, other = dummy(shapes[xi], self.dtypes[xi]), dummy(shapes[oi], self.dtypes[oi])
            if self.op == "GridSample":
                *_, (mcode, pcode, align), yshape = grid_sample_checked(x, other, mode, padding, align, "cpu")
                yshape, work, units = gs.launch_plan(x.shape, other.shape, mcode)
                S[GS_W.units], S[GS_W.align], S[GS_W.padding], S[GS_W.grid_size] = units, align, pcode, other.size
            else:
                size = values[AW_IN.size].reshape(-1).tolist()  # (as the Python route reads it)
                if len(size) >= 2 and x.ndim >= 2:
                    size[1] = x.shape[1]  # (AffineGrid's C is ignored: X's)
                *_, (mcode, pcode, align), yshape = affine_warp_checked(x, other, size, mode, padding, align, "cpu")
                work, units = aw.launch_plan(x.shape, yshape, mcode)
                S[AW_W.units], S[AW_W.align], S[AW_W.padding] = units, align, pcode
                S[AW_W.depth], S[AW_W.height], S[AW_W.width] = yshape[2] if len(yshape) == 5 else 1, yshape[-2], \
                    yshape[-1]
            rank = x.ndim - 2
            S[ITEMS] = pool_items(work, units, self.spec.pool)
            size = int(np.prod(yshape))
            S[GS_W.out_size if self.op == "GridSample" else AW_W.out_size] = size
            S[MODE] = EMPTY if not size else ONE if S[ITEMS] == 1 else POOL
        S[YD] = len(yshape)
        S[YSIZES:YSIZES + len(yshape)] = yshape
        if S[MODE] != EMPTY:  # the task, where it is compiled (else the run compiles it: ``_begin``)
            S[VARIANT] = _variant_id(self.op, self.elems, rank, a)
            S[FN] = _compiled_task(self.op, self.elems, rank, a)
        if S[INFLIGHT] == 0:
            self.keep = []
        self.keep.append(keep)


def _deform_attrs(attrs):
    """The function's keyword arguments from a DeformConv node's attributes."""
    a = dict(attrs)
    return dict(kernel_shape=a.get("kernel_shape"), strides=a.get("strides"), pads=a.get("pads"),
                dilations=a.get("dilations"), group=1 if a.get("group") is None else a["group"],
                offset_group=1 if a.get("offset_group") is None else a["offset_group"])


_TASK_FAILED = ctypes.create_string_buffer(b"RuntimeError: a numba_ops kernel failed on onnxruntime's thread")
_PLAN_FAILED = ctypes.create_string_buffer(b"RuntimeError: numba_ops could not plan the node (its error is raised "
                                           b"by the session's run)")
_NP = {_FLOAT: np.float32, _DOUBLE: np.float64, _UINT8: np.uint8, _INT64: np.int64}
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
                                                [getattr(API, name)])


def _status(exc):
    """An ``OrtStatus`` (as an int) failing the node with ``exc``'s message (a fixed one
    where that message cannot be made); None only where onnxruntime made none."""
    try:
        msg = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    except BaseException:  # noqa: B036 (an exception whose str() raises)
        msg = b"numba_ops: an error whose message could not be formatted"
    try:
        return _fn("CreateStatus", ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)(_FAIL, msg) or None
    except BaseException:  # noqa: B036 (nothing may escape into onnxruntime)
        return None


@_callback(ctypes.c_int64, ctypes.c_int64)
def _replan(addr):
    node = _NODES.get(addr)
    try:
        node.plan()
        return 0
    except BaseException as exc:  # noqa: B036 (an exception escaping a callback is lost)
        try:
            record(node.spec, node.text, exc)
        except BaseException:  # noqa: B036
            pass
        return _status(exc) or NO_STATUS  # never 0: that would run a plan not made


_REPLAN_ADDR = _replan


@_callback(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
def _compile(addr, variant, out):
    """Compile (or load) the task of the plan's ``variant`` (``_variant_id``), called
    without the node's lock; its address into the int64 at ``out``. 0 or a status."""
    try:
        ctypes.c_int64.from_address(out).value = _task_fn(*_VARIANTS[variant - 1])
        return 0
    except BaseException as exc:  # noqa: B036 (an exception escaping a callback is lost)
        node = _NODES.get(addr)
        try:
            record(node.spec, node.text, exc)
        except BaseException:  # noqa: B036
            pass
        return _status(exc) or NO_STATUS


_COMPILE_ADDR = _compile

class _OrtCustomOp(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32)] + [(f, ctypes.c_void_p) for f in (
        "CreateKernel", "GetName", "GetExecutionProviderType", "GetInputType", "GetInputTypeCount", "GetOutputType",
        "GetOutputTypeCount", "KernelCompute", "KernelDestroy", "GetInputCharacteristic", "GetOutputCharacteristic",
        "GetInputMemoryType", "GetVariadicInputMinArity", "GetVariadicInputHomogeneity", "GetVariadicOutputMinArity",
        "GetVariadicOutputHomogeneity", "CreateKernelV2", "KernelComputeV2", "InferOutputShapeFn", "GetStartVersion",
        "GetEndVersion", "GetMayInplace", "ReleaseMayInplace", "GetAliasMap", "ReleaseAliasMap")]


#: the compiled route's operators: type name -> (op, its inputs' element types, required
#: inputs, the output's element type); 16-bit nodes run in float32 between Casts
OPS = {}
for _t, _n in ((_FLOAT, "float32"), (_DOUBLE, "float64")):
    OPS[f"DeformConv_{_n}"] = ("DeformConv", (_t,) * 5, 3, _t)
    OPS[f"AffineGrid_{_n}"] = ("AffineGrid", (_t, _INT64), 2, _t)
    OPS[f"{MSDA}_{_n}"] = (MSDA, (_t, _INT64, _INT64, _t, _t), 5, _t)
    for _x, _xn in ((_t, _n), (_UINT8, "uint8")):
        OPS[f"GridSample_{_xn}_{_n}"] = ("GridSample", (_x, _t), 2, _x)
        OPS[f"AffineWarp_{_xn}_{_n}"] = ("AffineWarp", (_x, _t, _INT64), 3, _x)
_ONNX_NAMES = {_FLOAT: "float32", _DOUBLE: "float64", _UINT8: "uint8"}


def op_type(op, elems):
    """The compiled route's op type for a node of ``op`` whose inputs have the ONNX
    element types ``elems`` (None: absent), or None where it has none."""
    try:
        if op in ("DeformConv", "AffineGrid", MSDA):
            name = f"{op}_{_ONNX_NAMES[elems[0]]}"
        else:
            name = f"{op}_{_ONNX_NAMES[elems[0]]}_{_ONNX_NAMES[elems[1]]}"
    except KeyError:
        return None
    if name not in OPS or any(e not in (None, t) for e, t in zip(elems, OPS[name][1])):
        return None
    return name


def _make_op(name):
    op, ins, required, out = OPS[name]
    cname = ctypes.create_string_buffer(name.encode())
    ep = ctypes.create_string_buffer(b"CPUExecutionProvider")
    _KEEP.extend([cname, ep])

    @_callback(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64))
    def create(_, api, info, out_kernel):
        try:
            size = ctypes.c_size_t(0)
            get = _fn("KernelInfoGetAttribute_string", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
                      ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t))
            get(info, b"numba_ops", None, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            st = get(info, b"numba_ops", buf, ctypes.byref(size))
            if st:
                return st
            text = buf.value.decode()
            node = _Node(spec_of(text), text, (op, ins))
            addr = node.S.ctypes.data
            with _LOCK:
                _NODES[addr] = node
            out_kernel[0] = addr
            return None
        except BaseException as exc:  # noqa: B036
            return _status(exc)

    c = ctypes.c_void_p
    st = _OrtCustomOp(
        version=16, CreateKernelV2=create, KernelComputeV2=_compute.address, KernelDestroy=_destroy,
        GetName=_callback(c, c)(lambda _: ctypes.addressof(cname)),
        GetExecutionProviderType=_callback(c, c)(lambda _: ctypes.addressof(ep)),
        GetInputType=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda _, i: ins[i]),
        GetInputTypeCount=_callback(ctypes.c_size_t, c)(lambda _: len(ins)),
        GetOutputType=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda _, i: out),
        GetOutputTypeCount=_callback(ctypes.c_size_t, c)(lambda _: 1),
        GetInputCharacteristic=_callback(ctypes.c_int, c, ctypes.c_size_t)(
            lambda _, i: _OPTIONAL if i >= required else _REQUIRED),
        GetOutputCharacteristic=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda _, i: _REQUIRED),
        GetInputMemoryType=_callback(ctypes.c_int, c, ctypes.c_size_t)(lambda _, i: 0),
        GetVariadicInputMinArity=_callback(ctypes.c_int, c)(lambda _: 1),
        GetVariadicInputHomogeneity=_callback(ctypes.c_int, c)(lambda _: 1),
        GetVariadicOutputMinArity=_callback(ctypes.c_int, c)(lambda _: 1),
        GetVariadicOutputHomogeneity=_callback(ctypes.c_int, c)(lambda _: 1))
    _KEEP.append(st)
    return st


@_callback(None, ctypes.c_int64)
def _destroy(kernel):
    with _LOCK:
        _NODES.pop(kernel, None)


@_callback(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
def _register(options, api_base):
    """``RegisterCustomOps``: numba_ops' domain (made once per process: a session's
    options hold it, never own it) into ``options``."""
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
        with _LOCK:
            if "domain" not in _STATE:
                domain = c()
                st = _fn("CreateCustomOpDomain", c, ctypes.c_char_p, ctypes.POINTER(c))(
                    DOMAIN.encode(), ctypes.byref(domain))
                if st:
                    return st
                for name in OPS:
                    op = _make_op(name)
                    st = _fn("CustomOpDomain_Add", c, c, c)(domain, ctypes.addressof(op))
                    if st:
                        return st
                _STATE["domain"] = domain.value
        return _fn("AddCustomOpDomain", c, c, c)(options, _STATE["domain"])
    except BaseException as exc:  # noqa: B036
        _STATE["error"] = f"{type(exc).__name__}: {exc}"
        return _status(exc) if _STATE.get("table") else None


def _cache_dir():
    from numba import config
    root = config.CACHE_DIR or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                            "numba_ops")
    return os.path.join(root, "onnxruntime")


def _build():
    """The shim's path (compiled once into the cache; where the cache cannot be written,
    a read-only image's, into a folder of this user's under the temporary directory),
    or raise why not."""
    tag = hashlib.sha256((SHIM + sys.platform + sysconfig.get_platform()).encode()).hexdigest()[:16]
    name = f"numba_ops_capi_{tag}.so"
    tmp = os.path.join(tempfile.gettempdir(), f"numba_ops_{os.getuid()}")
    for folder in (_cache_dir(), tmp):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
        try:
            os.makedirs(folder, exist_ok=True)
            if os.access(folder, os.W_OK):
                return _compile(path)
        except OSError:
            continue
    raise RuntimeError(f"no writable folder for numba_ops' onnxruntime shim ({_cache_dir()}, {tmp})")


def _compile(path):
    """Compile the shim into ``path``."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        cc = "cc"
        if shutil.which(cc) is None:
            raise RuntimeError("no C compiler (cc) to build numba_ops' onnxruntime shim")
    # (a temporary folder beside it: os.replace stays within one file system)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
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


def route_status():
    """One line for ``numba-ops info``: whether ``session``'s nodes run compiled on
    onnxruntime's threads here, and why not."""
    lib = library()
    if lib is None:
        return f"Python route only (onnxruntime-extensions, slower): {reason()}"
    return f"compiled route: every node on onnxruntime's threads (shim {lib})"


def reason():
    """Why nodes take the Python route in this process (None if they do not)."""
    return _STATE.get("error")
