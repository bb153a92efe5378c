"""What counts as a device (GPU) array: the one definition that the dispatcher
(``_dispatch.py``) and the CUDA plumbing (``kernels/cuda/_device.py``) both
import. Imports nothing from numba-cuda, so asking never touches the GPU."""


def is_numba_device_array(a):
    """True for numba's own device arrays (real or simulated)."""
    return bool(getattr(type(a), "__cuda_ndarray__", False))


def on_device(a):
    """True for GPU arrays: ``__cuda_array_interface__`` exporters and numba's own
    device arrays (whose simulated kind, under NUMBA_ENABLE_CUDASIM, exports no
    interface but is marked ``__cuda_ndarray__``)."""
    return a is not None and (hasattr(a, "__cuda_array_interface__") or is_numba_device_array(a))
