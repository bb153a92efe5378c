"""One case table for the tests, the benchmarks (``bench/``) and ``numba-ops bench``/``check``.

Benchmark cases carry the names the peer comparisons use, so figures can be
compared across tools:

* AffineGrid: ``ag2d_small``, ``ag2d_32x256``, ``ag3d_4x64``;
* DeformConv: ``dc_seed``, ``dc_r50_c64_56``, ``dc_b8_c32_32``, ``dc_c256_28``, ``dc_s2_g2``;
  and a deep-channel, small-spatial sweep (DCNv2 in ResNet stages
  4-5): ``dc_c512_7``, ``dc_c1024_7``, ``dc_c512_14``, ``dc_b2_c512_14``,
  ``dc_c256_14``, ``dc_c512_25x42``, ``dc3d_c256_8x14`` (3-D);
* GridSample: ``gs2d_32x256``, ``gs3d_4x64``, ``gs2d_cubic_8x256``; affine_warp:
  ``aw2d_32x256``, ``aw2d_u8_16x512``; and the grids users make (``gs*_aug_*``,
  ``gs2d_flow_*``, ``aw*_aug_*``: augmentation affines, optical-flow warps);
* multi-scale deformable attention (``ms_deform_attn``; Deformable DETR's 4 levels of an
  800x1200 image, 8 heads x 32 channels, 4 points): ``msda_enc_n1`` (the encoder, every
  position a query), ``msda_dec_300`` (the decoder, 300 queries);
* gradients (``BACKWARD``, names ending ``_bwd``): ``dc_b2_c64_56_bwd`` (a ResNet-50
  DCNv2 stage, every gradient), ``dc3d_c32_24_bwd``, ``gs2d_aug_32x256_bwd``,
  ``gs2d_flow_c64_4x128_bwd``, ``gs3d_flow_2x96_bwd`` (3-D registration),
  ``aw3d_reg_128_bwd`` (affine registration of a volume), ``ag3d_4x64_bwd``,
  ``msda_enc_n1_bwd``, ``msda_dec_300_bwd`` (value, locations and weights).

Each builder returns ``(args, kwargs, work)``: the positional inputs and the
attributes of the call (ONNX names), and the amount of work that sets the
machine's limit for the case (bytes written for AffineGrid, FLOPs of the
equivalent dense convolution for DeformConv, bytes read and written for
GridSample, affine_warp and ms_deform_attn: value, the locations and weights, the
output). ``small=True`` gives a shrunken case of the same structure (kernel,
strides, groups, mask; mode, padding; levels, points) for smoke runs.

A backward case times the gradient function of its op (``op_of`` gives
``"<op>_backward"``; ``call`` runs ``numba_ops.<op>_backward``) on the inputs of a
forward case defined inline in the forward table's format, with ``grad_y`` (the
forward result's shape, standard normal) first: ``(grad_y, *forward args)``, except
AffineGrid's ``(grad_grid, size)`` (its gradient does not depend on theta). Every
gradient the op has is computed (the ``wrt`` default: DeformConv's five, x and the
positions for the samplers, ms_deform_attn's value, locations and weights). Its
work, and so its limit (``harness._Limits``):

* DeformConv: 2x the FLOPs of the forward's dense convolution (the two GEMMs of a
  convolution's backward, for the columns' and the weights' gradients, each the
  forward's size), at the GEMM rate;
* GridSample, affine_warp and AffineGrid: the bytes read (grad_y, x, the grid or
  theta) and written (the gradients), at the write bandwidth;
* ms_deform_attn: the bytes read (grad_out, value, locations, weights) and written
  (their gradients), at the write bandwidth.

The peer of a backward case (``harness``: PyTorch autograd, torchvision's
``deform_conv2d`` for DeformConv, mmcv's pure-PyTorch path ``ms_deform_attn_torch``
for ms_deform_attn) runs its forward once, outside the timing, and
times ``torch.autograd.grad`` of that result (``retain_graph=True``): the backward
alone, with the same gradients as ours. onnxruntime has no gradients.

The conformance cases of ``numba-ops check`` live here too: the examples of the
ONNX operator pages (the "seed" examples, values copied from the pages) and the
ONNX backend node cases, collected from ``onnx.backend.test.case.node`` when
onnx is installed (imported lazily; ``import numba_ops`` never imports onnx).
"""
import numpy as np

from .._dtypes import np_dtype
from .._shapes import out_size

#: name -> size (N, C, [D,] H, W) and align_corners
AFFINE = {
    "ag2d_small": dict(size=(1, 3, 32, 32), align=0),
    "ag2d_32x256": dict(size=(32, 3, 256, 256), align=0),
    "ag3d_4x64": dict(size=(4, 1, 64, 64, 64), align=1),
}

