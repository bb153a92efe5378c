"""Scale-out on Dask: the ops on ``dask.array`` inputs.

Each wrapper returns a lazy ``dask.array`` with exact metadata (shape, dtype,
chunks, and a ``meta`` of the inputs' array type), one task per output block,
so graphs compose without computing anything and any Dask scheduler runs them:
threads, processes, or a ``dask.distributed`` cluster of many machines.

- Arguments are validated while the graph is built, with the one-call ops' own
  errors: the wrapper runs the op's front end on data-free stand-ins of the
  inputs (zero-stride NumPy views of their shapes and dtypes, with N = 0 so that
  nothing is computed), so nothing fails later inside a worker for a reason
  knowable up front.
- Inputs are chunked along N; their other axes are joined (rechunked to one
  chunk) where a block needs them whole. ``w`` and ``b`` (NumPy or dask) enter
  the graph once, as one single-chunk key that every task names; an ``x`` block
  is one key, however many output blocks read it.
- Blocks holding CuPy arrays (any ``__cuda_array_interface__`` exporter) run on
  the GPU, as the one-call ops' ``device=None`` does; their results are CuPy
  arrays and the result's ``meta`` is a CuPy array then.
- Threads: on a ``dask.distributed`` worker every task first sets numba's thread
  count (thread-local, so it holds for the task) to the worker's share of the
  machine's cores, ``cores * worker threads // all worker threads on its host``
  (the scheduler is asked once a minute). numba_ops runs one parallel kernel
  per process at a time, so the worker's tasks take turns on that share and the
  workers of a host together use its cores, not a multiple of them (workers that
  share a process, ``LocalCluster(processes=False)``, share one pool: their
  threads count together). On the threaded scheduler each task takes the cores
  over the tasks that can run at once (the fewer of the graph's tasks and the
  scheduler's threads: dask's ``num_workers``, else its CPU count); a task at one
  thread runs its kernel serially on its own thread, without the pool lock, so
  such tasks run side by side. On the synchronous scheduler (the calling thread)
  numba's setting is left alone.

This module imports dask; ``import numba_ops`` never does (install the extra
``numba_ops[dask]``).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
from typing import Any, Sequence

import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.array.utils import meta_from_array
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from ._dispatch import as_array, check_device, launcher, on_device, resolve_device, result_for
from ._validate import IntegerError, int_tuple
from .affine_grid import affine_grid as _affine_grid
from .deform_conv import parse_params
from .deform_conv import deform_conv as _deform_conv

__all__ = ["affine_grid", "deform_conv", "grid_sample", "affine_warp"]


# --- inputs and their data-free stand-ins ----------------------------------------------------

def _as_dask(a, name):
    """``a`` as a dask array (NumPy and other arrays as one block); None stays None."""
    if a is None or isinstance(a, da.Array):
        arr = a
    else:
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            a = as_array(a, name, "cpu")  # lists and such, with the front ends' errors
        arr = da.from_array(a, chunks=tuple(a.shape) or ())
    if arr is not None and any(math.isnan(s) for s in arr.shape):
        raise ValueError(f"{name} must have known chunk sizes (call compute_chunk_sizes() first); "
                         f"got shape {arr.shape}")
    return arr


def _stand_in(a, n=None):
    """A read-only zero-stride NumPy view with ``a``'s dtype and shape (N replaced by
    ``n`` when given): what the front ends validate, without data."""
    if a is None:
        return None
    shape = tuple(int(s) for s in a.shape)
    if n is not None and shape:
        shape = (n,) + shape[1:]
    try:
        dtype = np.dtype(a.dtype)
    except TypeError:
        dtype = np.dtype(object)
    return np.broadcast_to(np.zeros((), dtype), shape)


def _dry_run(op, arrays, batched, *args, **kw):
    """Run the front end ``op`` on stand-ins of ``arrays`` ({name: dask array or None},
    passed positionally, then ``args``), so that it raises what the one-call op
    would raise for these shapes, dtypes and attributes, and computes nothing.

    When the arrays named in ``batched`` have a leading axis of one length, their
    stand-ins get N = 0 (an empty call validates everything else); if that call
    fails, the full shapes run again for the one-call op's own message (a failing
    call stops at its checks, before any kernel). Arrays that disagree on N run
    with their full shapes at once: the front end fails on the disagreement (or on
    an earlier error)."""
    ns = {arrays[k].shape[0] if arrays[k].ndim else None for k in batched if arrays.get(k) is not None}
    full = [_stand_in(a) for a in arrays.values()]
    if len(ns) == 1 and None not in ns:
        try:
            return op(*[_stand_in(a, 0 if k in batched else None) for k, a in arrays.items()], *args, **kw)
        except (ValueError, TypeError):
            op(*full, *args, **kw)  # the message with the true shapes
            raise
    op(*full, *args, **kw)
    raise AssertionError(f"{op.__name__} accepted inputs of different N")  # pragma: no cover


def _single(a):
    """``a`` with one chunk (weights, bias): one key that every task names."""
    return None if a is None else a.rechunk(tuple(-1 for _ in a.shape))


def _meta(like, ndim, dtype):
    """An empty array of ``like``'s type (NumPy, CuPy, ...) with ``ndim`` and ``dtype``."""
    return meta_from_array(like._meta, ndim=ndim, dtype=dtype)


