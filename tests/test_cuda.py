"""The CUDA backend: kernels compiled for real GPUs, the no-GPU path, device interop.

Numerical agreement of the CUDA kernels with the oracles is tested by the op test
files through the ``device`` fixture (every test there runs on "cuda" too when it
is usable: under NUMBA_ENABLE_CUDASIM=1 in CI). This file adds what those cannot
see: the error path without a GPU, which array kinds come back, strided and
foreign (``__cuda_array_interface__``) device inputs, and the production tile
configuration. The simulator runs kernels as Python and checks no types: every
kernel is type-checked and built for sm_80 and sm_90 by tests/test_resources.py.
"""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import numba_ops
from numba_ops import _dispatch
from helpers import BF16
from reference import assert_api_close, deform_conv_ref

SIMULATOR = _dispatch.cuda_simulator()
CUDA = "cuda" in numba_ops.devices()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1 (CI's second pass)")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CCS = [(8, 0), (9, 0)]


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# --- without a GPU ----------------------------------------------------------------

def _small_inputs(dtype=np.float32):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 3, 3)).astype(dtype)
    w = rng.standard_normal((2, 2, 2, 2)).astype(dtype)
    off = rng.standard_normal((1, 8, 2, 2)).astype(dtype)
    theta = rng.standard_normal((2, 2, 3)).astype(dtype)
    return theta, x, w, off


def test_no_gpu_is_a_runtime_error(monkeypatch):
    """No GPU (numba-cuda reports none): devices() is ("cpu",) and device="cuda" says so."""
    from numba import cuda
    monkeypatch.setattr(cuda, "is_available", lambda: False)
    assert numba_ops.devices() == ("cpu",)
    theta, x, w, off = _small_inputs()
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        numba_ops.affine_grid(theta, [2, 1, 3, 4], device="cuda")
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        numba_ops.deform_conv(x, w, off, device="cuda")
    # the CPU still works, and device=None with host inputs is the CPU
    assert isinstance(numba_ops.affine_grid(theta, [2, 1, 3, 4]), np.ndarray)


class _ForeignDeviceArray:
    """Something exporting __cuda_array_interface__ (as CuPy or torch would)."""
    dtype = np.dtype(np.float32)
    shape = (1, 2, 3)
    __cuda_array_interface__ = {"typestr": "<f4", "shape": (1, 2, 3), "data": (0, False), "version": 3}


def test_device_input_without_a_gpu_is_a_runtime_error(monkeypatch):
    """device=None follows a __cuda_array_interface__ input to "cuda"; with no
    GPU that is the same RuntimeError, as is copying it to the CPU."""
    from numba import cuda
    monkeypatch.setattr(cuda, "is_available", lambda: False)
    for device in (None, "cuda", "cpu"):
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            numba_ops.affine_grid(_ForeignDeviceArray(), [1, 1, 2, 3], device=device)
    x = np.zeros((1, 1, 3, 3), np.float32)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        numba_ops.deform_conv(x, np.ones((1, 1, 2, 2), np.float32), _ForeignDeviceArray())


def test_broken_driver_is_not_usable(monkeypatch):
    from numba import cuda

    def boom():
        raise OSError("driver exploded")
    monkeypatch.setattr(cuda, "is_available", boom)
    assert numba_ops.devices() == ("cpu",)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        numba_ops.affine_grid(_small_inputs()[0], [2, 1, 3, 4], device="cuda")


def test_no_gpu_for_real_in_a_fresh_process():
    """The same without monkeypatching: simulator off and every GPU hidden."""
    code = textwrap.dedent("""
        import numpy as np, numba_ops
        assert numba_ops.devices() == ("cpu",), numba_ops.devices()
        try:
            numba_ops.affine_grid(np.zeros((1, 2, 3), np.float32), [1, 1, 2, 2], device="cuda")
        except RuntimeError as e:
            assert "no CUDA GPU" in str(e), e
        else:
            raise SystemExit("device='cuda' did not raise")
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=_env(NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]


def test_cpu_works_without_numba_cuda():
    """numba-cuda is imported lazily: with it uninstallable, numba_ops imports and
    the CPU path runs; devices() is ("cpu",) and device="cuda" is the RuntimeError."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "numba.cuda" or name.startswith("numba.cuda.") or name.startswith("numba_cuda"):
                    raise ImportError("numba-cuda blocked for this test")
        sys.meta_path.insert(0, Block())
        import numpy as np, numba_ops
        th = np.zeros((1, 2, 3), np.float32)
        numba_ops.affine_grid(th, [1, 1, 2, 2])
        numba_ops.deform_conv(np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2)), np.zeros((1, 8, 2, 2)))
        assert numba_ops.devices() == ("cpu",)
        try:
            numba_ops.affine_grid(th, [1, 1, 2, 2], device="cuda")
        except RuntimeError:
            pass
        else:
            raise SystemExit("no RuntimeError")
        assert not any(m.startswith("numba.cuda") or m.startswith("numba_cuda") for m in sys.modules)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=_env(NUMBA_ENABLE_CUDASIM="0"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]


