"""Calls through a callee's own compiled code (numba_ops/kernels/cpu/_opaque.py): the
results, the callee's code left out of the caller's, and numba's on-disk cache in
fresh processes, including a cached caller whose callee must be compiled again (its
cache entry gone): the caller's machine code then still finds the callee."""
import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

MODULE = textwrap.dedent('''
    import numpy as np
    from numba import njit, prange
    from numba_ops.kernels.cpu._opaque import opaque

    @njit(cache=True)
    def heavy(a, k, out, i):
        s = 0.0
        for j in range(a.size):
            s += np.sin(a[j] * k) * np.cos(a[j])
        if k < 0:
            raise ValueError("k < 0")
        out[i] = s

    @njit(cache=True)
    def twice(v):
        return 2 * v

    @njit(cache=True)
    def split(v):
        return np.int64(v), v > 3.0

    heavy_op, twice_op, split_op = opaque(heavy), opaque(twice), opaque(split)

    @njit(cache=True)
    def serial(a, n):
        out = np.empty(n)
        for k in range(n):
            heavy_op(a, k, out, k)
        i, big = split_op(twice_op(3.5))
        return out, twice_op(3.5), i, big

    @njit(cache=True)
    def raiser(a):
        out = np.empty(1)
        heavy_op(a, -1.0, out, 0)  # raises in the callee: the caller raises it
        return out[0]

    @njit(cache=True, parallel=True)
    def parallel(a, n):
        out = np.empty(n)
        for k in prange(n):
            heavy_op(a, np.float64(k), out, np.int64(k))
        return out
''')

PROBE = textwrap.dedent('''
    import json, sys, numpy as np
    sys.path.insert(0, sys.argv[1])
    import opaque_probe as m
    a = np.linspace(0, 1, 50)
    out, t, i, big = m.serial(a, 4)
    par = m.parallel(a, 4)
    try:
        m.raiser(a)
        bad = None
    except ValueError as e:
        bad = str(e)
    hits = sum(sum(f.stats.cache_hits.values()) for f in (m.serial, m.parallel, m.raiser))
    print(json.dumps({"serial": out.tolist(), "twice": t, "split": [i, big], "parallel": par.tolist(),
                      "raised": bad, "hits": hits}))
''')


def expected(n):
    a = np.linspace(0, 1, 50)
    return [float(np.sum(np.sin(a * k) * np.cos(a))) for k in range(n)]


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "opaque_probe.py").write_text(MODULE)
    cache = tmp_path / "cache"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))

    def run():
        p = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True,
                           env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    return run, cache


def test_opaque_calls_and_the_cache(probe):
    run, cache = probe
    first = run()
    assert first["hits"] == 0
    for got in (first, run()):
        assert got["serial"] == pytest.approx(expected(4), rel=1e-12)
        assert got["parallel"] == pytest.approx(expected(4), rel=1e-12)
        assert got["twice"] == 7.0
        assert got["split"] == [7, True]  # (a tuple of scalars returned)
        assert got["raised"] == "k < 0"
    # the callers come from the cache; the callee's entries are removed: it compiles
    # again, and the cached callers' code must call the new one
    for f in glob.glob(str(cache / "**" / "opaque_probe.heavy-*"), recursive=True):
        os.remove(f)
    got = run()
    assert got["hits"] == 3 and got["raised"] == "k < 0"
    assert got["serial"] == pytest.approx(expected(4), rel=1e-12)
    assert got["parallel"] == pytest.approx(expected(4), rel=1e-12)


def test_callee_code_is_not_copied():
    """The caller's LLVM module declares the callee's symbol and holds none of its code."""
    from numba import njit

    from numba_ops.kernels.cpu._opaque import opaque

    @njit
    def callee(a):
        a[0] = np.sin(a[1]) + np.cos(a[2])

    op = opaque(callee)

    @njit
    def caller(a):
        op(a)
        op(a[1:])

    a = np.array([0.0, 1.0, 2.0, 3.0])
    caller(a)
    assert a[0] == np.sin(1.0) + np.cos(2.0) and a[1] == np.sin(2.0) + np.cos(3.0)
    ir = caller.inspect_llvm(caller.signatures[0])
    assert "numba_ops.opaque." in ir
    assert "llvm.sin" not in ir and "@sin" not in ir  # the callee's body is not in the caller's module


def test_opaque_refuses_array_results():
    from numba import njit

    from numba_ops.kernels.cpu._opaque import opaque

    @njit
    def makes(n):
        return np.zeros(n)

    op = opaque(makes)

    @njit
    def caller(n):
        return op(n)

    with pytest.raises(TypeError, match="return None, a scalar or a tuple of scalars"):
        caller(3)
