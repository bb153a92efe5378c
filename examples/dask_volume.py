"""Warp a batch of 3-D volumes on a Dask cluster.

A stack of volumes (N, C, D, H, W), chunked along N, is resampled by one affine
transform per volume (a rotation about the depth axis and a zoom) with
``numba_ops.dask.affine_warp``: one task per chunk of volumes, run by the
workers of a ``dask.distributed`` LocalCluster (worker processes on this
machine; a ``Client`` pointed at any other cluster runs the same graph). The
result is checked against the one-call ``numba_ops.affine_warp``.

    python examples/dask_volume.py
    python examples/dask_volume.py --n 16 --size 64 --workers 4

Each worker compiles a kernel on its first use unless numba's disk cache holds it
(``numba-ops warm`` fills it; workers on this machine share its cache).
"""
import argparse
import logging
import sys
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4, help="volumes")
    ap.add_argument("--size", type=int, default=24, help="depth, height and width of each volume")
    ap.add_argument("--chunk", type=int, default=2, help="volumes per task")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)

    import dask.array as da
    from distributed import Client, LocalCluster

    import numba_ops
    import numba_ops.dask as nd

    n, s = args.n, args.size
    rng = np.random.default_rng(0)
    volumes = da.from_array(rng.random((n, 1, s, s, s), dtype=np.float32), chunks=(args.chunk, 1, s, s, s))
    angle = np.linspace(-0.4, 0.4, n)
    zoom = np.linspace(0.9, 1.1, n)
    theta = np.zeros((n, 3, 4), np.float32)  # (x, y, z) columns: rotate x-y about z, zoom all
    theta[:, 0, 0] = theta[:, 1, 1] = np.cos(angle) / zoom
    theta[:, 0, 1], theta[:, 1, 0] = -np.sin(angle) / zoom, np.sin(angle) / zoom
    theta[:, 2, 2] = 1 / zoom

    # The one-call result, for the check below. It also compiles the kernel into numba's
    # disk cache here, once, so that the workers load it instead of each compiling it.
    expected = numba_ops.affine_warp(volumes.compute(), theta, padding_mode="border")

    warped = nd.affine_warp(volumes, theta, mode="linear", padding_mode="border")  # lazy: nothing runs yet
    print(f"graph: {warped.shape} {warped.dtype}, {warped.npartitions} tasks")

    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=None, silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        t0 = time.perf_counter()
        result = warped.compute()
        print(f"computed on {len(client.scheduler_info()['workers'])} workers in {time.perf_counter() - t0:.2f} s "
              "(each worker's first call loads the kernel from the cache)")

    err = float(np.max(np.abs(result - expected)))
    print(f"max |dask - one call| = {err:.2e}")
    assert err <= 1e-6, err
    return 0


if __name__ == "__main__":
    sys.exit(main())