# --- host and device arrays in, the right kind out --------------------------------

def _dc_case(rng, dtype, nd=2, strides=None):
    xs = (2, 4) + (5, 4, 3)[:nd]
    x = rng.standard_normal(xs)
    w = rng.standard_normal((4, 2) + (2,) * nd)
    kw = dict(pads=[1] * nd + [0] * nd, group=2, offset_group=2)
    outs = tuple(d + 1 - 2 + 1 for d in xs[2:])
    off = rng.standard_normal((2, 2 * 2 ** nd * nd) + outs) * 2
    mask = rng.standard_normal((2, 2 * 2 ** nd) + outs)
    b = rng.standard_normal(4)
    return [a.astype(dtype) for a in (x, w, off, b, mask)], kw


@needs_cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
def test_host_in_host_out(dtype):
    rng = np.random.default_rng(0)
    theta = rng.standard_normal((2, 3, 4)).astype(dtype)
    g = numba_ops.affine_grid(theta, [2, 1, 2, 3, 2], True, device="cuda")
    assert type(g) is np.ndarray and g.dtype == dtype and g.shape == (2, 2, 3, 2, 3)
    np.testing.assert_array_equal(g, numba_ops.affine_grid(theta, [2, 1, 2, 3, 2], True, device="cpu"))
    args, kw = _dc_case(rng, dtype)
    y = numba_ops.deform_conv(*args, **kw, device="cuda")
    assert type(y) is np.ndarray and y.dtype == dtype and y.shape == (2, 4, 5, 4)
    want = numba_ops.deform_conv(*args, **kw, device="cpu")
    assert_api_close(y, want, dtype)


def _is_numba_device_array(a):
    return bool(getattr(type(a), "__cuda_ndarray__", False))


@needs_cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
def test_device_in_device_out(dtype):
    from numba import cuda
    rng = np.random.default_rng(1)
    theta = rng.standard_normal((2, 2, 3)).astype(dtype)
    dth = cuda.to_device(theta)
    g = numba_ops.affine_grid(dth, [2, 1, 3, 4])  # device=None follows the input
    assert _is_numba_device_array(g) and g.dtype == dtype and g.shape == (2, 3, 4, 2)
    np.testing.assert_array_equal(g.copy_to_host(), numba_ops.affine_grid(theta, [2, 1, 3, 4], device="cpu"))
    args, kw = _dc_case(rng, dtype, nd=1)
    dargs = [cuda.to_device(a) for a in args]
    y = numba_ops.deform_conv(*dargs, **kw)
    assert _is_numba_device_array(y) and y.dtype == dtype
    want = deform_conv_ref(*[a.astype(np.float64) for a in args], **kw)
    assert_api_close(y.copy_to_host(), want, dtype)
    # a device input with device="cpu" runs on the CPU and still gives a device array
    c = numba_ops.affine_grid(dth, [2, 1, 3, 4], device="cpu")
    assert _is_numba_device_array(c) and c.dtype == dtype
    np.testing.assert_array_equal(c.copy_to_host(), g.copy_to_host())
    yc = numba_ops.deform_conv(dargs[0], *args[1:], **kw, device="cpu")  # one device input is enough
    assert _is_numba_device_array(yc) and yc.dtype == dtype
    assert_api_close(yc.copy_to_host(), want, dtype)
    # inputs are not modified
    np.testing.assert_array_equal(dth.copy_to_host(), theta)
    for d, a in zip(dargs, args):
        np.testing.assert_array_equal(d.copy_to_host(), a)


@needs_cuda
def test_mixed_host_and_device_inputs_give_device_output():
    from numba import cuda
    args, kw = _dc_case(np.random.default_rng(2), np.float32, nd=1)
    mixed = [cuda.to_device(args[0])] + args[1:]
    y = numba_ops.deform_conv(*mixed, **kw)
    assert _is_numba_device_array(y)
    assert_api_close(y.copy_to_host(), numba_ops.deform_conv(*args, **kw, device="cpu"), np.float32)


