"""JIT compile time of each op × dtype, in a fresh process with an empty numba
cache (``NUMBA_CACHE_DIR`` pointed at a new temporary folder for every round),
timed from the first call's start to its end inside that process.

In smoke mode (benchmarks disabled) one subprocess, keeping the current cache,
makes the first calls of every op × dtype, and each test reads its own figure:
the path (fresh process, import, first call) is proven without paying a full
compilation, or an interpreter start, per op × dtype.
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

from numba_ops._dtypes import NAMES as DTYPE_NAMES

SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import numba_ops
from numba_ops.benchmark import cases as _cases
t1 = time.perf_counter()
out = {}
for name, dtype in zip(sys.argv[1::2], sys.argv[2::2]):
    fn = _cases.call(name, dtype, small=True, device="cpu")
    t2 = time.perf_counter()
    fn()
    t3 = time.perf_counter()
    fn()
    t4 = time.perf_counter()
    out[name + "/" + dtype] = {"import_s": t1 - t0, "first_call_s": t3 - t2, "second_call_s": t4 - t3}
print(json.dumps(out))
"""

CASE = {"affine_grid": "ag2d_small", "deform_conv": "dc_seed"}


def _first_calls(pairs, cache_dir):
    """{"case/dtype": timings} of the first calls made in one fresh process."""
    env = dict(os.environ)
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = cache_dir
    argv = [x for pair in pairs for x in pair]
    p = subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_SMOKE = {}


def _smoke_all():
    if not _SMOKE:
        _SMOKE.update(_first_calls([(CASE[op], dt) for op in CASE for dt in DTYPE_NAMES], None))
    return _SMOKE


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("op", sorted(CASE))
def test_jit_compile(benchmark, smoke, op, dtype, tmp_path):
    rounds = []

    def fresh_cache():
        return (None if smoke else tempfile.mkdtemp(dir=tmp_path),), {}

    key = CASE[op] + "/" + dtype

    def run(cache_dir):
        if smoke:
            rounds.append(_smoke_all()[key])
        else:
            rounds.append(_first_calls([(CASE[op], dtype)], cache_dir)[key])

    benchmark.group = f"jit {op}"
    benchmark.pedantic(run, setup=fresh_cache, rounds=3, iterations=1)
    r = rounds[-1]
    assert r["first_call_s"] >= r["second_call_s"] >= 0
    benchmark.extra_info.update(op=op, dtype=dtype, cached=smoke,
                                first_call_s=[x["first_call_s"] for x in rounds],
                                import_s=[x["import_s"] for x in rounds])