#: name -> N, C, [D,] H, W, oC, k, pad, stride, dil, group, offset_group, mask (2-D, or 3-D
#: with D; k, pad, stride, dil the same on every axis)
DEFORM = {
    "dc_seed": (1, 1, 3, 3, 1, 2, 0, 1, 1, 1, 1, False),
    "dc_r50_c64_56": (1, 64, 56, 56, 64, 3, 1, 1, 1, 1, 1, True),
    "dc_b8_c32_32": (8, 32, 32, 32, 32, 3, 1, 1, 1, 1, 1, True),
    "dc_c256_28": (1, 256, 28, 28, 256, 3, 1, 1, 1, 1, 4, True),
    "dc_s2_g2": (2, 64, 64, 64, 128, 3, 1, 2, 1, 2, 2, True),
    "dc_c512_7": (1, 512, 7, 7, 512, 3, 1, 1, 1, 1, 1, True),
    "dc_c1024_7": (1, 1024, 7, 7, 256, 3, 1, 1, 1, 1, 1, True),
    "dc_c512_14": (1, 512, 14, 14, 512, 3, 1, 1, 1, 1, 1, True),
    "dc_b2_c512_14": (2, 512, 14, 14, 512, 3, 1, 1, 1, 1, 1, True),
    "dc_c256_14": (1, 256, 14, 14, 256, 3, 1, 1, 1, 1, 1, True),
    "dc_c512_25x42": (1, 512, 25, 42, 512, 3, 1, 1, 1, 1, 1, True),
    "dc3d_c256_8x14": (1, 256, 8, 14, 14, 256, 3, 1, 1, 1, 1, 1, True),
}

#: name -> GridSample / affine_warp case: the op, x's shape, the AffineGrid case whose
#: theta (its first N matrices) and align_corners make the positions (GridSample: its
#: grid, computed by ``affine_grid_f64``; affine_warp: theta itself), mode, padding
#: and x's dtype (None: the case's float dtype)
SAMPLE = {
    "gs2d_32x256": dict(op="grid_sample", x=(32, 3, 256, 256), theta="ag2d_32x256", mode="linear",
                        padding="zeros", x_dtype=None),
    "gs3d_4x64": dict(op="grid_sample", x=(4, 1, 64, 64, 64), theta="ag3d_4x64", mode="linear",
                      padding="border", x_dtype=None),
    "gs2d_cubic_8x256": dict(op="grid_sample", x=(8, 3, 256, 256), theta="ag2d_32x256", mode="cubic",
                             padding="reflection", x_dtype=None),
    "aw2d_32x256": dict(op="affine_warp", x=(32, 3, 256, 256), theta="ag2d_32x256", mode="linear",
                        padding="zeros", x_dtype=None),
    "aw2d_u8_16x512": dict(op="affine_warp", x=(16, 3, 512, 512), theta="ag2d_32x256", mode="linear",
                           padding="zeros", x_dtype="uint8"),
    # the grids users make (align_corners=0): "augment", augmentation affines near the
    # identity (``augment_theta``); "flow", the identity warped by a smooth flow of at
    # most ``flow`` elements (``flow_grid``)
    "gs2d_aug_32x256": dict(op="grid_sample", x=(32, 3, 256, 256), theta="augment", mode="linear",
                            padding="zeros", x_dtype=None),
    "gs2d_aug_nearest_32x256": dict(op="grid_sample", x=(32, 3, 256, 256), theta="augment", mode="nearest",
                                    padding="zeros", x_dtype=None),
    "gs2d_aug_cubic_8x256": dict(op="grid_sample", x=(8, 3, 256, 256), theta="augment", mode="cubic",
                                 padding="zeros", x_dtype=None),
    "gs2d_flow_8x512": dict(op="grid_sample", x=(8, 3, 512, 512), theta="flow", flow=4.0, mode="linear",
                            padding="border", x_dtype=None),
    "gs2d_flow_c64_4x128": dict(op="grid_sample", x=(4, 64, 128, 128), theta="flow", flow=4.0, mode="linear",
                                padding="zeros", x_dtype=None),
    "gs3d_aug_4x64": dict(op="grid_sample", x=(4, 1, 64, 64, 64), theta="augment", mode="linear",
                          padding="border", x_dtype=None),
    "aw2d_aug_32x256": dict(op="affine_warp", x=(32, 3, 256, 256), theta="augment", mode="linear",
                            padding="zeros", x_dtype=None),
    "aw2d_aug_nearest_32x256": dict(op="affine_warp", x=(32, 3, 256, 256), theta="augment", mode="nearest",
                                    padding="zeros", x_dtype=None),
    "aw3d_aug_4x64": dict(op="affine_warp", x=(4, 1, 64, 64, 64), theta="augment", mode="linear",
                          padding="border", x_dtype=None),
}

#: Deformable DETR's feature pyramid: 4 levels (H, W) of an 800x1200 image, S = 19,947
_DETR_LEVELS = ((100, 150), (50, 75), (25, 38), (13, 19))

#: name -> multi-scale deformable attention case: batch N, the levels' (H, W), M heads of
#: Dh channels, P points per level and Lq queries (None: the encoder, every position a
#: query whose reference point is its own centre; else random reference points, the
#: decoder's); each point its query's reference point on every level plus a normal offset
#: of ``sigma`` elements, the weights normalised per query and head (``msda_inputs``)
#: (the decoder's work counts all of value, of which it reads only what its points touch,
#: which can stay in the caches between calls: its "% of limit" can pass 100%)
MSDA = {
    "msda_enc_n1": dict(N=1, levels=_DETR_LEVELS, M=8, Dh=32, P=4, Lq=None, sigma=2.0),
    "msda_dec_300": dict(N=1, levels=_DETR_LEVELS, M=8, Dh=32, P=4, Lq=300, sigma=2.0),
}

