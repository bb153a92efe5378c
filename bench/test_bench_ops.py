"""Run time of each op × device × dtype × case of the shared case table
(``numba_ops.benchmark.cases``; the same names as ``numba-ops bench`` and the peer benchmark),
the forward cases (the gradients': test_backward.py).

Timed with ``pytest bench --benchmark-enable`` (``tox -e bench``); once, on
shrunken inputs, as a smoke test otherwise. Compilation happens in a warm-up
call outside the timing: JIT time has its own benchmark (test_jit_compile.py, which
runs after this file, so its smoke run finds the kernels cached). On numba's CUDA
simulator every case runs shrunken, timed or not.
"""
import numpy as np
import pytest

from numba_ops._dtypes import NAMES as DTYPE_NAMES
from numba_ops.benchmark import cases as _cases

#: the forward cases; the gradient cases (``_cases.BACKWARD``) are test_backward.py's
FORWARD = [(op, name) for op, name in _cases.CASES if not _cases.is_backward(name)]
NAMES = [name for _, name in FORWARD]


def _host(a):
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", NAMES, ids=[f"{op}-{n}" for op, n in FORWARD])
def test_op(benchmark, smoke, simulated, device, dtype, name):
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
    benchmark.extra_info.update(op=op, case=name, device=device, dtype=dtype, small=small,
                                work=work, work_unit={"affine_grid": "bytes written", "deform_conv": "flops"}.get(
                                    op, "bytes read and written"))
    out = _host(benchmark(fn))
    assert out.dtype == _cases.out_dtype(name, dtype) and out.size > 0
