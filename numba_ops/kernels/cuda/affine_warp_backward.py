"""affine_warp's backward on the GPU: GridSample's backward kernel
(``kernels/cuda/grid_sample_backward.py``) with each position computed from theta as
the CPU backward computes it (never building the grid), and the positions'
gradients summed into theta's in float64 (per thread, per block, then one atomic add
per block and entry)."""
from .._dtypes import NAMES, compute
from . import _device
# block_size: for benchmark/resources.py
from .grid_sample_backward import MODE_NAMES, block_size, kernel, run, signature  # noqa: F401

DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


def compile_jobs():
    """(label, kernel, argument types) for 2-D and 3-D, every mode and dtype: what
    ``compile_ptx`` type-checks and the resource report measures."""
    for dt in DTYPES:
        for r in (2, 3):
            for mode, mname in MODE_NAMES.items():
                yield (f"affine_warp_backward/{r}d/{mname}/{dt}", kernel(compute(dt).type, r, mode, True),
                       signature(r, dt, True))


def launch(gy, x, theta, size, mode, padding, align, want_x, want_theta, stream=None):
    """grad_y (N, C, O1..Or) with ``size`` (N, C, O1..Or), x (N, C, D1..Dr), theta
    (N, r, r+1): NumPy or device arrays of one float dtype, validated by the front end.
    ``(gx, gtheta)`` in that dtype, None where not wanted; NumPy for host inputs,
    device arrays otherwise; all work on ``stream`` (``_device.as_stream``)."""
    with _device.launch_guard():
        return run(gy, x, theta, tuple(int(s) for s in size[2:]), mode, padding, align, True, bool(want_x),
                   bool(want_theta), _device.as_stream(stream))