@needs_cuda
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_strided_device_inputs(dtype):
    """Sliced (non-contiguous) device arrays are packed on the device. Positive
    steps only: numba's own device arrays are sliced, not transposed, into views
    (foreign transposed and reversed views: test_torch_interface_in_simulator)."""
    from numba import cuda
    rng = np.random.default_rng(3)
    base = rng.standard_normal((3, 4, 6)).astype(dtype)
    dtheta = cuda.to_device(base)[:, 1:3, 1::2]  # (3, 2, 3)
    assert not dtheta.is_c_contiguous()
    g = numba_ops.affine_grid(dtheta, [3, 1, 2, 3])
    np.testing.assert_array_equal(g.copy_to_host(),
                                  numba_ops.affine_grid(base[:, 1:3, 1::2], [3, 1, 2, 3], device="cpu"))
    args, kw = _dc_case(rng, dtype)
    x = args[0]
    big = np.zeros(x.shape[:2] + tuple(2 * d for d in x.shape[2:]), dtype)
    big[:, :, ::2, 1::2] = x
    dx = cuda.to_device(big)[:, :, ::2, 1::2]
    dw = cuda.to_device(np.concatenate([args[1], args[1]], axis=0))[::2]  # every other row
    assert dx.shape == x.shape and not dx.is_c_contiguous() and not dw.is_c_contiguous()
    w2 = np.concatenate([args[1], args[1]], axis=0)[::2]
    dargs = [dx, dw] + [cuda.to_device(a) for a in args[2:]]
    y = numba_ops.deform_conv(*dargs, **kw)
    want = numba_ops.deform_conv(x, w2, *args[2:], **kw, device="cpu")
    assert_api_close(y.copy_to_host(), want, dtype)


@needs_cuda
def test_empty_results_keep_their_kind():
    from numba import cuda
    theta = np.zeros((0, 2, 3), np.float32)
    g = numba_ops.affine_grid(cuda.to_device(np.zeros((1, 2, 3), np.float32)), [1, 1, 0, 3])
    assert _is_numba_device_array(g) and g.shape == (1, 0, 3, 2)
    h = numba_ops.affine_grid(theta, [0, 1, 3, 3], device="cuda")
    assert type(h) is np.ndarray and h.shape == (0, 3, 3, 2)
    y = numba_ops.deform_conv(np.zeros((0, 1, 3, 3)), np.ones((2, 1, 2, 2)), np.zeros((0, 8, 2, 2)), device="cuda")
    assert type(y) is np.ndarray and y.shape == (0, 2, 2, 2)


# --- foreign __cuda_array_interface__ exporters (PyTorch's bfloat16 "<V2") ----------

