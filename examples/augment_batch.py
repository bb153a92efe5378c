"""Augment a batch of images with random affine transforms, and save a picture.

Each image of a uint8 batch (N, C, H, W) gets its own rotation, scale, shear and
shift: one ``numba_ops.affine_warp`` call warps the whole batch, sampling each
output pixel straight from theta without building a sampling grid. The result is
uint8 again (bilinear samples truncated and clamped to 0..255). A figure of the
batch before and after is written with matplotlib.

    python examples/augment_batch.py                      # augment_batch.png
    python examples/augment_batch.py --out aug.png --n 8 --size 128

Timings printed are of the second call: the first compiles the kernels (or
loads them from numba's disk cache).
"""
import argparse
import sys
import time

import numpy as np

import numba_ops


def make_batch(n, size, rng):
    """n synthetic RGB images: a checkerboard with a disc and a bar of random colours."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    board = ((np.floor(xx * 8) + np.floor(yy * 8)) % 2)[None]
    batch = np.empty((n, 3, size, size), np.uint8)
    for i in range(n):
        c1, c2 = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        cx, cy, r = rng.uniform(0.3, 0.7, 2).tolist() + [rng.uniform(0.1, 0.25)]
        disc = ((xx - cx) ** 2 + (yy - cy) ** 2 < r * r)[None]
        bar = ((np.abs(yy - 0.2) < 0.04) & (xx > 0.1) & (xx < 0.9))[None]
        img = 60 + 80 * board
        img = np.where(disc, c1[:, None, None], img)
        img = np.where(bar, c2[:, None, None], img)
        batch[i] = img
    return batch


def random_theta(n, rng, max_angle=0.5, scale=(0.8, 1.25), max_shear=0.15, max_shift=0.2):
    """(n, 2, 3) float32 matrices mapping output coordinates to input ones."""
    a = rng.uniform(-max_angle, max_angle, n)
    s = rng.uniform(*scale, n)
    sh = rng.uniform(-max_shear, max_shear, n)
    t = rng.uniform(-max_shift, max_shift, (n, 2))
    theta = np.zeros((n, 2, 3), np.float32)
    theta[:, 0, 0] = np.cos(a) / s
    theta[:, 0, 1] = -np.sin(a) / s + sh
    theta[:, 1, 0] = np.sin(a) / s
    theta[:, 1, 1] = np.cos(a) / s
    theta[:, :, 2] = t
    return theta


def save_figure(before, after, path):
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    n = len(before)
    fig, axes = plt.subplots(2, n, figsize=(1.8 * n, 3.8), squeeze=False)
    for i in range(n):
        for row, imgs, title in ((0, before, "before"), (1, after, "after")):
            ax = axes[row, i]
            ax.imshow(imgs[i].transpose(1, 2, 0))
            ax.set_axis_off()
            if i == 0:
                ax.set_title(title, loc="left", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=6, help="images in the batch")
    ap.add_argument("--size", type=int, default=96, help="image height and width")
    ap.add_argument("--out", default="augment_batch.png", help="the before/after picture")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    batch = make_batch(args.n, args.size, rng)
    theta = random_theta(args.n, rng)
    # reflection padding: no black corners where a rotation uncovers them
    augmented = numba_ops.affine_warp(batch, theta, padding_mode="reflection")
    t0 = time.perf_counter()
    augmented = numba_ops.affine_warp(batch, theta, padding_mode="reflection")
    ms = (time.perf_counter() - t0) * 1e3
    assert augmented.shape == batch.shape and augmented.dtype == np.uint8
    print(f"augmented {batch.shape} {batch.dtype} in {ms:.2f} ms ({numba_ops.devices()[0]})")

    save_figure(batch, augmented, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
