"""Device plumbing shared by the CUDA launchers (device inputs and results, streams).

- ``as_device_array``: any object with ``__cuda_array_interface__`` (numba device
  arrays, CuPy, PyTorch CUDA tensors) as a numba device array, zero-copy. PyTorch
  exports bfloat16 with the untyped typestr ``"<V2"``; it is read as uint16 bits
  and viewed as ``ml_dtypes.bfloat16``.
- ``flat``: an input as the 1-D, C-contiguous array of its storage dtype that the
  kernels index with 64-bit flat offsets. Host arrays are copied over; contiguous
  device arrays are a view; strided device arrays (transposes, negative or zero
  strides) are packed on the device by ``_pack``.
- ``finish``: the kernel's flat storage output as the public result: a NumPy
  array for host inputs, a numba device array otherwise.
- ``as_stream``: the public ``stream=`` as the numba stream that a launcher
  passes to all of its work (kernels, copies, allocations, ``flat``, ``finish``);
  with device inputs nothing waits for it, with host inputs ``finish``
  synchronises it after the copy back.

With ``NUMBA_ENABLE_CUDASIM=1`` numba's simulator stands in for the GPU: its
"device" arrays live in host memory, so a foreign ``__cuda_array_interface__`` is
read straight from its pointer (tests use that to exercise the bfloat16 path).
"""
import contextlib
import sys
import threading

import numpy as np
from numba import cuda
from numba.extending import overload

from .. import _compat
from .._arrays import is_numba_device_array
from .._dtypes import BFLOAT16, DTYPES, SUPPORTED, storage

SIMULATOR = _compat.cuda_simulator_enabled()


if not SIMULATOR:  # shared helpers use np.floor (a float result, so the CPU loop vectorises)
    _compat.register_np_floor()

#: threads per block for the element-wise kernels; the simulator runs every
#: thread as a Python thread, so it gets few (and few blocks, which also makes
#: its runs exercise the grid-stride loops).
THREADS = 32 if SIMULATOR else 256
MAX_BLOCKS = 3 if SIMULATOR else 1 << 16


_SIM_LOCK = threading.RLock()


if SIMULATOR:  # its shared arrays are made without a lock: garbage reads (CI saw them)
    _compat.lock_simulated_shared_arrays()


@contextlib.contextmanager
def launch_guard():
    """Wraps every launcher, and the host code of this module used from outside
    one. On a GPU it does nothing. In the simulator it serialises them (while a
    simulated kernel runs, numba swaps the ``cuda`` global of the kernel's module
    for a fake, which breaks host code of that module running in another thread)
    and shortens the interpreter's thread switch interval: the simulator's block
    manager busy-polls its threads, so each ``syncthreads`` otherwise costs a 5 ms
    GIL hand-over (measured: 7x faster)."""
    if not SIMULATOR:
        yield
        return
    with _SIM_LOCK:
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        try:
            yield
        finally:
            sys.setswitchinterval(old)


# --- streams (every op's ``stream=``) ---------------------------------------------

def _stream_type():
    return _compat.stream_type(SIMULATOR)


def _handle(stream):
    """The integer handle that ``stream`` stands for, or None if it names none."""
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:  # the CUDA stream protocol: (version, handle), a method (older: a tuple)
        try:
            version, handle = proto() if callable(proto) else proto
        except (TypeError, ValueError):
            return None
        return int(handle) if version == 0 and isinstance(handle, int) and not isinstance(handle, bool) else None
    for attr in ("cuda_stream", "ptr"):  # PyTorch's torch.cuda.Stream, CuPy's Stream
        handle = getattr(stream, attr, None)
        if isinstance(handle, int) and not isinstance(handle, bool):
            return handle
    if isinstance(stream, (int, np.integer)) and not isinstance(stream, (bool, np.bool_)):
        return int(stream)
    return None


def as_stream(stream):
    """The numba stream that a CUDA launch uses for the public ``stream=`` argument.

    - ``None``: ``0``, numba's name for the default stream (what numba's launches,
      copies and allocations take when no stream is given);
    - a numba stream: itself;
    - an object with ``__cuda_stream__`` (the CUDA stream protocol, version 0:
      ``(0, handle)``), else a PyTorch CUDA stream (``.cuda_stream``) or a CuPy
      stream (``.ptr``), or an integer handle: ``0`` is the legacy default stream,
      any other handle is wrapped by ``cuda.external_stream`` (the caller keeps the
      stream alive for the call's work).

    Anything else is a TypeError naming ``stream``. In the simulator every launch is
    synchronous and ``external_stream`` does not exist: a handle is checked as on a
    GPU and stands for the simulator's default stream.

    Every CUDA launch passes the result to all of its work: ``kernel[blocks,
    threads, s]``, ``cuda.to_device(a, stream=s)``, ``cuda.device_array(n, dtype,
    stream=s)``, ``flat(a, s)`` and ``finish(..., stream=s)`` (which synchronises
    ``s`` after a copy back to the host, and nothing otherwise).
    """
    if stream is None:
        return 0
    if isinstance(stream, _stream_type()):
        return stream
    handle = _handle(stream)
    if handle is None or handle < 0:
        raise TypeError(
            "stream must be None, a numba CUDA stream, an object with __cuda_stream__ (the CUDA stream "
            "protocol, version 0), a CuPy or PyTorch CUDA stream, or a non-negative integer stream handle; "
            f"got {stream!r}" + ("" if handle is None else f" (handle {handle})"))
    with launch_guard():
        if handle == 0:
            return cuda.legacy_default_stream()
        return cuda.default_stream() if SIMULATOR else cuda.external_stream(handle)


