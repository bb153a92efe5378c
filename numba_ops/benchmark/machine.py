"""What a timing depends on besides the code: the machine's metadata, saved with
every ``numba-ops bench --json`` run and compared by ``--compare``; the BLAS that
numba's ``np.dot`` (DeformConv's GEMM) runs on, and the ``OPENBLAS_CORETYPE``
warning.

A timing or a ratio to a peer measured on one CPU, BLAS kernel, thread count or
set of package versions says little about another: ``--compare`` reports such a
difference instead of failing on it.
"""
import importlib.metadata
import os
import platform
import subprocess
import sys

#: OpenBLAS x86-64 kernels (``OPENBLAS_CORETYPE`` values) by SIMD generation
_KERNEL_RANK = {
    "prescott": 0, "core2": 1, "penryn": 1, "dunnington": 1, "atom": 1,
    "nehalem": 2, "barcelona": 2, "bobcat": 2,
    "sandybridge": 3, "bulldozer": 3, "piledriver": 3, "steamroller": 3, "excavator": 3,
    "haswell": 4, "zen": 4,
    "skylakex": 5, "cooperlake": 6, "sapphirerapids": 7,
}

#: the fields that make two runs "the same machine" (versions are compared too, see diff)
MACHINE_KEYS = ("cpu_model", "cpu_simd", "cpus", "numba_threads", "threading_layer", "blas", "blas_env")

#: what the pin costs, as measured on the 2-core AMD EPYC (Zen 5) VM numba_ops is developed on
PIN_COST = ("measured on a 2-core AMD EPYC VM (AVX-512): sgemm 260 GFLOP/s pinned to Haswell vs "
            "465-490 GFLOP/s unpinned (SkylakeX kernel), so DeformConv's GEMM runs ~1.8x slower pinned")

_DISTS = ("numpy", "scipy", "numba", "llvmlite", "numba-cuda", "ml_dtypes", "onnx", "onnxruntime",
          "torch", "torchvision", "threadpoolctl")