#: name -> gradient case: the op whose ``*_backward`` it times and its forward case,
#: ``case``, in that op's table's format (a DEFORM tuple, a SAMPLE dict, an AFFINE dict,
#: an MSDA dict;
#: SAMPLE's theta "register": ``register_theta``, a registration's affines near the
#: identity). Every gradient is computed.
BACKWARD = {
    # a ResNet-50 DCNv2 stage, batch 2: x, w, offset, b and mask
    "dc_b2_c64_56_bwd": dict(op="deform_conv", case=(2, 64, 56, 56, 64, 3, 1, 1, 1, 1, 1, True)),
    "dc3d_c32_24_bwd": dict(op="deform_conv", case=(1, 32, 24, 24, 24, 32, 3, 1, 1, 1, 1, 1, True)),
    # x and grid: augmentation affines, a feature map's flow, a 3-D registration's flow
    "gs2d_aug_32x256_bwd": dict(op="grid_sample", case=dict(x=(32, 3, 256, 256), theta="augment", mode="linear",
                                                            padding="zeros", x_dtype=None)),
    "gs2d_flow_c64_4x128_bwd": dict(op="grid_sample", case=dict(x=(4, 64, 128, 128), theta="flow", flow=4.0,
                                                                mode="linear", padding="border", x_dtype=None)),
    "gs3d_flow_2x96_bwd": dict(op="grid_sample", case=dict(x=(2, 1, 96, 96, 96), theta="flow", flow=2.0,
                                                           mode="linear", padding="zeros", x_dtype=None)),
    # x and theta: an affine registration of a volume
    "aw3d_reg_128_bwd": dict(op="affine_warp", case=dict(x=(1, 1, 128, 128, 128), theta="register",
                                                         mode="linear", padding="zeros", x_dtype=None)),
    # theta
    "ag3d_4x64_bwd": dict(op="affine_grid", case=AFFINE["ag3d_4x64"]),
    # value, sampling_locations and attention_weights: Deformable DETR's encoder and decoder
    "msda_enc_n1_bwd": dict(op="ms_deform_attn", case=MSDA["msda_enc_n1"]),
    "msda_dec_300_bwd": dict(op="ms_deform_attn", case=MSDA["msda_dec_300"]),
}


def augment_theta(n, r, seed=2, angle=np.pi / 6, scale=(0.8, 1.25), shift=0.1):
    """``n`` float32 augmentation affines (n, r, r + 1) near the identity: a rotation of
    -30..30 degrees (``angle``, radians; 2-D; 3-D about a random axis), a scale of
    0.8..1.25 (``scale``, log-uniform) and a shift of -0.1..0.1 (``shift``) per axis
    (normalised units)."""
    rng = np.random.default_rng(seed)
    angle = rng.uniform(-angle, angle, n)
    scale = np.exp(rng.uniform(np.log(scale[0]), np.log(scale[1]), n))
    theta = np.zeros((n, r, r + 1))
    for q in range(n):
        c, s = np.cos(angle[q]), np.sin(angle[q])
        if r == 2:
            rot = np.array([[c, -s], [s, c]])
        else:  # Rodrigues' rotation about a random unit axis
            a = rng.standard_normal(3)
            a /= np.linalg.norm(a)
            k = np.array([[0, -a[2], a[1]], [a[2], 0, -a[0]], [-a[1], a[0], 0]])
            rot = np.eye(3) + s * k + (1 - c) * (k @ k)
        theta[q, :, :r] = scale[q] * rot
    theta[:, :, r] = rng.uniform(-shift, shift, (n, r))
    return theta.astype(np.float32)


def register_theta(n, r, seed=4):
    """``n`` float32 affines near the identity, as an affine registration's iterates
    are: a rotation of -5..5 degrees, a scale of 0.95..1.05, a shift of -0.05..0.05."""
    return augment_theta(n, r, seed, angle=np.pi / 36, scale=(0.95, 1.05), shift=0.05)


def flow_grid(shape, amplitude, seed=3):
    """A float64 GridSample grid for ``x`` of ``shape`` (align_corners=0): the identity
    plus a smooth flow (per axis a sum of three plane waves of at most 3 periods across
    the image) of at most ``amplitude`` elements."""
    rng = np.random.default_rng(seed)
    r = len(shape) - 2
    grid = affine_grid_f64(np.tile(np.eye(r, r + 1), (shape[0], 1, 1)), shape, 0)
    axes = np.meshgrid(*[np.arange(L) / L for L in shape[2:]], indexing="ij")
    for n in range(shape[0]):
        for k in range(r):  # grid component k: spatial axis r - 1 - k
            wave = sum(np.sin(2 * np.pi * sum(f * a for f, a in zip(rng.uniform(-3, 3, r), axes))
                              + rng.uniform(0, 2 * np.pi)) for _ in range(3))
            grid[n, ..., k] += amplitude / 3 * wave * 2 / shape[2 + r - 1 - k]
    return grid

#: every benchmark case as (op, name), AffineGrid first, the gradients last (op
#: ``"<op>_backward"``, the numba_ops function the case calls)
CASES = ([("affine_grid", n) for n in AFFINE] + [("deform_conv", n) for n in DEFORM]
         + [(c["op"], n) for n, c in SAMPLE.items()] + [("ms_deform_attn", n) for n in MSDA]
         + [(c["op"] + "_backward", n) for n, c in BACKWARD.items()])


def op_of(name):
    """The numba_ops function case ``name`` times: ``"affine_grid"``, ``"deform_conv"``,
    ``"grid_sample"``, ``"affine_warp"``, ``"ms_deform_attn"``, or one of their ``"*_backward"``."""
    if name in AFFINE:
        return "affine_grid"
    if name in MSDA:
        return "ms_deform_attn"
    if name in DEFORM:
        return "deform_conv"
    if name in SAMPLE:
        return SAMPLE[name]["op"]
    if name in BACKWARD:
        return BACKWARD[name]["op"] + "_backward"
    raise KeyError(f"unknown case {name!r}; known: {', '.join(n for _, n in CASES)}")


