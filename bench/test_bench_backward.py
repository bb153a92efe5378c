"""Run time of each gradient case × device × dtype of the shared case table
(``numba_ops.benchmark.cases.BACKWARD``, the ``*_bwd`` names of ``numba-ops bench``):
``numba_ops.<op>_backward`` on ``grad_y`` and the forward case's inputs, every
gradient the op has (DeformConv's five; x and the grid or theta; AffineGrid's theta;
ms_deform_attn's value, locations and weights).

Timed with ``pytest bench --benchmark-enable`` (``tox -e bench``); once, on
shrunken inputs (``small=True``: the same kernel, mask, mode and padding), as a
smoke test otherwise. Compilation happens in a warm-up call outside the timing. On
numba's CUDA simulator every case runs shrunken, timed or not. The comparison with
PyTorch autograd is ``numba-ops bench --only _bwd``'s.
"""
import numpy as np
import pytest

from numba_ops._dtypes import NAMES as DTYPE_NAMES
from numba_ops.benchmark import cases as _cases

BACKWARD = [(op, name) for op, name in _cases.CASES if _cases.is_backward(name)]


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


def _wanted_shapes(op, args):
    """The gradients' shapes: those of the inputs they belong to (AffineGrid: theta's)."""
    if op == "affine_grid_backward":
        size = [int(s) for s in args[1]]
        nd = len(size) - 2
        return [(size[0], nd, nd + 1)]
    if op == "deform_conv_backward":
        return [None if a is None else a.shape for a in args[1:6]]
    if op == "ms_deform_attn_backward":  # value, sampling_locations, attention_weights
        return [args[1].shape, args[4].shape, args[5].shape]
    return [args[1].shape, args[2].shape]  # x, and the grid or theta


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", [n for _, n in BACKWARD], ids=[f"{op}-{n}" for op, n in BACKWARD])
def test_backward(benchmark, smoke, simulated, device, dtype, name):
    small = smoke or (device == "cuda" and simulated)
    op, args, kwargs, work = _cases.inputs(name, dtype, small=small)
    fn = _cases.call(name, dtype, small=small, device=device)
    if device == "cuda" and not simulated:
        from numba import cuda
        call = fn
        fn = lambda: (call(), cuda.synchronize())[0]  # noqa: E731
    if not smoke:
        fn()  # compile (or load from the JIT cache) outside the timing
    benchmark.group = f"{op} {device} {dtype}"
    benchmark.extra_info.update(op=op, case=name, device=device, dtype=dtype, small=small, work=work,
                                work_unit="flops (2x the forward's)" if op == "deform_conv_backward"
                                else "bytes read and written")
    out = benchmark(fn)
    grads = out if isinstance(out, tuple) else (out,)
    want = _wanted_shapes(op, args)
    assert len(grads) == len(want)
    for g, shape in zip(grads, want):
        assert (g is None) == (shape is None)  # every input given has its gradient
        if g is not None:
            g = _host(g)
            assert g.shape == tuple(shape) and g.dtype == _cases.out_dtype(name, dtype)
            assert np.isfinite(g.astype(np.float64)).all()