def blocks_for(n):
    """Blocks of ``THREADS`` for ``n`` work items; grid-stride loops cover whatever this leaves."""
    return max(1, min(MAX_BLOCKS, -(-int(n) // THREADS)))


# --- importing device arrays ---------------------------------------------------

def interface_desc(obj, name):
    """``obj.__cuda_array_interface__`` and whether it holds bfloat16.

    An untyped 2-byte typestr (``"<V2"``) is bfloat16 when the object says so
    through its ``dtype`` (``torch.bfloat16``, or an ``ml_dtypes`` dtype); the
    returned description then reads it as ``"<u2"`` bits. Any other untyped
    typestr is a TypeError naming ``name``.
    """
    try:
        desc = dict(obj.__cuda_array_interface__)
        dt = np.dtype(desc["typestr"])
        desc["shape"], desc["data"] = tuple(desc["shape"]), tuple(desc["data"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TypeError(f"{name} has a malformed __cuda_array_interface__ "
                        f"(needs shape, typestr and data): {type(exc).__name__}: {exc}") from None
    if desc.get("mask") is not None:
        raise TypeError(f"{name} is a masked CUDA array (__cuda_array_interface__ mask); "
                        "masked arrays are not supported")
    if dt.kind != "V":
        return desc, False
    if dt.itemsize == 2 and "bfloat16" in str(getattr(obj, "dtype", "")):
        desc["typestr"] = "<u2"
        return desc, True
    raise TypeError(f"{name} exports the untyped dtype {desc['typestr']!r} through __cuda_array_interface__ "
                    f"and does not say it is bfloat16; expected one of {SUPPORTED}")


class _HostView:
    """Simulator only: a foreign interface's memory is host memory; NumPy reads it."""

    def __init__(self, desc, owner):
        self.owner = owner  # keeps the memory alive as long as the view
        self.__array_interface__ = {"data": desc["data"], "shape": desc["shape"],
                                    "strides": desc.get("strides"), "typestr": desc["typestr"],
                                    "version": 3}


def _from_interface(desc, owner):
    if SIMULATOR:
        return _compat.simulated_device_array(np.asarray(_HostView(desc, owner)))
    # not synchronised here: the launcher knows the call's stream (await_producers)
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


def as_device_array(obj, name):
    """``obj`` (anything with ``__cuda_array_interface__``) as a numba device array,
    without a copy. Its dtype is checked by the front end. (Under ``launch_guard``,
    as every use of this module's ``cuda`` from outside a launcher: see there.)"""
    if is_numba_device_array(obj):
        return obj
    desc, bf16 = interface_desc(obj, name)
    with launch_guard():
        arr = _from_interface(desc, obj)
    return arr.view(BFLOAT16) if bf16 else arr


def _stream_handle(s):
    return 0 if not s else int(s)


def await_producers(arrays, stream):
    """The CUDA array interface (v3) names the stream on which an exporter (CuPy,
    for one) may still be writing an array; a consumer must not read it before
    that work is done, unless it reads on that same stream. numba_ops imports such
    arrays unsynchronised (``as_device_array``) and here, once the call's
    ``stream`` is known, synchronises each exporter's stream that differs from it
    (what numba's own import does always). So a call on the exporter's stream
    never waits. numba's own arrays (their streams are not imported) are left as
    numba leaves them: ordering those is the caller's, as in numba."""
    for a in arrays:
        s = getattr(a, "stream", 0) if a is not None and not isinstance(a, np.ndarray) else 0
        if s and getattr(s, "external", False) and _stream_handle(s) != _stream_handle(stream):
            s.synchronize()


# --- inputs as flat storage arrays ---------------------------------------------

def strided_get(a, i):
    """``a`` at C-order flat position ``i``, whatever ``a``'s strides."""
    return a[np.unravel_index(i, a.shape)]


@overload(strided_get, jit_options={"inline": "always"})
def _strided_get(a, i):
    # Generated per rank: the unravelled index must be a tuple of a fixed length.
    nd = a.ndim
    lines = ["def impl(a, i):", "    r = i"]
    for ax in range(nd - 1, -1, -1):
        lines += [f"    i{ax} = r % a.shape[{ax}]", f"    r = r // a.shape[{ax}]"]
    lines.append("    return a[" + "".join(f"i{ax}, " for ax in range(nd)) + "]")
    scope = {}
    exec("\n".join(lines), scope)
    return scope["impl"]


@cuda.jit(cache=True)
def _pack(src, dst):
    """dst[i] = src's C-order element i: a strided device array made contiguous."""
    for i in range(cuda.grid(1), dst.shape[0], cuda.gridsize(1)):  # grid-stride, int64
        dst[i] = strided_get(src, i)


def flat(a, stream=0):
    """``a`` (NumPy or numba device array of a public dtype) as a contiguous 1-D
    device array of its storage dtype (float16 -> int16, bfloat16 -> uint16 bits);
    copies and packing on ``stream`` (``as_stream``'s result). uint8 (GridSample's
    ``x``) is its own storage dtype."""
    st = np.dtype(np.uint8) if np.dtype(a.dtype) == np.uint8 else storage(a.dtype)
    if isinstance(a, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(a).view(st).reshape(-1), stream=stream)
    v = a.view(st)  # same item size: a view even when strided
    n = int(np.prod(v.shape, dtype=np.int64))
    if n == 0:
        return cuda.device_array(0, dtype=st, stream=stream)
    if v.is_c_contiguous():
        return v.reshape(n)
    out = cuda.device_array(n, dtype=st, stream=stream)
    _pack[blocks_for(n), THREADS, stream](v, out)
    return out


def compile_jobs():
    """(label, kernel, argument types) of ``_pack`` for every storage dtype (and
    uint8) and a few ranks: what ``compile_ptx`` type-checks (tests/test_cuda.py)."""
    from numba import types
    from numba import from_dtype
    for dt in list(DTYPES) + [np.dtype(np.uint8)]:  # uint8: GridSample's x
        st = from_dtype(np.dtype(np.uint8) if dt == np.uint8 else storage(dt))
        for rank in (1, 3, 5):
            yield f"pack/rank{rank}/{dt}", _pack, (types.Array(st, rank, "A"), types.Array(st, 1, "C"))


def any_on_device(*arrays):
    return any(a is not None and not isinstance(a, np.ndarray) for a in arrays)


def finish(out, shape, dtype, to_host, stream=0):
    """The flat storage result ``out`` as ``shape`` of the public ``dtype``: NumPy
    if ``to_host`` (copied on ``stream``, which is then synchronised: the call
    returns with the result), else a numba device array (nothing waits: it is
    ready when ``stream`` is)."""
    if to_host:
        host = out.copy_to_host(stream=stream)
        if stream:  # numba's default stream (0) copies synchronously already
            stream.synchronize()
        return host.view(dtype).reshape(shape)
    return out.reshape(shape).view(dtype) if out.size else cuda.device_array(shape, dtype=dtype, stream=stream)


def from_host(a):
    """The NumPy array ``a`` as a numba device array of its dtype."""
    with launch_guard():
        return finish(flat(a), a.shape, a.dtype, to_host=False)


def to_host(a):
    """The device array ``a`` (any strides, negative ones too: numba-cuda copies
    those to the host only after they are packed) as a NumPy array of its dtype."""
    with launch_guard():
        await_producers((a,), 0)
        if np.dtype(a.dtype) not in DTYPES and np.dtype(a.dtype) != np.uint8:  # not ours: the front end says so
            return a.copy_to_host()
        return finish(flat(a), a.shape, a.dtype, to_host=True)


def int64_array(values, stream=0):
    """A small read-only int64 table (kernel geometry) on the device.

    Cached per CUDA context: a call then costs no host-to-device copy (a
    synchronous ~10 us each) for shapes seen before. Kernels never write these.
    A table made for the first time is copied on ``stream`` and the stream is
    synchronised once, so that any later call, on any stream, finds it complete.
    """
    arr = np.ascontiguousarray(values, dtype=np.int64)
    if SIMULATOR:
        return cuda.to_device(arr, stream=stream)
    return _cached_const(arr.tobytes(), arr.shape, "<i8", _context_key(), stream)


def dummy(dtype, stream=0):
    """A 1-element device array standing in for an absent optional input (never read)."""
    if SIMULATOR:
        return cuda.device_array(1, dtype=dtype, stream=stream)
    return _cached_const(bytes(np.dtype(dtype).itemsize), (1,), np.dtype(dtype).str, _context_key(), stream)


def _context_key():
    ctx = cuda.current_context()
    return (id(ctx), ctx.device.id)


#: (bytes, shape, typestr, context) -> a device array: the small constant tables
_CONSTS = {}


def _cached_const(data, shape, typestr, context, stream):
    key = (data, shape, typestr, context)
    arr = _CONSTS.get(key)
    if arr is None:
        arr = cuda.to_device(np.frombuffer(data, dtype=np.dtype(typestr)).reshape(shape), stream=stream)
        if stream:
            stream.synchronize()  # once per table: later calls may run on other streams
        if len(_CONSTS) >= 256:  # bounded, as the lru_cache it replaces
            _CONSTS.clear()
        _CONSTS[key] = arr
    return arr