def _spatial_chunks(output_chunks, out_spatial):
    """``output_chunks`` (None, an int for every axis, or one entry per spatial output
    axis: an int block size, None or -1 for the whole axis, or a tuple of block sizes
    summing to it) as dask chunks of the spatial output axes."""
    nd = len(out_spatial)
    if output_chunks is None:
        return tuple((o,) for o in out_spatial)
    entries = output_chunks
    if isinstance(entries, (int, np.integer)) and not isinstance(entries, (bool, np.bool_)):
        entries = (entries,) * nd
    if not isinstance(entries, (list, tuple)) or len(entries) != nd:
        raise ValueError(f"output_chunks must have one entry per spatial output axis ({nd}) of the output "
                         f"{list(out_spatial)}: a block size, None or -1 (whole axis), or a tuple of block sizes; "
                         f"got {output_chunks!r}")
    chunks = []
    for ax, (e, o) in enumerate(zip(entries, out_spatial)):
        if e is None or (isinstance(e, (int, np.integer)) and not isinstance(e, (bool, np.bool_)) and e == -1):
            chunks.append((o,))
            continue
        if isinstance(e, (list, tuple)):
            sizes = int_tuple(e, f"output_chunks[{ax}]", minimum=1)
            if sum(sizes) != o:
                raise ValueError(f"output_chunks[{ax}] must sum to the output size {o} of spatial axis {ax}; "
                                 f"got {list(sizes)}")
            chunks.append(sizes)
            continue
        if isinstance(e, (bool, np.bool_)) or not isinstance(e, (int, np.integer)) or e < 1:
            raise ValueError(f"output_chunks[{ax}] must be a block size >= 1, None or -1 (whole axis), or a "
                             f"tuple of block sizes; got {e!r}")
        chunks.append(normalize_chunks((int(e),), shape=(o,))[0])
    return tuple(chunks)


# --- what runs in a task ---------------------------------------------------------------------

#: distributed worker address -> (time asked, numba threads for its tasks)
_SHARES = {}
_SHARE_TTL = 60.0