class _TorchLike:
    """A torch tensor exported the way ``torch.Tensor.__cuda_array_interface__``
    does it (bfloat16 as typestr "<V2"). Only under the simulator, where device
    memory is host memory, can a CPU tensor stand in for a CUDA one."""

    def __init__(self, t):
        import torch
        self.t = t
        self.dtype = t.dtype
        self.shape = tuple(t.shape)
        typestr = {torch.bfloat16: "<V2", torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8"}[t.dtype]
        itemsize = t.element_size()
        self.__cuda_array_interface__ = {
            "typestr": typestr, "shape": self.shape, "data": (t.data_ptr(), False), "version": 2,
            "strides": None if t.is_contiguous() else tuple(s * itemsize for s in t.stride())}


def test_untyped_interface_dtypes():
    from numba_ops.kernels.cuda._device import interface_desc

    class Obj:
        def __init__(self, typestr, dtype):
            self.dtype = dtype
            self.__cuda_array_interface__ = {"typestr": typestr, "shape": (2,), "data": (0, False), "version": 3}
    desc, bf16 = interface_desc(Obj("<V2", "torch.bfloat16"), "X")
    assert bf16 and desc["typestr"] == "<u2"
    desc, bf16 = interface_desc(Obj("<f4", "torch.float32"), "X")
    assert not bf16 and desc["typestr"] == "<f4"
    with pytest.raises(TypeError, match="X"):
        interface_desc(Obj("<V2", "something"), "X")
    with pytest.raises(TypeError, match="theta"):
        interface_desc(Obj("|V4", "torch.bfloat16"), "theta")


@pytest.mark.skipif(not SIMULATOR, reason="a CPU tensor stands in for a CUDA one only in the simulator")
@pytest.mark.parametrize("tdtype", ["bfloat16", "float16", "float32"])
def test_torch_interface_in_simulator(tdtype):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, tdtype)
    npdt = BF16 if tdtype == "bfloat16" else np.dtype(tdtype)
    rng = np.random.default_rng(4)
    theta = rng.standard_normal((2, 2, 3)).astype(npdt)
    t = torch.from_numpy(theta.astype(np.float32)).to(tdt)
    g = numba_ops.affine_grid(_TorchLike(t), [2, 1, 3, 4])
    assert _is_numba_device_array(g) and g.dtype == npdt
    np.testing.assert_array_equal(g.copy_to_host(), numba_ops.affine_grid(theta, [2, 1, 3, 4], device="cpu"))
    # a transposed (non-contiguous) tensor
    args, kw = _dc_case(rng, np.float32, nd=1)
    xt = torch.from_numpy(np.ascontiguousarray(args[0].transpose(0, 2, 1))).to(tdt).transpose(1, 2)
    assert not xt.is_contiguous()
    others = [torch.from_numpy(a).to(tdt) for a in args[1:]]
    y = numba_ops.deform_conv(_TorchLike(xt), *[_TorchLike(o) for o in others], **kw)
    assert _is_numba_device_array(y) and y.dtype == npdt
    host = [a.astype(npdt) for a in args]
    want = numba_ops.deform_conv(*host, **kw, device="cpu")
    assert_api_close(y.copy_to_host(), want, npdt)


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if (not SIMULATOR and CUDA and torch.cuda.is_available()) else None


@pytest.mark.skipif(_torch_cuda() is None, reason="needs PyTorch with CUDA on a real GPU")
@pytest.mark.parametrize("tdtype", ["bfloat16", "float16", "float32"])
def test_torch_cuda_tensors(tdtype):
    """Real PyTorch CUDA tensors (bfloat16 exported as "<V2"; a transposed one too)
    go in without a copy and a numba device array comes out."""
    torch = _torch_cuda()
    tdt = getattr(torch, tdtype)
    npdt = BF16 if tdtype == "bfloat16" else np.dtype(tdtype)
    rng = np.random.default_rng(4)
    theta = rng.standard_normal((2, 2, 3)).astype(npdt)
    t = torch.from_numpy(theta.astype(np.float32)).to("cuda").to(tdt)
    g = numba_ops.affine_grid(t, [2, 1, 3, 4])
    assert _is_numba_device_array(g) and g.dtype == npdt
    np.testing.assert_array_equal(g.copy_to_host(), numba_ops.affine_grid(theta, [2, 1, 3, 4], device="cpu"))
    args, kw = _dc_case(rng, np.float32, nd=1)
    xt = torch.from_numpy(np.ascontiguousarray(args[0].transpose(0, 2, 1))).to("cuda").to(tdt).transpose(1, 2)
    assert not xt.is_contiguous()
    others = [torch.from_numpy(a).to("cuda").to(tdt) for a in args[1:]]
    y = numba_ops.deform_conv(xt, *others, **kw)
    assert _is_numba_device_array(y) and y.dtype == npdt
    want = numba_ops.deform_conv(*[a.astype(npdt) for a in args], **kw, device="cpu")
    assert_api_close(y.copy_to_host(), want, npdt)


# --- the GPU tile configurations, run by the simulator ------------------------------

@needs_cuda
@pytest.mark.parametrize("nd,wide", [(2, False), (2, True), (4, False)])
def test_gpu_tile_configuration(nd, wide, monkeypatch):
    """The simulator normally runs 4-thread tiles; run each of the GPU's 256-thread
    tile shapes (float64: n <= 3, its 64-bit-index one, n >= 4) once on a tiny
    case so the production configurations are checked too."""
    from numba_ops.kernels.cuda import deform_conv as dc
    tiles, nd_max, _ = dc.variants(np.float64)[(0 if nd <= 3 else 2) + wide]
    monkeypatch.setattr(dc, "config", lambda n, wide, ct: (tiles, max(nd_max, n)))
    if wide:
        monkeypatch.setattr(dc, "WIDE_FROM", 0)
    rng = np.random.default_rng(6)
    xs = (1, 3) + (3, 4, 2, 2)[:nd]
    x = rng.standard_normal(xs)
    w = rng.standard_normal((2, 3) + (2,) * nd)
    outs = tuple(d - 1 for d in xs[2:])
    off = rng.standard_normal((1, 2 ** nd * nd) + outs)
    b = rng.standard_normal(2)
    got = numba_ops.deform_conv(x, w, off, b, device="cuda")
    want = deform_conv_ref(x, w, off, b)
    assert_api_close(got, want, np.float64)


