"""``stream=`` (the documented contract: Devices) on every op: each accepted kind of stream gives the
default stream's result, a bad value is a TypeError naming ``stream``, calls on
device inputs never wait for the stream, calls on NumPy inputs return after the
copy back. Runs on a GPU or in numba's simulator (NUMBA_ENABLE_CUDASIM=1), which
has streams (all synchronous) but no external ones: there a raw handle stands for
the default stream, so the tests use handles a GPU would accept too."""
import numpy as np
import pytest

import numba_ops
from reference import assert_api_close

CUDA = "cuda" in numba_ops.devices()
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not CUDA, reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1 (CI's second pass)")]


class ProtocolStream:
    """The CUDA stream protocol: ``__cuda_stream__()`` -> (version 0, handle)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class CupyLike:
    def __init__(self, handle):
        self.ptr = handle


class TorchLike:
    def __init__(self, handle):
        self.cuda_stream = handle


def _numba_stream():
    from numba import cuda
    return cuda.stream()


def _handle(s):
    """A live stream's integer handle (the simulator's streams have none: any stands in)."""
    return 7 if numba_ops._dispatch.cuda_simulator() else int(s)


def _streams():
    """(name, factory) of every accepted kind; a factory returns (stream, keep-alive)."""
    def numba_stream():
        s = _numba_stream()
        return s, s

    def wrapped(cls):
        def make():
            s = _numba_stream()
            return cls(_handle(s)), s
        return make
    return [("none", lambda: (None, None)), ("numba", numba_stream), ("int0", lambda: (0, None)),
            ("numpy_int0", lambda: (np.int64(0), None)), ("protocol", wrapped(ProtocolStream)),
            ("protocol0", lambda: (ProtocolStream(0), None)), ("cupy", wrapped(CupyLike)),
            ("torch", wrapped(TorchLike)), ("int", wrapped(int))]


STREAMS = _streams()


def _cases(rng):
    th2 = rng.standard_normal((2, 2, 3)).astype(np.float32)
    th3 = rng.standard_normal((1, 3, 4)).astype(np.float64)
    x = rng.standard_normal((1, 2, 4, 3)).astype(np.float32)
    w = rng.standard_normal((2, 2, 2, 2)).astype(np.float32)
    off = rng.standard_normal((1, 8, 4, 2)).astype(np.float32)
    mask = rng.standard_normal((1, 4, 4, 2)).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    grid = rng.standard_normal((1, 2, 3, 2)).astype(np.float32)
    x8 = rng.integers(0, 256, (1, 2, 2, 3, 2), dtype=np.uint8)
    return [("affine_grid", (th2, [2, 1, 3, 4]), {"align_corners": True}),
            ("affine_grid", (th3, [1, 1, 2, 3, 2]), {}),
            ("deform_conv", (x, w, off, b, mask), {"pads": [1, 0, 0, 0]}),
            ("grid_sample", (x, grid), {"mode": "cubic", "padding_mode": "reflection"}),
            ("grid_sample", (np.ascontiguousarray(x8[:, :, 0]), grid), {"mode": "nearest"}),
            ("affine_warp", (x8, th3.astype(np.float32), [1, 2, 3, 2, 4]), {"align_corners": True}),
            ("affine_warp", (x, th2[:1], None), {"padding_mode": "border"})]


def _check(op, got, want):
    """Equal results: the sampling ops are bit-identical on every path (uint8 too);
    DeformConv within the documented accuracy."""
    if op == "deform_conv":
        assert_api_close(got, want, want.dtype)
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name,make", STREAMS, ids=[s[0] for s in STREAMS])
def test_every_stream_kind_gives_the_default_result(name, make):
    from numba import cuda
    for op, args, kw in _cases(np.random.default_rng(0)):
        f = getattr(numba_ops, op)
        want = f(*args, **kw, device="cuda")
        stream, keep = make()
        got = f(*args, **kw, device="cuda", stream=stream)  # NumPy in: NumPy out, after the copy
        assert type(got) is np.ndarray
        _check(op, got, want)
        dargs = [cuda.to_device(a) if isinstance(a, np.ndarray) and a.ndim > 1 else a for a in args]
        dev = f(*dargs, **kw, stream=stream)  # device in: a device array, ready when the stream is
        assert not isinstance(dev, np.ndarray)
        if keep is not None:
            keep.synchronize()
        _check(op, dev.copy_to_host(), want)
        del keep


@pytest.mark.parametrize("bad", ["s", 1.5, -1, True, object(), ProtocolStream("x"), ProtocolStream(-3),
                                 type("V1", (), {"__cuda_stream__": lambda self: (1, 0)})(), CupyLike(None)],
                         ids=["str", "float", "negative", "bool", "object", "protocol-str", "protocol-negative",
                              "protocol-v1", "ptr-none"])
def test_a_bad_stream_is_a_type_error_naming_it(bad):
    for op, args, kw in _cases(np.random.default_rng(1)):
        with pytest.raises(TypeError, match="stream"):
            getattr(numba_ops, op)(*args, **kw, device="cuda", stream=bad)


def test_the_cpu_ignores_stream():
    s = _numba_stream()
    for op, args, kw in _cases(np.random.default_rng(2)):
        f = getattr(numba_ops, op)
        np.testing.assert_array_equal(f(*args, **kw, device="cpu", stream=s), f(*args, **kw, device="cpu"))


def test_device_calls_never_wait_host_calls_wait_once(monkeypatch):
    """No synchronisation at all (device or stream) for device inputs; for NumPy inputs
    on a stream, the one synchronisation of that stream after the copy back."""
    from numba import cuda
    s = _numba_stream()
    waits = []
    monkeypatch.setattr(cuda, "synchronize", lambda: waits.append("device"))
    monkeypatch.setattr(type(s), "synchronize", lambda self: waits.append(self))
    for op, args, kw in _cases(np.random.default_rng(3)):
        f = getattr(numba_ops, op)
        f(*args, **kw, device="cuda", stream=s)  # first sight of every geometry table
        waits.clear()
        dargs = [cuda.to_device(a) if isinstance(a, np.ndarray) and a.ndim > 1 else a for a in args]
        f(*dargs, **kw, stream=s)
        assert waits == [], op
        f(*args, **kw, device="cuda", stream=s)
        assert waits == [s], op
        waits.clear()
