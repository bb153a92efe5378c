"""Machine metadata of saved bench runs, the BLAS report and the OPENBLAS_CORETYPE
warning (numba_ops.benchmark.machine). The environment is never changed: the
warning is computed from given flags and variables."""
import sys

from numba_ops.benchmark import machine

AVX512 = ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"]


def test_best_kernel_from_flags():
    assert machine.best_kernel(AVX512) == "SkylakeX"
    assert machine.best_kernel(AVX512 + ["avx512_bf16"]) == "Cooperlake"
    assert machine.best_kernel(["sse4_2", "avx", "avx2", "fma"]) == "Haswell"
    assert machine.best_kernel(["sse4_2", "avx"]) == "SandyBridge"
    assert machine.best_kernel([]) is None


def test_coretype_warning():
    pinned = {"OPENBLAS_CORETYPE": "Haswell"}
    w = machine.coretype_warning(AVX512, env=pinned)
    assert w and "OPENBLAS_CORETYPE=Haswell" in w and "SkylakeX" in w and "GFLOP/s" in w and "env -u" in w
    assert machine.coretype_warning(AVX512, env={}) is None  # not pinned
    assert machine.coretype_warning(AVX512, env={"OPENBLAS_CORETYPE": "SkylakeX"}) is None  # pinned to the best
    assert machine.coretype_warning(["avx", "avx2", "fma"], env=pinned) is None  # an AVX2 CPU
    assert machine.coretype_warning(AVX512, env={"OPENBLAS_CORETYPE": "NoSuchCore"}) is None


def test_blas_info_without_threadpoolctl(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import fails as when it is not installed
    info = machine.blas_info()
    assert isinstance(info, str) and "threadpoolctl" in info
    assert machine.blas_text(info) == info


def test_blas_info_names_numpy_or_scipy():
    info = machine.blas_info()
    if isinstance(info, str):  # threadpoolctl missing here: covered above
        return
    assert info and all({"by", "library", "kernel", "threads"} <= set(d) for d in info)
    assert {d["by"] for d in info} & {"numpy", "scipy"}
    assert "kernel" in machine.blas_text(info)


def test_diff():
    a = {"cpu_model": "A", "cpu_simd": ["avx2"], "cpus": 2, "numba_threads": 2, "threading_layer": "omp",
         "blas": [{"by": "scipy", "library": "openblas 0.3.30", "kernel": "Haswell", "threads": 2}],
         "blas_env": {}, "versions": {"numba": "0.60", "numba_ops": "0.1.0"}}
    assert machine.diff(a, dict(a)) == ([], [])
    b = dict(a, cpu_simd=["avx2", "avx512f"], cpus=4, versions={"numba": "0.61", "numba_ops": "0.2.0"},
             blas=[dict(a["blas"][0], kernel="SkylakeX")])
    m, v = machine.diff(a, b)
    assert any(line.startswith("cpus: 2 -> 4") for line in m)
    assert any("only now avx512f" in line for line in m)
    assert any("Haswell" in line and "SkylakeX" in line for line in m)
    assert v == ["numba: 0.60 -> 0.61"]  # numba_ops' own version is what is compared, never a difference
    m, v = machine.diff(None, a)
    assert m and "no machine metadata" in m[0]


def test_collect_has_every_field():
    meta = machine.collect(layer=False)
    for key in machine.MACHINE_KEYS + ("versions",):
        assert key in meta
    assert meta["cpus"] >= 1 and meta["versions"]["numba"]
