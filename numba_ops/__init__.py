"""numba_ops: ONNX AffineGrid, DeformConv and GridSample kernels in Numba, for the CPU and CUDA."""
from ._dispatch import devices
from ._warm import warm
from .affine_grid import affine_grid
from .affine_warp import affine_warp
from .deform_conv import deform_conv
from .grid_sample import grid_sample

__version__ = "0.1.0"
__all__ = ["affine_grid", "affine_warp", "deform_conv", "devices", "grid_sample", "warm", "__version__"]