@needs_cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_64_bit_index_kernel_matches_32_bit(dtype, monkeypatch):
    """Tensors under 2**31 elements take the kernel with 32-bit indices; the 64-bit
    one (for larger tensors, which the simulator cannot hold) computes the same
    sums in the same order: forced here on a small case, the results are identical."""
    from numba_ops.kernels.cuda import deform_conv as dc
    args, kw = _dc_case(np.random.default_rng(8), dtype, nd=2)
    picked = []
    real = dc.kernel
    monkeypatch.setattr(dc, "kernel", lambda *a: picked.append(a[-1]) or real(*a))
    narrow = numba_ops.deform_conv(*args, **kw, device="cuda")
    monkeypatch.setattr(dc, "WIDE_FROM", 0)
    wide = numba_ops.deform_conv(*args, **kw, device="cuda")
    assert picked == [False, True]
    np.testing.assert_array_equal(wide, narrow)
    assert_api_close(wide, deform_conv_ref(*[a.astype(np.float64) for a in args], **kw), dtype)


@needs_cuda
def test_nan_and_huge_offsets_on_cuda():
    """Non-finite position -> NaN sample even when another axis is outside; huge
    finite offsets -> 0; an Inf in x next to an out-of-range corner never leaks."""
    x = np.arange(9.0).reshape(1, 1, 3, 3)
    x[0, 0, 0, 0] = np.inf
    w = np.ones((1, 1, 1, 1))
    off = np.zeros((1, 2, 3, 3))
    off[0, 0, 0, 1] = np.nan          # y NaN
    off[0, 1, 0, 1] = 1e30            # x far outside as well: still NaN
    off[0, 0, 1, 1] = 2.0 ** 63       # huge finite: 0
    off[0, 1, 2, 2] = -1e30
    off[0, 0, 2, 0] = np.inf
    off[0, 1, 1, 0] = 0.5             # between x[1,0] and x[1,1]: finite
    off[0, 1, 1, 2] = 0.5             # x = 2.5: corner 3 is outside, x[0,0] = inf must not leak in
    got = numba_ops.deform_conv(x, w, off, device="cuda")
    assert np.isnan(got[0, 0, 0, 1]) and np.isnan(got[0, 0, 2, 0])
    assert got[0, 0, 1, 1] == 0 and got[0, 0, 2, 2] == 0
    assert got[0, 0, 1, 0] == 3.5 and got[0, 0, 1, 2] == 2.5 and np.isinf(got[0, 0, 0, 0])


@needs_cuda
def test_concurrent_calls_match_serial():
    rng = np.random.default_rng(7)
    cases = [_dc_case(rng, np.float32, nd=1) for _ in range(4)]
    serial = [numba_ops.deform_conv(*a, **kw, device="cuda") for a, kw in cases]
    out = [None] * len(cases)

    def work(i):
        a, kw = cases[i]
        out[i] = numba_ops.deform_conv(*a, **kw, device="cuda")
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for want, got in zip(serial, out):
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not SIMULATOR, reason="a guard for numba-cuda's simulator (CI's second pass)")
def test_simulated_shared_arrays_are_shared():
    """numba-cuda's simulated cuda.shared.array is check-then-create without a lock, so two
    threads of a block could each get their own array (2 launches in 300 of this kernel
    before numba_ops' guard in kernels/cuda/_device.py; CI saw garbage DeformConv outputs)."""
    import sys

    from numba import cuda

    import numba_ops.kernels.cuda._device  # noqa: F401  (installs the guard)

    # the kernel's `cuda` must be a module global: the simulator swaps globals, not locals
    ns = {"cuda": cuda, "np": np}
    exec("def k(out):\n"
         "    s = cuda.shared.array(64, np.float64)\n"
         "    t = cuda.threadIdx.x\n"
         "    s[t] = t + 1.0\n"
         "    cuda.syncthreads()\n"
         "    acc = 0.0\n"
         "    for i in range(cuda.blockDim.x):\n"
         "        acc += s[i]\n"
         "    out[t] = acc\n", ns)
    k = cuda.jit(ns["k"])

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # thread switches as often as the launch guard makes them
    try:
        bad = 0
        for _ in range(300):
            out = np.zeros(16)
            k[1, 16](out)
            bad += not np.all(out == 136.0)
    finally:
        sys.setswitchinterval(old)
    assert bad == 0


