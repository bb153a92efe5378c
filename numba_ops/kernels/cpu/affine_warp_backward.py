"""affine_warp's backward on the CPU: GridSample's backward kernel (``grid_sample_backward``)
with each position computed from theta as affine_grid computes it, and the
positions' gradients summed into theta's (float64, per unit, then in order)."""
from .._dtypes import NAMES
from ._copies import narrowed
from .grid_sample_backward import run

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


def launch(gy, x, theta, size, mode, padding, align, want_x, want_theta, stream=None):
    """grad_y (N, C, O1..Or) with ``size`` (N, C, O1..Or), x (N, C, D1..Dr), theta
    (N, r, r+1): NumPy, one float dtype, validated by the front end. ``(gx, gtheta)``
    in that dtype (None where not wanted). ``stream`` is ignored on the CPU."""
    gx, gt = run(x, gy, theta, tuple(size[2:]), mode, padding, align, True, want_x, want_theta)
    dt = x.dtype
    return (None if gx is None else narrowed(gx, dt)), (None if gt is None else gt.astype(dt))