def _cores():
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _worker_threads():
    """numba threads for a task on this ``dask.distributed`` worker (see the module
    docstring), or None outside a worker."""
    dist = sys.modules.get("distributed")
    if dist is None:  # a worker process has imported it
        return None
    try:
        worker = dist.get_worker()
    except ValueError:
        return None
    now = time.monotonic()
    hit = _SHARES.get(worker.address)
    if hit is not None and now - hit[0] < _SHARE_TTL:
        return hit[1]
    import numba
    # numba_ops runs one parallel kernel per process at a time: the share is the process's,
    # whose workers (one, or several for LocalCluster(processes=False)) hold its threads
    peers = [w for w in getattr(type(worker), "_instances", ()) if w.status.name not in ("closed", "closing")]
    own = max(1, sum(_nthreads(w) for w in peers) if worker in peers else _nthreads(worker))
    host = own
    try:
        from distributed.utils import sync
        info = sync(worker.loop, worker.scheduler.identity, callback_timeout=10)
        host = sum(int(w.get("nthreads", 0)) for w in info["workers"].values()
                   if w.get("host") == worker.ip) or own
    except Exception:  # no answer: this worker's own threads are all we know of
        pass
    n = max(1, min(numba.config.NUMBA_NUM_THREADS, _cores() * own // max(own, host)))
    _SHARES[worker.address] = (now, n)
    return n


def _nthreads(worker):
    state = getattr(worker, "state", None)
    return int(getattr(state, "nthreads", None) or getattr(worker, "nthreads", 1))


def _scheduler_threads():
    """Threads of the local (threaded) scheduler running this task: dask's
    ``num_workers``, or its pool's size, else dask's CPU count."""
    import dask
    n = dask.config.get("num_workers", None)
    pool = dask.config.get("pool", None)
    if not n and pool is not None:
        n = getattr(pool, "_max_workers", None)
    if not n:
        from dask.system import CPU_COUNT
        n = CPU_COUNT
    return int(n)


def _share_threads(blocks):
    """Set numba's thread count (thread-local) for a task of a graph of ``blocks``
    tasks: on a distributed worker, the worker's share; on a thread of the local
    threaded scheduler, the cores over the tasks that can run at once (so that
    concurrent tasks each run their own share, serial ones without the pool, instead
    of queueing for one pool); on the calling thread itself (synchronous), untouched."""
    import numba
    n = _worker_threads()
    if n is None:
        if threading.current_thread() is threading.main_thread():
            return
        n = max(1, min(numba.config.NUMBA_NUM_THREADS, _cores() // max(1, min(blocks, _scheduler_threads()))))
    from .kernels.cpu import _runtime
    if _runtime.num_threads() != n:
        numba.set_num_threads(n)


def _in_share(blocks, fn, *args):
    """``fn(*args)`` with this task's share of numba's threads (``_share_threads``)."""
    _share_threads(blocks)
    return fn(*args)


def _is_cupy(a):
    return type(a).__module__.split(".")[0] == "cupy"


def _block_result(y, like):
    """A task's result in the type of its input block: CuPy for CuPy blocks (the
    front ends give numba device arrays, which CuPy takes without a copy)."""
    if _is_cupy(like) and not _is_cupy(y) and on_device(y):
        import cupy
        return cupy.asarray(y)
    return y


def _affine_grid_block(theta, *, tail, align_corners, kw):
    y = _affine_grid(theta, (theta.shape[0],) + tail, align_corners, **kw)
    return _block_result(y, theta)


def _deform_conv_block(x, w, offset, b, mask, *, attrs):
    return _block_result(_deform_conv(x, w, offset, b, mask, **attrs), x)


def _deform_conv_region(x, w, offset, b, mask, *, p, origin, device):
    """The output region ``origin .. origin + p.out_spatial`` of ``x``'s images:
    ``offset``/``mask`` hold that region, ``x`` whole images. The arguments passed
    the front end's checks when the graph was built (as ``deform_conv`` does them)."""
    inputs = (x, w, offset, b, mask)
    dev = resolve_device(device, inputs)
    back = any(on_device(a) for a in inputs)
    arrays = [as_array(a, name, dev) for a, name in zip(inputs, ("X", "W", "offset", "B", "mask"))]
    y = launcher("deform_conv", dev, arrays[0].dtype)(*arrays, _canonical(p), origin=origin)
    return _block_result(result_for(y, back), x)


_CANONICAL = {}


def _canonical(p):
    """One object per distinct DeformParams in this process, so that the launcher's
    per-geometry state (keyed by the object) is found again by every task."""
    if len(_CANONICAL) > 256:
        _CANONICAL.clear()
    return _CANONICAL.setdefault(p, p)


def _graph(name, tasks, deps, chunks, meta):
    """The lazy array of ``tasks`` (key -> (block function, args...)); every task
    first takes its share of numba's threads (``_in_share``)."""
    blocks = len(tasks)
    tasks = {k: (_in_share, blocks) + t for k, t in tasks.items()}
    graph = HighLevelGraph.from_collections(name, tasks, dependencies=[d for d in deps if d is not None])
    return da.Array(graph, name, chunks, meta=meta)


def _key(a, *index):
    return None if a is None else (a.name,) + index


# --- the ops ---------------------------------------------------------------------------------

def affine_grid(theta: Any, size: Sequence[int] | Any, align_corners: bool | int = False,
                **kw: Any) -> da.Array:
    """:func:`numba_ops.affine_grid` on a dask ``theta``, one task per N chunk.

    Parameters
    ----------
    theta : dask.array.Array or array_like, shape (N, 2, 3) or (N, 3, 4)
        Chunked along N (its other axes are joined). A NumPy array is one chunk.
    size : sequence or 1-D array of int
        As the one-call op: (N, C, H, W) or (N, C, D, H, W).
    align_corners : bool or {0, 1}, default False
        As the one-call op.
    **kw
        Passed to the one-call op in each task (``device``, ``stream``).

    Returns
    -------
    dask.array.Array
        The lazy grid (N, H, W, 2) or (N, D, H, W, 3) with ``theta``'s N chunks,
        whole along the other axes.

    Raises
    ------
    ValueError, TypeError
        The one-call op's errors, raised while the graph is built; also a
        ``ValueError`` when a block would be too large to allocate.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import numba_ops.dask as nd
    >>> theta = da.from_array(np.tile(np.eye(2, 3, dtype=np.float32), (4, 1, 1)), chunks=(2, 2, 3))
    >>> grid = nd.affine_grid(theta, (4, 1, 8, 8))
    >>> grid.shape, grid.chunks[0]
    ((4, 8, 8, 2), (2, 2))
    >>> grid.compute(scheduler="threads").shape
    (4, 8, 8, 2)
    """
    theta = _as_dask(theta, "theta")
    if theta is None:
        raise ValueError("theta is required")
    if "device" in kw:
        check_device(kw["device"])
    probe_kw = dict(kw, device="cpu")  # where it runs is the worker's matter
    if on_device(size):
        size = as_array(size, "size", "cpu")  # its values, read on the host
    try:
        sz = int_tuple(size, "size", length=(4, 5), minimum=0)
    except (ValueError, IntegerError, TypeError):
        sz = None
    if sz is None or theta.ndim != 3 or theta.shape[0] != sz[0]:
        # the one-call op's own error (a size of N = 0 with any theta is an empty grid)
        _affine_grid(_stand_in(theta), size, align_corners, **probe_kw)
        if sz is None or sz[0] != 0:  # pragma: no cover - the front end raised above
            raise AssertionError("affine_grid accepted inconsistent arguments")
        theta = theta[:0]
    try:
        _affine_grid(_stand_in(theta, 0), (0,) + sz[1:], align_corners, **probe_kw)
    except (ValueError, TypeError):
        _affine_grid(_stand_in(theta), size, align_corners, **probe_kw)  # the message with the true N
        raise
    nd = len(sz) - 2
    per_image = math.prod(sz[2:]) * nd * theta.dtype.itemsize
    if per_image * max(theta.chunks[0], default=0) > np.iinfo(np.intp).max:
        raise ValueError(f"size {list(sz)} asks for grid blocks of {max(theta.chunks[0])} images, too large to "
                         f"allocate: chunk theta finer along N")
    theta = theta.rechunk((theta.chunks[0], -1, -1))
    name = "affine_grid-" + tokenize(theta, sz, align_corners, kw)
    fn = functools.partial(_affine_grid_block, tail=tuple(sz[1:]), align_corners=align_corners, kw=kw)
    zeros = (0,) * (nd + 1)
    tasks = {(name, i) + zeros: (fn, (theta.name, i, 0, 0)) for i in range(len(theta.chunks[0]))}
    chunks = (theta.chunks[0],) + tuple((s,) for s in sz[2:]) + ((nd,),)
    return _graph(name, tasks, [theta], chunks, _meta(theta, nd + 2, theta.dtype))


_DC_ATTRS = ("kernel_shape", "strides", "pads", "dilations", "group", "offset_group")


def deform_conv(x: Any, w: Any, offset: Any, b: Any = None, mask: Any = None, *,
                output_chunks: Any = None, **attrs: Any) -> da.Array:
    """:func:`numba_ops.deform_conv` on dask arrays, one task per output block.

    Parameters
    ----------
    x : dask.array.Array or array_like, shape (N, C, D1, ..., Dn)
        Chunked along N (its other axes are joined).
    w : array_like or dask.array.Array, shape (oC, C / group, k1, ..., kn)
        NumPy, or dask in one chunk: it enters the graph once, as one key that
        every task names.
    offset : dask.array.Array or array_like
        As the one-call op; takes ``x``'s N chunks.
    b : array_like or dask.array.Array, optional
        As ``w``: one key.
    mask : dask.array.Array or array_like, optional
        As the one-call op; takes ``x``'s N chunks.
    output_chunks : int, sequence or None, optional
        A block size per spatial output axis (None or -1: the whole axis; or a
        tuple of block sizes). Each image's output is then cut into spatial
        blocks, every block reading its whole input image (offsets can reach
        anywhere in it) and only its own region of ``offset`` and ``mask``.
        Default: each image whole.
    **attrs
        The one-call op's keywords (``kernel_shape``, ``strides``, ``pads``,
        ``dilations``, ``group``, ``offset_group``, ``device``, ``stream``).

    Returns
    -------
    dask.array.Array
        The lazy (N, oC, o1, ..., on) result, chunked as ``x`` along N, whole
        along oC and as ``output_chunks`` along the spatial axes. Each block
        equals that region of the one-call result.

    Raises
    ------
    ValueError, TypeError
        The one-call op's errors, raised while the graph is built (the front
        end runs on data-free stand-ins of the inputs); a bad
        ``output_chunks``.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import numba_ops.dask as nd
    >>> x = da.ones((4, 1, 5, 5), dtype=np.float32, chunks=(2, 1, 5, 5))
    >>> w = np.ones((1, 1, 3, 3), np.float32)
    >>> offset = da.zeros((4, 18, 5, 5), dtype=np.float32, chunks=(2, 18, 5, 5))
    >>> y = nd.deform_conv(x, w, offset, pads=[1, 1, 1, 1], output_chunks=(3, 5))
    >>> y.chunks
    ((2, 2), (1,), (3, 2), (5,))
    >>> float(y[0, 0, 2, 2].compute())  # an interior position sums its 3 x 3 neighbours
    9.0
    """
    named = {"X": x, "W": w, "offset": offset, "B": b, "mask": mask}
    for name in ("X", "W", "offset"):
        if named[name] is None:
            raise ValueError(f"{name} is required")
    arrays = {name: _as_dask(a, name) for name, a in named.items()}
    if "device" in attrs:
        check_device(attrs["device"])
    # the one-call op's errors, nothing computed ("where" it runs is the worker's matter)
    _dry_run(_deform_conv, arrays, ("X", "offset", "mask"), **dict(attrs, device="cpu"))
    x, w, offset, b, mask = arrays.values()
    p = parse_params(_stand_in(x, 0), _stand_in(w), *(attrs.get(k, d) for k, d in
                                                 zip(_DC_ATTRS, (None, None, None, None, 1, 1))))
    nd = p.nd
    spatial = _spatial_chunks(output_chunks, p.out_spatial)
    nchunks = x.chunks[0]
    x = x.rechunk((nchunks,) + (-1,) * (nd + 1))
    offset = offset.rechunk((nchunks, -1) + spatial)
    mask = None if mask is None else mask.rechunk((nchunks, -1) + spatial)
    w, b = _single(w), _single(b)
    whole = all(len(c) == 1 for c in spatial)
    name = "deform_conv-" + tokenize(x, w, offset, b, mask, attrs, spatial)
    zeros = (0,) * (nd + 1)
    wk, bk = _key(w, *(0,) * w.ndim), _key(b, 0)
    tasks = {}
    if whole:
        fn = functools.partial(_deform_conv_block, attrs=attrs)
        for i in range(len(nchunks)):
            tasks[(name, i) + zeros] = (fn, (x.name, i) + zeros, wk, (offset.name, i) + zeros, bk,
                                        _key(mask, i, *zeros))
    else:
        starts = [np.cumsum((0,) + c[:-1]).tolist() for c in spatial]
        fns = {}
        for blk in np.ndindex(*(len(c) for c in spatial)):
            origin = tuple(int(s[j]) for s, j in zip(starts, blk))
            shape = tuple(c[j] for c, j in zip(spatial, blk))
            pb = fns.setdefault(shape, p._replace(out_spatial=shape))
            fn = functools.partial(_deform_conv_region, p=pb, origin=origin, device=attrs.get("device"))
            for i in range(len(nchunks)):
                tasks[(name, i, 0) + blk] = (fn, (x.name, i) + zeros, wk, (offset.name, i, 0) + blk, bk,
                                             _key(mask, i, 0, *blk))
    chunks = (nchunks, (int(w.shape[0]),)) + spatial
    return _graph(name, tasks, [x, w, offset, b, mask], chunks, _meta(x, nd + 2, x.dtype))


# --- grid_sample and affine_warp -------------------------------------------------------------

def _sampling_front(op):
    """The front end ``op`` ("grid_sample", "affine_warp") and its module's
    ``check_input_sizes`` (the one check an N = 0 stand-in skips)."""
    import importlib
    mod = importlib.import_module(f"numba_ops.{op}")
    checks = importlib.import_module("numba_ops.grid_sample")
    return getattr(mod, op), checks.check_input_sizes


def _required(named):
    for name, a in named.items():
        if a is None:
            raise ValueError(f"{name} is required")


def grid_sample(x: Any, grid: Any, **kw: Any) -> da.Array:
    """:func:`numba_ops.grid_sample` on dask arrays, one task per output block.

    Parameters
    ----------
    x : dask.array.Array or array_like, shape (N, C, D1, ..., Dr)
        Chunked along N (its other axes are joined).
    grid : dask.array.Array or array_like, shape (N, O1, ..., Or, r)
        Takes ``x``'s N chunks and may be chunked along its output axes
        O1..Or too (its last axis is joined): each grid block gives the output
        block of its positions over all channels.
    **kw
        The one-call op's keywords (``mode``, ``padding_mode``,
        ``align_corners``, ``device``, ``stream``).

    Returns
    -------
    dask.array.Array
        The lazy (N, C, O1, ..., Or) result, chunked as ``x`` along N, whole
        along C and as ``grid`` along O1..Or.

    Raises
    ------
    ValueError, TypeError
        The one-call op's errors, raised while the graph is built.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import numba_ops.dask as nd
    >>> x = da.ones((2, 3, 4, 4), dtype=np.float32, chunks=(1, 3, 4, 4))
    >>> grid = da.zeros((2, 6, 6, 2), dtype=np.float32, chunks=(1, 3, 6, 2))
    >>> y = nd.grid_sample(x, grid, mode="cubic")
    >>> y.chunks
    ((1, 1), (3,), (3, 3), (6,))
    >>> float(y.sum().compute())  # every position samples the image's centre: 1
    216.0
    """
    _required({"X": x, "grid": grid})
    arrays = {"X": _as_dask(x, "X"), "grid": _as_dask(grid, "grid")}
    if "device" in kw:
        check_device(kw["device"])
    op, check_input_sizes = _sampling_front("grid_sample")
    _dry_run(op, arrays, ("X", "grid"), **dict(kw, device="cpu"))
    x, grid = arrays.values()
    r = x.ndim - 2
    check_input_sizes(_stand_in(x), tuple(x.shape[:2]) + tuple(grid.shape[1:-1]))
    nchunks = x.chunks[0]
    x = x.rechunk((nchunks,) + (-1,) * (r + 1))
    grid = grid.rechunk((nchunks,) + grid.chunks[1:-1] + (-1,))
    name = "grid_sample-" + tokenize(x, grid, kw)
    fn = functools.partial(_sample_block, op="grid_sample", kw=kw)
    tasks = {}
    for i in range(len(nchunks)):
        for blk in np.ndindex(*(len(c) for c in grid.chunks[1:-1])):
            tasks[(name, i, 0) + blk] = (fn, (x.name, i) + (0,) * (r + 1), (grid.name, i) + blk + (0,))
    chunks = (nchunks, (int(x.shape[1]),)) + grid.chunks[1:-1]
    return _graph(name, tasks, [x, grid], chunks, _meta(x, r + 2, x.dtype))


def affine_warp(x: Any, theta: Any, size: Sequence[int] | Any = None, **kw: Any) -> da.Array:
    """:func:`numba_ops.affine_warp` on dask arrays, one task per N chunk.

    Parameters
    ----------
    x : dask.array.Array or array_like, shape (N, C, H, W) or (N, C, D, H, W)
        Chunked along N (its other axes are joined).
    theta : dask.array.Array or array_like, shape (N, 2, 3) or (N, 3, 4)
        Takes ``x``'s N chunks.
    size : sequence or 1-D array of int, optional
        As the one-call op (default ``x.shape``; N and C must be ``x``'s).
    **kw
        The one-call op's keywords (``mode``, ``padding_mode``,
        ``align_corners``, ``device``, ``stream``).

    Returns
    -------
    dask.array.Array
        The lazy result of shape ``size``, chunked as ``x`` along N and whole
        along the other axes.

    Raises
    ------
    ValueError, TypeError
        The one-call op's errors, raised while the graph is built.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import numba_ops.dask as nd
    >>> x = da.random.default_rng(0).random((4, 1, 6, 6), chunks=(2, 1, 6, 6)).astype(np.float32)
    >>> identity = np.tile(np.eye(2, 3, dtype=np.float32), (4, 1, 1))
    >>> y = nd.affine_warp(x, identity, padding_mode="border")
    >>> bool(da.allclose(y, x, atol=1e-6).compute())
    True
    """
    _required({"X": x, "theta": theta})
    arrays = {"X": _as_dask(x, "X"), "theta": _as_dask(theta, "theta")}
    if "device" in kw:
        check_device(kw["device"])
    op, check_input_sizes = _sampling_front("affine_warp")
    x, theta = arrays.values()
    probe_kw = dict(kw, device="cpu")
    if on_device(size):
        size = as_array(size, "size", "cpu")
    sz = None
    if size is not None:
        try:
            sz = int_tuple(size, "size")
        except (ValueError, IntegerError, TypeError):
            sz = ()
    if sz is not None and (not sz or not x.ndim or sz[0] != x.shape[0]):
        # a size the one-call op refuses: its own error, with the true shapes
        op(_stand_in(x), _stand_in(theta), size, **probe_kw)
        raise AssertionError("affine_warp accepted a size without X's N")  # pragma: no cover
    small = None if sz is None else (0,) + sz[1:]
    _dry_run(lambda xs, ts: op(xs, ts, small if xs.shape[:1] == (0,) else size, **probe_kw),
             arrays, ("X", "theta"))
    out = tuple(int(s) for s in (x.shape if sz is None else sz))
    check_input_sizes(_stand_in(x), out)
    nchunks = x.chunks[0]
    x = x.rechunk((nchunks,) + (-1,) * (x.ndim - 1))
    theta = theta.rechunk((nchunks, -1, -1))
    name = "affine_warp-" + tokenize(x, theta, out, kw)
    fn = functools.partial(_sample_block, op="affine_warp", kw=kw, tail=None if sz is None else out[1:])
    zeros = (0,) * (x.ndim - 1)
    tasks = {(name, i) + zeros: (fn, (x.name, i) + zeros, (theta.name, i, 0, 0)) for i in range(len(nchunks))}
    chunks = (nchunks,) + tuple((s,) for s in out[1:])
    return _graph(name, tasks, [x, theta], chunks, _meta(x, len(out), x.dtype))


def _sample_block(x, other, *, op, kw, tail=None):
    fn = _sampling_front(op)[0]
    if op == "affine_warp":
        y = fn(x, other, None if tail is None else (x.shape[0],) + tail, **kw)
    else:
        y = fn(x, other, **kw)
    return _block_result(y, x)
