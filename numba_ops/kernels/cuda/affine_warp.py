"""affine_warp on the GPU: GridSample at AffineGrid's positions, computed on the fly.

One thread per output position ``(n, [d,] h, w)`` (grid-stride over ``N·D·H·W``),
as GridSample's kernel (``kernels/cuda/grid_sample.py``), whose ``sampler`` (taps,
weights and the per-channel sums) it shares: only the positions differ. They are
computed from theta as the AffineGrid kernels compute the grid (the base
coordinates by the shared ``base_coord``; 2-D ``theta[n,k,0]·x_w +
(theta[n,k,1]·y_h + theta[n,k,2])``, 3-D ``(theta[n,k,0]·x_w + (theta[n,k,2]·z_d
+ theta[n,k,3])) + y_h·theta[n,k,1]``) in the compute type and unnormalised, as
the CPU kernel does, so the grid is never stored (nor, for 16-bit theta, rounded
to 16 bits). The position's row decomposition (three 64-bit divisions) is paid once
per position and serves every channel.
"""
import functools

import numpy as np
from numba import cuda

from .._dtypes import NAMES, compute
from .._sample import load_sample, unnormalize
from .._scalar import base_coord
from . import _device
from .grid_sample import MAX_R, MODE_NAMES, block_size, bounds, run, sampler, signatures  # noqa: F401 (block_size: benchmark/resources.py)

#: theta dtypes; ``x`` has the same dtype, or uint8
DTYPES = NAMES  # the dtypes these kernels take (the dispatcher checks them)


@functools.lru_cache(maxsize=None)
def kernel(ct, r, mode):
    """The affine_warp kernel for compute type ``ct`` (theta's), ``r`` = 2 or 3
    spatial axes and ``mode``.

    Arguments: xf (N*C*S) flat storage of ``x`` (or uint8), theta (N*r*(r+1)) flat
    storage, out (N*C*P) flat, dims ``(N*P, C, P, S, D, H, W)`` (D = 1 in 2-D), geo
    (``grid_sample.geometry`` of x), padding (a ``_sample`` code), align (bool).
    """
    ct = np.dtype(ct).type
    R = r
    sample = sampler(ct, r, mode)

    @cuda.jit(**bounds(ct, r, mode))
    def affine_warp_kernel(xf, theta, out, dims, geo, padding, align):
        total, C, P, S, D, H, W = dims
        one = ct(1)
        pos = cuda.local.array(MAX_R, ct)
        for q in range(cuda.grid(1), total, cuda.gridsize(1)):  # grid-stride, int64
            row = q // W
            w = q - row * W
            s = row // H
            h = row - s * H
            n = s // D
            d = s - n * D
            xw = base_coord(w, W, align, one)
            yh = base_coord(h, H, align, one)
            zd = base_coord(d, D, align, one)
            for k in range(R):
                th = (n * R + (R - 1 - k)) * (R + 1)  # grid component of spatial axis k
                t0 = load_sample(theta, th, one)
                t1 = load_sample(theta, th + 1, one)
                t2 = load_sample(theta, th + 2, one)
                if R == 2:
                    v = t0 * xw + (t1 * yh + t2)
                else:
                    v = (t0 * xw + (t2 * zd + load_sample(theta, th + 3, one))) + yh * t1
                pos[k] = unnormalize(v, geo[k], align, one)
            sample(xf, out, n * C * S, n * C * P + (q - n * P), C, S, P, pos, geo, padding, align)

    return affine_warp_kernel


def compile_jobs():
    """(label, kernel, argument types) for 2-D and 3-D, every mode, theta dtype and
    x dtype (theta's or uint8): what ``compile_ptx`` type-checks (tests/test_cuda.py)
    and the resource report measures."""
    from numba import types
    for tdt in DTYPES:
        for r in (2, 3):
            for mode, mname in MODE_NAMES.items():
                kern = kernel(compute(tdt).type, r, mode)
                for xdt, sig in signatures(r, tdt):
                    sig = sig[:3] + (types.UniTuple(types.int64, 7),) + sig[4:]
                    yield f"affine_warp/{r}d/{mname}/x_{xdt}/{tdt}", kern, sig


def launch(x, theta, size, mode, padding, align, stream=None):
    """x: NumPy or device array (N, C, [D,] H, W), float or uint8; theta: (N, r, r+1),
    float; size: the output size (N, C, [D,] H, W); validated by the front end
    (``mode``/``padding`` are ``_sample`` codes, ``align`` a bool); stream: the
    public ``stream=`` (``_device.as_stream``)."""
    with _device.launch_guard():
        return _launch(x, theta, size, mode, padding, align, _device.as_stream(stream))


def _launch(x, theta, size, mode, padding, align, stream):
    shape = tuple(int(s) for s in size)
    D = shape[2] if x.ndim == 5 else 1
    return run(kernel, x, theta, shape, (D, shape[-2], shape[-1]), mode, padding, align, stream)
