"""numba_ops: ONNX AffineGrid, DeformConv and GridSample, and a fused affine_warp,
as Numba kernels for the CPU and NVIDIA GPUs.

Functions
---------
affine_grid
    The sampling grid of a batch of affine transforms (ONNX AffineGrid).
deform_conv
    Deformable convolution, 1-D to N-D (ONNX DeformConv).
grid_sample
    Sample an array at the positions of a grid (ONNX GridSample).
affine_warp
    ``grid_sample(x, affine_grid(theta, size))`` in one pass, without the grid.
ms_deform_attn
    Multi-scale deformable attention (Deformable DETR's sampling core).
devices
    The devices usable here.
warm
    Compile every kernel into the on-disk JIT cache ahead of time.
affine_grid_backward, deform_conv_backward, grid_sample_backward, affine_warp_backward, ms_deform_attn_backward
    The ops' gradients (vector-Jacobian products), for training and registration.

Submodules (each needs its extra): ``numba_ops.onnx`` (the ops for ONNX models)
and ``numba_ops.dask`` (the ops on ``dask.array``). ``import numba_ops`` imports
neither, nor numba itself: kernels load on first use.

Examples
--------
>>> import numpy as np
>>> import numba_ops
>>> theta = np.array([[[0, -1, 0], [1, 0, 0]]], np.float32)  # a quarter turn
>>> x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
>>> numba_ops.affine_warp(x, theta)[0, 0]
array([[1., 3.],
       [0., 2.]], dtype=float32)
"""
from ._dispatch import devices
from ._warm import warm
from .affine_grid import affine_grid, affine_grid_backward
from .affine_warp import affine_warp, affine_warp_backward
from .deform_conv import deform_conv, deform_conv_backward
from .grid_sample import grid_sample, grid_sample_backward
from .ms_deform_attn import ms_deform_attn, ms_deform_attn_backward

__version__ = "0.1.0"
__all__ = ["affine_grid", "affine_grid_backward", "affine_warp", "affine_warp_backward", "deform_conv",
           "deform_conv_backward", "devices", "grid_sample", "grid_sample_backward", "ms_deform_attn",
           "ms_deform_attn_backward", "warm", "__version__"]
