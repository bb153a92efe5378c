"""Affine registration of two 3-D volumes: find theta so that ``affine_warp(moving,
theta)`` matches ``fixed``, with SciPy's L-BFGS on the gradient from
``numba_ops.affine_warp_backward``.

The loss is half the sum of squared differences between the warped moving volume
and the fixed one; its gradient with respect to theta is ``affine_warp_backward``
of the residual (``wrt=["theta"]``: grad_x is not computed). Each iteration is one
forward and one backward pass over the volume, neither of which builds a grid.

    python examples/register_volumes.py                   # a 48^3 volume
    python examples/register_volumes.py --size 24
"""
import argparse
import time

import numpy as np
from scipy.optimize import minimize

import numba_ops


def blobs(size, rng, n=12):
    """A smooth synthetic volume (1, 1, size, size, size): Gaussian blobs of random sizes."""
    z, y, x = np.mgrid[0:size, 0:size, 0:size] / size
    vol = np.zeros((size,) * 3)
    for _ in range(n):
        c = rng.uniform(0.25, 0.75, 3)
        s = rng.uniform(0.05, 0.12)
        vol += rng.uniform(0.5, 1.0) * np.exp(-((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2) / (2 * s * s))
    return vol[None, None].astype(np.float32)


def register(moving, fixed, theta0):
    """theta (1, 3, 4) minimising 0.5 * ||affine_warp(moving, theta) - fixed||^2, from theta0."""
    def loss_and_grad(t):
        theta = t.reshape(1, 3, 4).astype(np.float32)
        residual = numba_ops.affine_warp(moving, theta, padding_mode="border") - fixed
        _, gtheta = numba_ops.affine_warp_backward(residual, moving, theta, padding_mode="border", wrt=["theta"])
        return 0.5 * float(np.sum(residual.astype(np.float64) ** 2)), gtheta.ravel().astype(np.float64)

    res = minimize(loss_and_grad, theta0.ravel().astype(np.float64), jac=True, method="L-BFGS-B",
                   options={"maxiter": 200, "gtol": 1e-8})
    return res.x.reshape(1, 3, 4), res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=48, help="the volumes' edge length")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    moving = blobs(args.size, rng)
    angle = 0.15  # a rotation about the z axis, a little scaling and a shift
    true = np.array([[[np.cos(angle) * 1.05, -np.sin(angle), 0.0, 0.06],
                      [np.sin(angle), np.cos(angle) * 0.97, 0.0, -0.04],
                      [0.0, 0.0, 1.0, 0.03]]], np.float32)
    fixed = numba_ops.affine_warp(moving, true, padding_mode="border")
    start = np.eye(3, 4)[None]
    t0 = time.perf_counter()
    theta, res = register(moving, fixed, start)
    dt = time.perf_counter() - t0
    print(f"{res.nit} iterations, {res.nfev} loss+gradient evaluations in {dt:.2f} s; loss {res.fun:.3g}")
    print(f"max |theta - true theta| = {np.abs(theta - true).max():.2e} (start: {np.abs(start - true).max():.2e})")


if __name__ == "__main__":
    main()
