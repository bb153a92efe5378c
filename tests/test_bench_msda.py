"""The multi-scale deformable attention cases of the benchmark's case table
(``msda_*``) and their PyTorch peer (mmcv's pure-PyTorch path,
``cases.ms_deform_attn_torch``, as ``numba-ops bench`` runs it): shrunken cases
(``small=True``), the peer against the float64 definition and numba_ops' gradients
against the peer's autograd."""
import numpy as np
import pytest

from numba_ops.benchmark import cases as _cases

MSDA = list(_cases.MSDA)


@pytest.mark.parametrize("name", MSDA)
def test_case_shapes_and_work(name):
    op, args, kw, work = _cases.inputs(name, small=True)
    value, shapes, starts, loc, attn = args
    N, S, M, Dh = value.shape
    assert op == "ms_deform_attn" and kw == {} and S == int(np.prod(shapes, axis=1).sum())
    assert loc.shape[:3] == (N, loc.shape[1], M) and loc.shape[3:] == (len(shapes), _cases.MSDA[name]["P"], 2)
    np.testing.assert_allclose(attn.sum(axis=(-2, -1)), 1, rtol=1e-5)  # normalised per query and head
    out_bytes = int(np.prod(_cases.forward_out_shape(op, args))) * value.itemsize
    assert work == value.nbytes + loc.nbytes + attn.nbytes + out_bytes
    bop, bargs, _, bwork = _cases.inputs(name + "_bwd", small=True)
    assert bop == "ms_deform_attn_backward" and bargs[0].shape == _cases.forward_out_shape(op, args)
    assert bwork == bargs[0].nbytes + 2 * (value.nbytes + loc.nbytes + attn.nbytes)


@pytest.mark.parametrize("name", MSDA)
def test_torch_peer(name):
    torch = pytest.importorskip("torch")
    import numba_ops
    from numba_ops.benchmark import harness
    op, args, kw, _ = _cases.inputs(name, small=True)
    value, shapes, _, loc, attn = args
    f, _ = harness._torch_forward(op, args, kw, "cpu")
    ref = _cases.ms_deform_attn_f64(value, shapes, loc, attn)
    np.testing.assert_allclose(f().numpy(), ref, rtol=1e-5, atol=1e-6)
    # the gradient case's peer: autograd of the same path, every input's gradient
    op, fargs, kw, gy, _ = _cases.backward_parts(name + "_bwd", small=True)
    f, leaves = harness._torch_forward(op, fargs, kw, "cpu", grad=True)
    want = torch.autograd.grad(f(), leaves, torch.from_numpy(gy))
    got = numba_ops.ms_deform_attn_backward(gy, *fargs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-5)