def is_backward(name):
    """True for a gradient case (``BACKWARD``)."""
    return name in BACKWARD


def forward_op(name):
    """The forward op of case ``name``: ``op_of`` without ``"_backward"``."""
    return op_of(name).removesuffix("_backward")


def out_dtype(name, dtype="float32"):
    """The result dtype of case ``name`` run with float ``dtype`` (uint8 for uint8 x);
    for a gradient case, that of every gradient."""
    xdt = SAMPLE.get(name, {}).get("x_dtype")
    return np.dtype(xdt) if xdt else np_dtype(dtype)


def _definition(name, table):
    """Case ``name``'s definition: ``table``'s entry, or a gradient case's forward case."""
    return table[name] if name in table else BACKWARD[name]["case"]


def _cast(a, dtype):
    return None if a is None else a.astype(np_dtype(dtype))


def affine_inputs(name, dtype="float32", small=False):
    """``((theta, size), {"align_corners": a}, bytes_written)`` for AffineGrid case ``name``."""
    case = _definition(name, AFFINE)
    size = tuple(case["size"])
    if small:
        size = size[:2] + tuple(min(s, 8) for s in size[2:])
        size = (min(size[0], 2),) + size[1:]
    nd = len(size) - 2
    rng = np.random.default_rng(0)
    theta = rng.standard_normal((size[0], nd, nd + 1)).astype(np.float32)
    nbytes = int(np.prod([size[0], *size[2:]])) * nd * np_dtype(dtype).itemsize
    return (_cast(theta, dtype), np.array(size, dtype=np.int64)), {"align_corners": case["align"]}, nbytes


def deform_params(name, small=False):
    """``(N, C, spatial, oC, k, pad, stride, dil, group, offset_group, mask)`` of DeformConv
    case ``name``; ``spatial`` the tuple of input sizes (2 or 3 of them)."""
    case = _definition(name, DEFORM)
    N, C, spatial = case[0], case[1], tuple(case[2:-8])
    oC, k, pad, stride, dil, group, og, use_mask = case[-8:]
    if small:  # keep the structure (kernel, pads, strides, groups, mask), shrink the sizes
        N, spatial = min(N, 2), tuple(min(s, 6) for s in spatial)
        C, oC = min(C, 2 * int(np.lcm(group, og))), min(oC, 2 * group)
    return N, C, spatial, oC, k, pad, stride, dil, group, og, use_mask


