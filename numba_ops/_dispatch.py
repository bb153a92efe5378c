"""Device selection and the kernel table.

``LAUNCHERS`` maps ``(op, device)`` to the module holding that op's kernels for
that device; each such module declares the dtypes it takes (``DTYPES``) beside
its ``launch`` function, and ``launcher(op, device, dtype)`` is the table's entry
for the three (a ``TypeError`` naming those dtypes for any other). Modules are
imported on first use, so importing numba_ops compiles nothing and never touches
the GPU.
"""
import functools
import importlib
import os
import sys

import numpy as np

from .kernels._arrays import on_device  # noqa: F401  (the front ends import it from here)
from ._dtypes import SUPPORTED

DEVICES = ("cpu", "cuda")

#: the package's own name: the table names its modules from it, so that a copy of the
#: package under another name (vendored, or two versions side by side in one process to
#: compare them) runs its own kernels
_PACKAGE = __name__.rpartition(".")[0]

_OPS = ("affine_grid", "deform_conv", "grid_sample", "affine_warp", "ms_deform_attn")
LAUNCHERS = {(op, device): f"{_PACKAGE}.kernels.{device}.{op}"
             for op in _OPS + tuple(op + "_backward" for op in _OPS) for device in DEVICES}


def cuda_simulator():
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _no_cuda_driver():
    """True when, on Linux, no CUDA driver library loads from where numba-cuda looks
    for it (its ``locate_driver_and_loader``): then no GPU is usable, and that is
    known without importing numba-cuda (1-2 s, most of a CPU-only ``devices()``)."""
    if not sys.platform.startswith("linux") or os.environ.get("NUMBA_CUDA_DRIVER"):
        return False
    import ctypes
    for path in ("libcuda.so", "libcuda.so.1", "/usr/lib/libcuda.so", "/usr/lib/libcuda.so.1",
                 "/usr/lib64/libcuda.so", "/usr/lib64/libcuda.so.1"):
        try:
            ctypes.CDLL(path)
            return False
        except OSError:
            if os.path.isfile(path):  # there but not loadable: numba-cuda says why
                return False
    return True


def cuda_usable():
    """True when numba-cuda imports and a GPU (or numba's CUDA simulator) is there."""
    if not cuda_simulator() and _no_cuda_driver():
        return False
    try:
        from numba import cuda
    except ImportError:
        return False
    try:
        return bool(cuda.is_available())
    except Exception:  # a broken driver is "not usable", never a crash
        return False


def devices() -> tuple[str, ...]:
    """The devices that ``device=`` can name here.

    ``"cpu"`` always, first; then ``"cuda"`` when numba-cuda is installed and a
    GPU is usable (or numba's CUDA simulator is on: ``NUMBA_ENABLE_CUDASIM=1``).
    Asking never fails: a missing or broken driver means no ``"cuda"``.

    Returns
    -------
    tuple of str
        ``("cpu",)`` or ``("cpu", "cuda")``.

    Examples
    --------
    >>> import numba_ops
    >>> numba_ops.devices()[0]
    'cpu'
    """
    return ("cpu", "cuda") if cuda_usable() else ("cpu",)


def check_device(device):
    """``device`` if it is None, "cpu" or "cuda", else a ValueError."""
    if device is not None and (not isinstance(device, str) or device not in DEVICES):
        raise ValueError(f"device must be None, 'cpu' or 'cuda'; got {device!r}")
    return device


def resolve_device(device, inputs):
    """The device a call runs on: None follows ``__cuda_array_interface__``; else "cpu"/"cuda"."""
    if check_device(device) is None:
        device = "cuda" if any(on_device(a) for a in inputs) else "cpu"
        what = "an input is a CUDA array (device=None follows it)"
    else:
        what = "device='cuda' was asked for"
    if device == "cuda" and not cuda_usable():
        raise RuntimeError(
            f"{what} but no CUDA GPU is usable here "
            "(install numba-cuda and a driver, or set NUMBA_ENABLE_CUDASIM=1 for the simulator)")
    return device


def as_array(a, name, device):
    """``a`` as an array the ``device`` backend takes: NumPy for the CPU (device
    arrays are copied to the host), NumPy or a numba device array for CUDA; NumPy
    arrays in native byte order. Anything converted is a new object."""
    if a is None:
        return None
    if on_device(a):
        if device == "cpu" and not cuda_usable():
            raise RuntimeError(f"{name} is a CUDA array but no CUDA GPU is usable here to copy it from")
        from .kernels.cuda._device import as_device_array, to_host
        d = as_device_array(a, name)
        return to_host(d) if device == "cpu" else d
    if isinstance(a, np.ndarray):
        # a non-native byte order (">f4" on x86) is the same dtype to the user: a native copy
        return a if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))
    try:
        return np.asarray(a)
    except ValueError as exc:  # NumPy's word for a ragged nested sequence
        raise ValueError(f"{name} must be a rectangular array; got a ragged {type(a).__name__}: {exc}") from exc
    except Exception as exc:
        raise TypeError(f"{name} must be an array of one of {SUPPORTED}; got a {type(a).__name__} "
                        f"that NumPy cannot read ({exc})") from exc


def result_for(out, device_inputs):
    """A launcher's result as the ops hand it back: for calls with device
    inputs a numba device array wherever it ran (a NumPy result goes over), else as is."""
    if not device_inputs or not isinstance(out, np.ndarray):
        return out
    from .kernels.cuda._device import from_host
    return from_host(out)


@functools.lru_cache(maxsize=None)
def launcher(op, device, dtype):
    """The ``launch`` function of ``op`` on ``device`` for inputs of ``dtype``."""
    module = importlib.import_module(LAUNCHERS[op, device])
    if dtype.name not in module.DTYPES:
        raise TypeError(f"{op} on {device} takes {', '.join(module.DTYPES)}; got {dtype}")
    return module.launch
