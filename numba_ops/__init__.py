"""numba_ops: ONNX AffineGrid and DeformConv kernels in Numba, for the CPU and CUDA."""
from ._dispatch import devices
from ._warm import warm
from .affine_grid import affine_grid
from .deform_conv import deform_conv

__version__ = "0.1.0"
__all__ = ["affine_grid", "deform_conv", "devices", "warm", "__version__"]