def deform_inputs(name, dtype="float32", small=False):
    """``((X, W, offset, B, mask), attrs, flops)`` for DeformConv case ``name``; mask may be None.

    ``flops`` counts the multiply-adds of the dense convolution of the same shape
    (2 per weight use), the figure the GEMM rate bounds.
    """
    N, C, spatial, oC, k, pad, stride, dil, group, og, use_mask = deform_params(name, small)
    nd = len(spatial)
    K = k ** nd
    rng = np.random.default_rng(0)
    outs = tuple(out_size(D, pad, pad, k, dil, stride) for D in spatial)
    X = rng.standard_normal((N, C) + spatial).astype(np.float32)
    Wt = rng.standard_normal((oC, C // group) + (k,) * nd).astype(np.float32)
    off = (2.0 * rng.standard_normal((N, og * K * nd) + outs)).astype(np.float32)
    B = rng.standard_normal((oC,)).astype(np.float32)
    mask = rng.random((N, og * K) + outs).astype(np.float32) if use_mask else None
    attrs = dict(kernel_shape=[k] * nd, pads=[pad] * (2 * nd), strides=[stride] * nd,
                 dilations=[dil] * nd, group=group, offset_group=og)
    flops = 2.0 * N * oC * float(np.prod(outs)) * (C // group) * K
    return tuple(_cast(a, dtype) for a in (X, Wt, off, B, mask)), attrs, flops


def sample_inputs(name, dtype="float32", small=False):
    """``(args, kwargs, bytes)`` for GridSample case ``name`` (args ``(X, grid)``) or
    affine_warp case ``name`` (args ``(X, theta, size)``, size = X's shape): the
    positions come from AffineGrid case ``theta``'s theta and align_corners (the
    grid by ``affine_grid_f64``, rounded once to ``dtype``). ``bytes``: the bytes
    read (X, and the grid or theta) and written (the result)."""
    case = _definition(name, SAMPLE)
    shape = tuple(case["x"])
    if small:
        shape = (min(shape[0], 2), shape[1]) + tuple(min(s, 8) for s in shape[2:])
    if case["theta"] == "register":
        theta, align = register_theta(shape[0], len(shape) - 2), 0
    elif case["theta"] in ("augment", "flow"):
        theta, align = augment_theta(shape[0], len(shape) - 2), 0
    else:
        (theta, _), akw, _ = affine_inputs(case["theta"], "float64")
        theta = theta[: shape[0]].astype(np.float32)  # the AffineGrid case's float32 values
        align = akw["align_corners"]
    rng = np.random.default_rng(1)
    if case["x_dtype"] == "uint8":
        X = rng.integers(0, 256, size=shape, dtype=np.uint8)
    else:
        X = rng.standard_normal(shape).astype(np.float32).astype(np_dtype(dtype))
    kwargs = {"mode": case["mode"], "padding_mode": case["padding"], "align_corners": align}
    if forward_op(name) == "grid_sample":
        g = flow_grid(shape, case["flow"]) if case["theta"] == "flow" else affine_grid_f64(theta, shape, align)
        pos = _cast(g, dtype)
        args = (X, pos)
    else:
        pos = _cast(theta, dtype)
        args = (X, pos, np.array(shape, dtype=np.int64))
    return args, kwargs, X.nbytes + pos.nbytes + X.nbytes  # the result has X's shape and dtype


def msda_params(name, small=False):
    """``(N, levels, M, Dh, P, Lq, sigma)`` of ms_deform_attn case ``name``; ``Lq`` the
    number of queries (the encoder's: S, every position). ``small``: the same number of
    levels and points, levels of at most 6x9 (69 positions), 2 heads of 4
    channels, at most 20 queries for the decoder."""
    case = _definition(name, MSDA)
    N, levels, M, Dh, P = case["N"], tuple(tuple(lv) for lv in case["levels"]), case["M"], case["Dh"], case["P"]
    Lq = case["Lq"]
    if small:
        N, M, Dh = min(N, 2), min(M, 2), min(Dh, 4)
        levels = tuple((max(1, h // 16), max(1, w // 16)) for h, w in levels)  # 6x9, 3x4, 1x2, 1x1
        Lq = None if Lq is None else min(Lq, 20)
    S = sum(h * w for h, w in levels)
    return N, levels, M, Dh, P, S if Lq is None else Lq, case["sigma"]


def msda_inputs(name, dtype="float32", small=False):
    """``((value, spatial_shapes, level_start_index, sampling_locations, attention_weights),
    {}, bytes)`` for ms_deform_attn case ``name`` (``MSDA``): value standard normal; each
    point its query's reference point (the encoder's: the query's own centre, the same
    normalised place on every level; the decoder's: uniform in [0, 1)²) plus a normal
    offset of ``sigma`` elements of its level; the weights uniform, normalised over each
    query's and head's levels and points. ``bytes``: the bytes read (value, locations,
    weights) and written (the result)."""
    N, levels, M, Dh, P, Lq, sigma = msda_params(name, small)
    case = _definition(name, MSDA)
    L = len(levels)
    rng = np.random.default_rng(6)
    S = sum(h * w for h, w in levels)
    if case["Lq"] is None:  # every position of every level, its centre normalised
        ref = np.concatenate([np.stack(np.meshgrid((np.arange(w) + 0.5) / w, (np.arange(h) + 0.5) / h), -1)
                              .reshape(-1, 2) for h, w in levels])
    else:
        ref = rng.random((Lq, 2))
    wh = np.array([[w, h] for h, w in levels], np.float64)  # locations are (x, y)
    loc = ref[None, :, None, None, None, :] + rng.normal(0, sigma, (N, Lq, M, L, P, 2)) / wh[:, None, :]
    value = rng.standard_normal((N, S, M, Dh), np.float32)
    attn = rng.random((N, Lq, M, L, P), np.float32)
    attn /= attn.sum(axis=(-2, -1), keepdims=True)
    shapes = np.array(levels, np.int64)
    starts = np.concatenate(([0], np.cumsum(np.prod(shapes, axis=1))[:-1])).astype(np.int64)
    value, loc, attn = (_cast(a, dtype) for a in (value, loc, attn))
    out_bytes = N * Lq * M * Dh * value.itemsize
    return (value, shapes, starts, loc, attn), {}, value.nbytes + loc.nbytes + attn.nbytes + out_bytes


def forward_inputs(name, dtype="float32", small=False):
    """``(op, args, kwargs, work)`` of case ``name``'s forward call (for a gradient case,
    the forward case it differentiates: its op, inputs and work)."""
    op = forward_op(name)
    build = {"affine_grid": affine_inputs, "deform_conv": deform_inputs,
             "ms_deform_attn": msda_inputs}.get(op, sample_inputs)
    args, kwargs, work = build(name, dtype, small)
    return op, args, kwargs, work


def forward_out_shape(op, args):
    """The shape of forward ``op``'s result on inputs ``args`` (a case's)."""
    if op == "affine_grid":
        size = [int(s) for s in args[1]]
        return (size[0], *size[2:], len(size) - 2)
    if op == "affine_warp":
        return tuple(int(s) for s in args[2])
    if op == "grid_sample":
        return tuple(args[0].shape[:2]) + tuple(args[1].shape[1:-1])
    if op == "ms_deform_attn":  # (N, Lq, M * Dh)
        return tuple(args[3].shape[:2]) + (args[0].shape[2] * args[0].shape[3],)
    x, w, off = args[:3]  # deform_conv: offset holds the output's spatial shape
    return (x.shape[0], w.shape[0]) + tuple(off.shape[2:])


def backward_parts(name, dtype="float32", small=False):
    """``(op, forward args, kwargs, grad_y, work)`` of gradient case ``name``: its forward
    call (op, inputs, attributes), ``grad_y`` (standard normal, the forward result's
    shape and dtype) and the work (as the module says: 2x the forward's FLOPs for
    DeformConv, else the bytes read and written)."""
    op, fargs, kwargs, fwork = forward_inputs(name, dtype, small)
    rng = np.random.default_rng(5)
    gy = rng.standard_normal(forward_out_shape(op, fargs)).astype(np.float32).astype(np_dtype(dtype))
    if op == "deform_conv":
        work = 2.0 * fwork
    elif op == "affine_grid":  # read grad_grid, write grad_theta
        work = gy.nbytes + fargs[0].nbytes
    elif op == "ms_deform_attn":  # read grad_out, value, locations, weights; write their gradients
        work = gy.nbytes + 2 * (fargs[0].nbytes + fargs[3].nbytes + fargs[4].nbytes)
    else:  # read grad_y, x and the grid or theta; write their gradients
        work = gy.nbytes + 2 * (fargs[0].nbytes + fargs[1].nbytes)
    return op, fargs, kwargs, gy, work


def backward_inputs(name, dtype="float32", small=False):
    """``(args, kwargs, work)`` of gradient case ``name`` (``backward_parts``): args
    ``(grad_y, *forward args)``, AffineGrid's ``(grad_grid, size)``."""
    op, fargs, kwargs, gy, work = backward_parts(name, dtype, small)
    return (gy,) + (fargs[1:] if op == "affine_grid" else fargs), kwargs, work


def inputs(name, dtype="float32", small=False):
    """``(op, args, kwargs, work)`` for any benchmark case: ``numba_ops.<op>(*args,
    **kwargs)`` runs it."""
    if name in BACKWARD:
        return (op_of(name),) + backward_inputs(name, dtype, small)
    return forward_inputs(name, dtype, small)


def call(name, dtype="float32", small=False, device=None):
    """A zero-argument function that runs case ``name`` through numba_ops (a gradient
    case: ``numba_ops.<op>_backward``)."""
    import numba_ops
    op, args, kwargs, _ = inputs(name, dtype, small)
    fn = getattr(numba_ops, op)
    return lambda: fn(*args, device=device, **kwargs)


# --------------------------------------------------------------------------
# Conformance cases: ONNX operator-page ("seed") examples and backend cases.
# --------------------------------------------------------------------------

class ConformanceCase:
    """One conformance case: ONNX op, inputs (None for an absent optional one),
    attributes, the expected output, and, for page examples, values quoted from
    the page at given flat indices (``spot``: {flat index: value})."""

    def __init__(self, name, source, op, inputs, attrs, expected, spot=None, node=None):
        self.name, self.source, self.op = name, source, op
        self.inputs, self.attrs, self.expected = inputs, attrs, expected
        self.spot = spot or {}
        self.node = node  # the onnx NodeProto for backend cases

    def __repr__(self):
        return f"ConformanceCase({self.source}:{self.name})"


_THETA_2D = [[[1.0889444, -3.2880466, 5.0], [2.0223253, 1.0960155, -3.3]],
             [[0.83578837, -0.55442286, 2.5], [0.78762794, 0.8397114, 1.1]]]
_THETA_3D = [[[2.6830733, -0.7943316, 0.21829216, 5.0],
              [0.62225395, 3.2880466, -0.53033006, -3.3],
              [0.24721935, 1.7241772, 0.07809311, -1.1]],
             [[-0.35552558, 1.0044229, 1.3995191, 2.5],
              [0.17578839, 0.06028857, -0.9240381, 1.1],
              [-1.1, -0.45, 0.45, 2.2]]]
#: AffineGrid page examples: name -> (theta, size, align_corners, first output point, last output point)
_AFFINE_SEEDS = {
    "test_affine_grid_2d": (_THETA_2D, (2, 3, 5, 6), 0,
                            [6.722984, -5.8620834], [2.752952, 2.4281259]),
    "test_affine_grid_2d_align_corners": (_THETA_2D, (2, 3, 5, 6), 1,
                                          [7.1991024, -6.4183407], [2.7813654, 2.7273393]),
    "test_affine_grid_3d": (_THETA_3D, (2, 3, 4, 5, 6), 0,
                            [3.2358518, -6.0512347, -2.7439277], [4.056906, 0.6016927, 1.2608333]),
    "test_affine_grid_3d_align_corners": (_THETA_3D, (2, 3, 4, 5, 6), 1,
                                          [2.89296603, -6.67997074, -3.14948988],
                                          [4.54841614, 0.412038863, 1.10000014]),
}


def affine_grid_f64(theta, size, align_corners):
    """float64 AffineGrid by its definition, for expected values."""
    theta = np.asarray(theta, dtype=np.float64)
    axes = []
    for L in size[2:]:
        i = np.arange(L, dtype=np.float64)
        if L <= 1:
            axes.append(np.zeros(L))
        elif align_corners:
            axes.append(-1 + 2 * i / (L - 1))
        else:
            axes.append((2 * i + 1) / L - 1)
    mesh = np.meshgrid(*axes, indexing="ij")
    base = np.stack(list(reversed(mesh)) + [np.ones_like(mesh[0])], axis=-1)  # (x, y, [z,] 1)
    return np.einsum("...k,njk->n...j", base, theta)


def _deform_seed(offset_group=1, padded=False, mask_bias=False):
    X = np.arange(9, dtype=np.float32).reshape(1, 1, 3, 3)
    if offset_group == 2:
        X = np.concatenate([X, X[:, :, ::-1, ::-1]], axis=1)
    W = np.ones((1, X.shape[1], 2, 2), dtype=np.float32)
    o = 4 if padded else 2
    offset = np.zeros((1, 8 * offset_group, o, o), dtype=np.float32)
    offset[0, 0, 0, 0] = 0.5
    offset[0, 5 if offset_group == 1 else 13, 1 if padded else 0, 2 if padded else 1] = -0.1
    B = np.ones((1,), np.float32) if mask_bias else None
    mask = None
    if mask_bias:
        mask = np.ones((1, 4, 2, 2), dtype=np.float32)
        mask[0, 2, 1, 1] = 0.2
    return [X, W, offset, B, mask]


def seed_cases():
    """The examples of the ONNX operator pages, with their quoted values."""
    out = []
    for name, (theta, size, align, first, last) in _AFFINE_SEEDS.items():
        theta = np.array(theta, dtype=np.float32)
        exp = affine_grid_f64(theta, size, align)
        nd = len(size) - 2
        spot = {i: v for i, v in enumerate(first)}
        spot.update({exp.size - nd + i: v for i, v in enumerate(last)})
        out.append(ConformanceCase(name, "seed", "AffineGrid", [theta, np.array(size, np.int64)],
                                   {"align_corners": align}, exp, spot))
    k2 = {"kernel_shape": [2, 2]}
    deform = [
        ("test_cc_basic_deform_conv_with_padding", _deform_seed(padded=True), dict(k2, pads=[1, 1, 1, 1]),
         [[0, 1, 3, 2], [3, 8, 11.9, 7], [9, 20, 24, 13], [6, 13, 15, 8]]),
        ("test_cc_basic_deform_conv_without_padding", _deform_seed(), dict(k2, pads=[0, 0, 0, 0]),
         [[9.5, 11.9], [20, 24]]),
        ("test_cc_deform_conv_with_mask_bias", _deform_seed(mask_bias=True), dict(k2, pads=[0, 0, 0, 0]),
         [[10.5, 12.9], [21, 19.4]]),
        ("test_cc_deform_conv_with_multiple_offset_groups", _deform_seed(offset_group=2),
         dict(k2, pads=[0, 0, 0, 0], offset_group=2), [[33.5, 32.1], [32, 32]]),
    ]
    for name, ins, attrs, y in deform:
        out.append(ConformanceCase(name, "seed", "DeformConv", ins, attrs,
                                   np.array(y, dtype=np.float64).reshape((1, 1) + np.shape(y))))
    return out


def ms_deform_attn_f64(value, spatial_shapes, sampling_locations, attention_weights):
    """Multi-scale deformable attention by its definition, in float64, point by point:
    each level of ``value`` (N, S, M, Dh) sampled n-linearly at ``loc * size - 0.5`` on
    every axis (GridSample of ``2 * loc - 1``, zeros padding, ``align_corners=False``:
    corners outside the level count 0), weighted by the attention weights; a point
    whose location is not finite makes its head's channels NaN. Returns (N, Lq, M * Dh)."""
    import itertools
    import math
    value = np.asarray(value, np.float64)
    loc = np.asarray(sampling_locations, np.float64)
    attn = np.asarray(attention_weights, np.float64)
    N, S, M, Dh = value.shape
    _, Lq, _, L, P, r = loc.shape
    out = np.zeros((N, Lq, M, Dh))
    bad = np.zeros((N, Lq, M), bool)
    start = 0
    for lv in range(L):
        shape = tuple(int(v) for v in spatial_shapes[lv])  # outermost axis first
        size = math.prod(shape)
        level = value[:, start:start + size].reshape((N,) + shape + (M, Dh))
        for n, q, m, p in itertools.product(range(N), range(Lq), range(M), range(P)):
            xyz = [float(loc[n, q, m, lv, p, r - 1 - k]) for k in range(r)]  # (locations are innermost first)
            if not all(math.isfinite(c) for c in xyz):
                bad[n, q, m] = True
                continue
            pos = [c * shape[k] - 0.5 for k, c in enumerate(xyz)]
            base = [math.floor(c) for c in pos]
            for corner in itertools.product((0, 1), repeat=r):
                idx = [b + c for b, c in zip(base, corner)]
                if all(0 <= i < size_k for i, size_k in zip(idx, shape)):
                    w = math.prod(1 - abs(c - i) for c, i in zip(pos, idx))
                    out[n, q, m] += attn[n, q, m, lv, p] * w * level[(n, *idx, m)]
        start += size
    out[bad] = np.nan
    return out.reshape(N, Lq, M * Dh)


def ms_deform_attn_torch(value, spatial_shapes, sampling_locations, attention_weights):
    """mmcv's pure-PyTorch path, ``multi_scale_deformable_attn_pytorch`` (also HF
    transformers' and ultralytics'), on torch tensors: per level
    ``F.grid_sample(value_l, 2 * loc - 1, mode="bilinear", padding_mode="zeros",
    align_corners=False)`` (4-D for 2-D levels, 5-D for 3-D ones), every sample
    materialised, stacked, weighted and summed. ``spatial_shapes``: the levels' (H, W)
    or (D, H, W), rows of any sequence or array. The PyTorch peer of the ms_deform_attn
    cases (``harness``; autograd of it for the gradients), the tests' reference and the
    bench scripts'. Returns (N, Lq, M * Dh)."""
    import math

    import torch
    import torch.nn.functional as F
    N, S, M, Dh = value.shape
    _, Lq, _, L, P, r = sampling_locations.shape
    rows = spatial_shapes.tolist() if hasattr(spatial_shapes, "tolist") else spatial_shapes
    shapes = [tuple(int(s) for s in row) for row in rows]
    values = value.split([math.prod(s) for s in shapes], dim=1)
    grids = 2 * sampling_locations - 1
    samples = []
    for lv, shape in enumerate(shapes):
        v = values[lv].flatten(2).transpose(1, 2).reshape(N * M, Dh, *shape)
        g = grids[:, :, :, lv].transpose(1, 2).flatten(0, 1)  # (N * M, Lq, P, r)
        if r == 3:
            g = g[:, :, :, None, :]  # (N * M, Lq, P, 1, 3): 5-D sampling
        s = F.grid_sample(v, g, mode="bilinear", padding_mode="zeros", align_corners=False)
        samples.append(s.reshape(N * M, Dh, Lq, P))
    a = attention_weights.transpose(1, 2).reshape(N * M, 1, Lq, L * P)
    out = (torch.stack(samples, dim=-2).flatten(-2) * a).sum(-1).view(N, M * Dh, Lq)
    return out.transpose(1, 2).contiguous()


#: ms_deform_attn's conformance cases: name -> (node domain, dtype, level shapes, (N, Lq, M,
#: Dh, P), the locations' range, special locations {(n, q, m, level, point): location})
_MSDA_CASES = {
    "ms_deform_attn_2d_mmdeploy": ("mmdeploy", "float32", [[6, 5], [3, 3], [1, 2]], (2, 5, 2, 4, 2), (-0.2, 1.2), {}),
    "ms_deform_attn_2d_float64_mmcv": ("mmcv", "float64", [[4, 7], [2, 3]], (1, 6, 3, 2, 3), (-0.2, 1.2), {}),
    "ms_deform_attn_3d": ("numba_ops", "float32", [[3, 4, 2], [2, 2, 3], [1, 1, 1]], (1, 4, 2, 3, 2),
                          (-0.2, 1.2), {}),
    "ms_deform_attn_2d_edges_and_nonfinite": (
        "mmdeploy", "float32", [[4, 4], [2, 1]], (1, 4, 2, 3, 2), (0.0, 1.0),
        {(0, 0, 0, 0, 0): (0.0, 0.0), (0, 0, 0, 1, 1): (1.0, 1.0), (0, 1, 0, 0, 0): (0.625, 0.375),
         (0, 1, 1, 0, 1): (1e30, -1e30), (0, 2, 1, 1, 0): (np.nan, 0.5), (0, 3, 0, 0, 1): (np.inf, 0.5)}),
}


def ms_deform_attn_cases():
    """A small conformance set of ``ms_deform_attn`` against ``ms_deform_attn_f64``:
    2-D levels (MMDeploy's ``MMCVMultiScaleDeformableAttention`` node, domains
    ``mmdeploy`` and ``mmcv``), 3-D levels (the node of domain ``numba_ops``), points
    on the levels' edges, texel centres, far outside and not finite. Each case holds
    its node where onnx is installed (else None: the function is called)."""
    try:
        from onnx import helper
    except ImportError:
        helper = None
    out = []
    for i, (name, (domain, dtype, shapes, (N, Lq, M, Dh, P), span, special)) in enumerate(_MSDA_CASES.items()):
        rng = np.random.default_rng(10 + i)
        dt = np_dtype(dtype)
        shapes = np.array(shapes, np.int64)
        starts = np.concatenate(([0], np.cumsum(np.prod(shapes, axis=1))[:-1])).astype(np.int64)
        L, r = shapes.shape
        value = rng.standard_normal((N, int(np.prod(shapes, axis=1).sum()), M, Dh)).astype(dt)
        loc = rng.uniform(*span, (N, Lq, M, L, P, r)).astype(dt)
        for at, xy in special.items():
            loc[at] = xy
        attn = rng.uniform(0, 1, (N, Lq, M, L, P)).astype(dt)
        inputs = [value, shapes, starts, loc, attn]
        node = None
        if helper is not None:
            node = helper.make_node("MMCVMultiScaleDeformableAttention", ["value", "value_spatial_shapes",
                                                                         "value_level_start_index",
                                                                         "sampling_locations", "attention_weights"],
                                    ["output"], domain=domain, im2col_step=64)
        out.append(ConformanceCase(name, "ref", "ms_deform_attn", inputs, {},
                                   ms_deform_attn_f64(value, shapes, loc, attn), node=node))
    return out


def onnx_backend_cases():
    """ONNX's backend node cases for AffineGrid, DeformConv and GridSample.

    The onnx wheel ships the case generators but not their data files, so the
    cases are made by running the generators' ``export*`` functions with an
    ``expect`` that records (node, inputs, outputs) instead of writing files.
    Raises ImportError when onnx is not installed.
    """
    import importlib
    import inspect

    from onnx.backend.test.case.base import Base

    found = []

    def capture(node, inputs, outputs, name, **_):
        given = iter(inputs)  # ONNX passes present inputs only; "" marks an absent one
        ins = [next(given) if n else None for n in node.input]
        attrs = {}
        from onnx import helper
        for a in node.attribute:
            v = helper.get_attribute_value(a)
            attrs[a.name] = v.decode() if isinstance(v, bytes) else v
        found.append(ConformanceCase(name, "onnx", node.op_type, ins, attrs,
                                     np.asarray(outputs[0]), node=node))

    for modname in ("affinegrid", "deformconv", "gridsample"):
        mod = importlib.import_module("onnx.backend.test.case.node." + modname)
        saved = mod.expect
        mod.expect = capture
        try:
            for _, cls in inspect.getmembers(mod, inspect.isclass):
                if issubclass(cls, Base) and cls is not Base and cls.__module__ == mod.__name__:
                    for attr in sorted(vars(cls)):
                        if attr.startswith("export"):
                            getattr(cls, attr)()
        finally:
            mod.expect = saved
    return found