def version(dist):
    """Installed version of ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpuinfo():
    """(model name, set of flags) from /proc/cpuinfo; ('', set()) where there is none."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = val.strip()
                elif key == "flags" and not flags:
                    flags = set(val.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def simd_flags(flags):
    """The flags that decide which kernels run fast (SSE/AVX/AVX-512/AMX/FMA/F16C),
    sorted; hypervisors differ in the others, which do not matter for timing."""
    return sorted(f for f in flags if f.startswith(("sse", "ssse", "avx", "amx", "fma", "f16c")))


def best_kernel(flags):
    """The newest OpenBLAS x86-64 kernel this CPU's flags support (its CORETYPE name), or None."""
    f = set(flags)
    if not f:
        return None
    if {"amx_bf16", "avx512_fp16"} <= f:
        return "SapphireRapids"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= f:
        return "Cooperlake"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
        return "SkylakeX"
    if {"avx2", "fma"} <= f:
        return "Haswell"
    if "avx" in f:
        return "SandyBridge"
    if "sse4_2" in f:
        return "Nehalem"
    return "Prescott"


def blas_info():
    """The BLAS libraries loaded by NumPy and SciPy (SciPy's is the one numba's
    ``np.dot`` calls), as threadpoolctl sees them: a list of
    {"by", "library", "kernel", "threads"}; a string saying why not when
    threadpoolctl is not installed."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl is not installed: pip install 'numba_ops[bench]')"
    import numpy  # noqa: F401  (loads NumPy's BLAS)
    try:
        import scipy.linalg  # noqa: F401  (loads SciPy's BLAS, numba's np.dot)
    except ImportError:
        pass
    out = []
    for d in threadpool_info():
        if d.get("user_api") != "blas":
            continue
        path = d.get("filepath") or ""
        by = next((m for m in ("numpy", "scipy", "torch") if f"{m}." in path or f"/{m}/" in path), "other")
        out.append({"by": by, "library": f"{d.get('internal_api')} {d.get('version')}",
                    "kernel": d.get("architecture") or "-", "threads": d.get("num_threads")})
    return sorted(out, key=lambda d: (d["by"], d["library"]))


def blas_text(blas):
    """One line for ``info`` and the bench header."""
    if isinstance(blas, str):
        return blas
    if not blas:
        return "none loaded"
    return "; ".join(f"{d['by']}: {d['library']}, kernel {d['kernel']}, {d['threads']} threads" for d in blas)


def coretype_warning(flags=None, blas=None, env=None):
    """A warning when ``OPENBLAS_CORETYPE`` pins OpenBLAS to a kernel older than
    this CPU supports (None otherwise), with what that costs."""
    env = os.environ if env is None else env
    pinned = env.get("OPENBLAS_CORETYPE")
    if not pinned:
        return None
    if flags is None:
        flags = _cpuinfo()[1]
    best = best_kernel(flags)
    rank_pin, rank_best = _KERNEL_RANK.get(pinned.lower()), _KERNEL_RANK.get((best or "").lower())
    if rank_pin is None or rank_best is None or rank_pin >= rank_best:
        return None
    return (f"OPENBLAS_CORETYPE={pinned} pins OpenBLAS (NumPy's and SciPy's; numba's np.dot, so DeformConv's "
            f"GEMM, runs on SciPy's) to the {pinned} kernel, older than this CPU supports (up to {best}); "
            f"{PIN_COST}. To time without the pin, in that command alone: "
            f"env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE numba-ops bench ...")


_SGEMM = """
import json, time, numpy as np
try:
    from threadpoolctl import threadpool_info
    k = sorted({d.get('architecture') for d in threadpool_info() if d.get('user_api') == 'blas'} - {None})
except ImportError:
    k = []
a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(np.float32)
a @ a
best = min((lambda t0: (a @ a, time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
print(json.dumps({"GFLOPs": 2 * 2048 ** 3 / best / 1e9, "kernel": ",".join(k)}))
"""


def sgemm_pinned_vs_unpinned(timeout=60):
    """{"pinned": {...}, "unpinned": {...}}: NumPy's 2048² sgemm rate (GFLOP/s, best
    of 5) and kernel in two short processes, with and without OPENBLAS_CORETYPE /
    OPENBLAS_L2_SIZE (about a second each); None where it could not be measured."""
    out = {}
    for key, drop in (("pinned", ()), ("unpinned", ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"))):
        env = {k: v for k, v in os.environ.items() if k not in drop}
        try:
            p = subprocess.run([sys.executable, "-c", _SGEMM], capture_output=True, text=True,
                               timeout=timeout, env=env)
            out[key] = __import__("json").loads(p.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            return None
    return out


def threading_layer():
    """numba's threading layer, after one small parallel numba_ops call starts the pool."""
    import numba
    import numpy as np

    import numba_ops
    from ..kernels.cpu import _runtime  # noqa: F401  (numba_ops' layer priority, before the pool starts)
    try:
        numba_ops.affine_grid(np.zeros((1, 2, 3), np.float32), (1, 1, 256, 256))
        return numba.threading_layer()
    except Exception as exc:  # report, never crash
        return f"unknown ({type(exc).__name__})"


def collect(layer=True):
    """This machine's metadata (a JSON-able dict): CPU model and SIMD flags, cores,
    numba's threads and threading layer, the BLAS libraries and kernels, the
    environment variables that steer them, and package versions."""
    import numba

    import numba_ops
    from ..kernels.cpu import _runtime  # noqa: F401  (sets numba_ops' threading defaults: read the env after it)
    model, flags = _cpuinfo()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    versions = {"python": platform.python_version(), "numba_ops": numba_ops.__version__}
    versions.update({d: version(d) for d in _DISTS})
    env_keys = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER", "GOMP_SPINCOUNT")
    return {
        "cpu_model": model,
        "cpu_simd": simd_flags(flags),
        "cpu_best_blas_kernel": best_kernel(flags),
        "cpus": affinity,
        "platform": platform.platform(),
        "numba_threads": numba.config.NUMBA_NUM_THREADS,
        "threading_layer": threading_layer() if layer else None,
        "blas": blas_info(),
        "blas_env": {k: os.environ[k] for k in env_keys if k in os.environ},
        "versions": versions,
    }


def _short(v):
    if isinstance(v, list) and v and isinstance(v[0], dict):
        return blas_text(v)
    if isinstance(v, list):
        return " ".join(map(str, v)) or "-"
    return "-" if v is None else str(v)


def diff(saved, now):
    """What differs between two runs' metadata: (machine lines, version lines),
    each line "key: saved -> now". A run saved without metadata differs in everything."""
    if not saved:
        return ["the saved run carries no machine metadata (saved by an older numba-ops bench)"], []
    machine = []
    for key in MACHINE_KEYS:
        a, b = saved.get(key), now.get(key)
        if key == "cpu_simd" and a != b and a is not None and b is not None:
            gone, new = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            machine.append(f"cpu_simd: only saved {' '.join(gone) or '-'}; only now {' '.join(new) or '-'}")
        elif a != b:
            machine.append(f"{key}: {_short(a)} -> {_short(b)}")
    versions = []
    va, vb = saved.get("versions") or {}, now.get("versions") or {}
    for key in sorted(set(va) | set(vb)):
        if key != "numba_ops" and va.get(key) != vb.get(key):  # numba_ops is what is compared
            versions.append(f"{key}: {va.get(key)} -> {vb.get(key)}")
    return machine, versions


def header_lines(meta):
    """The machine lines of the bench header."""
    lines = [f"machine: {meta['cpu_model']}, {meta['cpus']} CPUs (best BLAS kernel {meta.get('cpu_best_blas_kernel')}); "
             f"numba {meta['versions'].get('numba')}, {meta['numba_threads']} threads, "
             f"{meta.get('threading_layer') or '?'} layer",
             f"BLAS: {blas_text(meta['blas'])}"]
    if meta.get("blas_env"):
        lines[-1] += " (" + ", ".join(f"{k}={v}" for k, v in meta["blas_env"].items() if k.startswith("OPENBLAS")) + ")"
        lines[-1] = lines[-1].replace(" ()", "")
    return lines
