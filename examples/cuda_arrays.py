"""numba_ops on CUDA arrays from PyTorch or CuPy, on the caller's stream.

Any array with ``__cuda_array_interface__`` (PyTorch CUDA tensors, CuPy arrays,
numba device arrays) is taken in place, without a copy; the result is a numba
device array, which PyTorch (``torch.as_tensor``) and CuPy (``cupy.asarray``)
take without a copy too. ``stream=`` puts the call's kernels on the caller's
stream, so it orders with the framework's own work and returns without waiting.

    python examples/cuda_arrays.py

Where no GPU is usable (no driver, no numba-cuda, neither PyTorch with CUDA nor
CuPy), it says so and exits 0.
"""
import sys

import numpy as np

import numba_ops


def with_torch(torch):
    dev = torch.device("cuda")
    x = torch.rand(8, 3, 64, 64, device=dev)
    angle = torch.linspace(-0.3, 0.3, 8, device=dev)
    theta = torch.zeros(8, 2, 3, device=dev)
    theta[:, 0, 0] = theta[:, 1, 1] = torch.cos(angle)
    theta[:, 0, 1], theta[:, 1, 0] = -torch.sin(angle), torch.sin(angle)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # x and theta were made on the current stream
    with torch.cuda.stream(stream):
        y = numba_ops.affine_warp(x, theta, stream=stream)  # on torch's stream, no copy in or out
        y = torch.as_tensor(y, device=dev)
    stream.synchronize()
    expected = torch.nn.functional.grid_sample(
        x, torch.nn.functional.affine_grid(theta, x.shape, align_corners=False), align_corners=False)
    err = float((y - expected).abs().max())
    print(f"PyTorch: affine_warp of a {tuple(x.shape)} CUDA tensor, max |numba_ops - torch| = {err:.2e}")
    assert err < 1e-4, err


def with_cupy(cupy):
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # the inputs are made on the stream the call then runs on
        x = cupy.random.rand(4, 16, 32, 32, dtype=cupy.float32)
        w = cupy.random.rand(16, 16, 3, 3, dtype=cupy.float32) - 0.5
        offset = cupy.zeros((4, 2 * 9, 32, 32), cupy.float32)
        y = cupy.asarray(numba_ops.deform_conv(x, w, offset, pads=[1, 1, 1, 1], stream=stream))
    stream.synchronize()
    # zero offsets: a plain convolution, checked on the CPU
    ref = numba_ops.deform_conv(x.get(), w.get(), offset.get(), pads=[1, 1, 1, 1], device="cpu")
    err = float(np.max(np.abs(y.get() - ref)))
    print(f"CuPy: deform_conv of a {x.shape} CUDA array, max |GPU - CPU| = {err:.2e}")
    assert err < 1e-3, err


def main():
    if "cuda" not in numba_ops.devices():
        print("skipped: no CUDA GPU is usable here (numba_ops.devices() lists only the CPU)")
        return 0
    ran = False
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        with_torch(torch)
        ran = True
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception:  # not installed, or no driver it can use
        cupy = None
    if cupy is not None:
        with_cupy(cupy)
        ran = True
    if not ran:
        print("skipped: neither PyTorch with CUDA nor CuPy is usable here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