@needs_cuda
def test_device_results_while_another_thread_packs():
    """One thread's CUDA calls pack a strided device input (a kernel in
    kernels/cuda/_device.py, whose ``cuda`` the simulator swaps while it runs) while
    another turns CPU results on device inputs into device arrays (host code of that
    module): every call succeeds with the serial result."""
    from numba import cuda

    strided = cuda.to_device(np.zeros((40, 2, 3), np.float32))[::2]
    dth = cuda.to_device(np.array([[[1, 0, 0], [0, 1, 0]]], np.float32))
    want = numba_ops.affine_grid(dth.copy_to_host(), (1, 1, 2, 3), device="cpu")
    done, errors = threading.Event(), []

    def packs():
        try:
            for _ in range(10):
                numba_ops.affine_grid(strided, (20, 1, 1, 1), device="cuda")
        finally:
            done.set()

    def reads():
        while not done.is_set():
            try:
                np.testing.assert_array_equal(
                    numba_ops.affine_grid(dth, (1, 1, 2, 3), device="cpu").copy_to_host(), want)
            except Exception as exc:  # reported in the main thread
                errors.append(exc)
    threads = [threading.Thread(target=packs), threading.Thread(target=reads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@needs_cuda
def test_size_on_the_device():
    """``size`` is an input too: a device array picks "cuda" under device=None and
    gives a device result on either device, with the values of a host size."""
    from numba import cuda

    theta = np.array([[[1, 0.5, 0], [0, 1, 0.25]]], np.float32)
    want = numba_ops.affine_grid(theta, [1, 1, 2, 3])
    dsize = cuda.to_device(np.array([1, 1, 2, 3]))
    for device in (None, "cpu", "cuda"):
        got = numba_ops.affine_grid(theta, dsize, device=device)
        assert not isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got.copy_to_host(), want)


def test_one_definition_of_a_device_array():
    """_dispatch and kernels/cuda/_device both take it from numba_ops/kernels/_arrays.py, and
    _device imports nothing from _dispatch (no import circle)."""
    import ast

    from numba_ops.kernels import _arrays
    from numba_ops.kernels.cuda import _device
    assert _dispatch.on_device is _arrays.on_device
    assert _device.is_numba_device_array is _arrays.is_numba_device_array
    tree = ast.parse(open(_device.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any("_dispatch" in m for m in imported), imported


def test_await_producers_syncs_only_foreign_exporter_streams():
    """CUDA array interface v3: an imported array's exporter stream is synchronised
    before a call on another stream reads it, never before a call on that stream;
    numba's own arrays (streams not imported) are left alone."""
    from numba_ops.kernels.cuda._device import await_producers

    class Stream:
        def __init__(self, handle, external=True):
            self.handle, self.external, self.waits = handle, external, 0

        def __int__(self):
            return self.handle

        def synchronize(self):
            self.waits += 1

    class Arr:
        def __init__(self, stream):
            self.stream = stream
    cupy_s, own_s = Stream(77), Stream(5, external=False)
    ours = Stream(77, external=False)
    await_producers([Arr(cupy_s), Arr(own_s), None, np.zeros(2), Arr(0)], ours)
    assert cupy_s.waits == 0 and own_s.waits == 0  # same stream as the call's: no wait
    await_producers([Arr(cupy_s), Arr(own_s)], 0)
    assert cupy_s.waits == 1 and own_s.waits == 0
    await_producers([Arr(cupy_s)], Stream(78))
    assert cupy_s.waits == 2


def test_malformed_or_masked_interfaces_name_the_input():
    from numba_ops.kernels.cuda._device import interface_desc

    class Obj:
        def __init__(self, iface):
            self.__cuda_array_interface__ = iface
    good = {"typestr": "<f4", "shape": (2,), "data": (0, False), "version": 3}
    for bad in ({k: v for k, v in good.items() if k != "typestr"}, dict(good, typestr="zz"),
                dict(good, data=None), 5):
        with pytest.raises(TypeError, match="X has a malformed __cuda_array_interface__"):
            interface_desc(Obj(bad), "X")
    with pytest.raises(TypeError, match="offset is a masked CUDA array"):
        interface_desc(Obj(dict(good, mask=object())), "offset")
