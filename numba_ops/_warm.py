"""``numba_ops.warm``: compile every kernel variant into numba's on-disk cache,
so that a later process starts with no compile at all.

Each op's front end (``numba_ops/<op>.py``) lists, per float dtype name, a few
tiny calls of its public function (``warm_calls(dtype)``: ``(args, kwargs)``
pairs) that together reach every kernel variant its launchers compile: each
rank, each path (direct, serial, parallel), with and without the optional
inputs; where onnxruntime is installed, each op also compiles the tasks that
``numba_ops.onnx.session`` runs for its nodes (``onnx._capi.warm_calls``,
``warm_task``). ``warm`` makes those calls on each requested device; numba
compiles what is not in its cache yet and saves it there, so a later process
loads instead of compiling. The kernels are ``cache=True`` (CPU and CUDA), so a second
``warm`` finds everything cached and only loads.

What was compiled is read from numba's own dispatchers (their per-signature
cache hit and miss counters), over every dispatcher of numba_ops' modules.

A finished warm-up (no failures) leaves a stamp in the cache folder: what it was
asked for, and the state it left: numba_ops' sources and the cache files (names,
sizes, modification times), numba's and Python's versions and the CPU numba
compiles for (numba keys its cache on the sources' stamps and that CPU). A later
warm-up of the same request that finds all of it unchanged has nothing to compile
or load and returns at once (``up_to_date``); anything changed, and it warms as usual.
"""
from __future__ import annotations

import gc
import importlib
import importlib.util
import os
import sys
import time

from typing import TYPE_CHECKING, Any

from ._dispatch import DEVICES, LAUNCHERS, cuda_simulator, cuda_usable
from ._dtypes import NAMES

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

#: every public op, in the package's order; ``warm`` takes those whose front end is installed
ALL_OPS = ("affine_grid", "deform_conv", "grid_sample", "affine_warp", "ms_deform_attn")


def available_ops():
    """The ops with a kernel table entry (``_dispatch.LAUNCHERS``) whose front end
    (``numba_ops/<op>.py``, defining ``warm_calls``) is installed, in ``ALL_OPS``' order."""
    ops = []
    for op, _ in LAUNCHERS:
        if op not in ops and importlib.util.find_spec(f"numba_ops.{op}") is not None:
            ops.append(op)
    return tuple(sorted(ops, key=lambda o: ALL_OPS.index(o) if o in ALL_OPS else len(ALL_OPS)))


def _names(value, what, allowed, default):
    """``value`` (None, one name, or an iterable of names) as a tuple of names from
    ``allowed``, without repeats; ValueError naming ``what`` otherwise."""
    if value is None:
        return tuple(default)
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        value = [value]
    out = []
    for v in value:
        name = v
        if what == "dtypes" and not isinstance(v, str):
            import numpy as np
            try:
                name = np.dtype(v).name
            except TypeError:
                name = repr(v)
        if not isinstance(name, str) or name not in allowed:
            raise ValueError(f"{what} must name some of {', '.join(allowed)}; got {v!r}")
        if name not in out:
            out.append(name)
    return tuple(out)


def _check_ops(ops):
    have = available_ops()
    known = tuple(dict.fromkeys(ALL_OPS + have))
    names = _names(ops, "ops", known, have)
    missing = [op for op in names if op not in have]
    if missing:
        raise ValueError(f"ops: {', '.join(missing)} is not part of this numba_ops build; "
                         f"it has {', '.join(have)}")
    return names


def _dispatchers():
    """Every numba dispatcher (CPU, and CUDA once numba-cuda is loaded) whose
    Python function lives in numba_ops, the factories' kernels included."""
    from .kernels._compat import dispatcher_types
    kinds = dispatcher_types()
    out = []
    for obj in gc.get_objects():
        # (type(), not isinstance(): gc also lists weak proxies, whose referent may be gone)
        if issubclass(type(obj), kinds):
            mod = getattr(obj.py_func, "__module__", "") or ""
            if mod == "numba_ops" or mod.startswith("numba_ops."):
                out.append(obj)
    return out


def _counts(dispatchers):
    """{id: (dispatcher, cache misses (compiles), cache hits (loads))}."""
    from .kernels._compat import cache_counts
    return {id(d): (d, *cache_counts(d)) for d in dispatchers}


def _cache_dirs(dispatchers):
    from .kernels._compat import cache_path
    dirs = set()
    for d in dispatchers:
        path = cache_path(d)
        if path:
            dirs.add(path)
    return sorted(dirs)


def _cache_bytes(dirs):
    """Bytes of numba's cache files (index ``.nbi`` and data ``.nbc``) in ``dirs``."""
    total = 0
    for path in dirs:
        try:
            entries = os.scandir(path)
        except OSError:
            continue
        with entries:
            for e in entries:
                if e.name.endswith((".nbi", ".nbc")):
                    try:
                        total += e.stat().st_size
                    except OSError:
                        pass
    return total


def _label(op, dtype, device, args, kwargs):
    """``deform_conv float32 cpu [1x2x6x6] [2x2x2x2] ...``: arrays by shape, other values as they are."""
    def text(v):
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            return "[" + "x".join(map(str, v.shape)) + "]"
        return repr(tuple(v)) if isinstance(v, (list, tuple)) else repr(v)
    parts = [text(a) for a in args] + [f"{k}={text(v)}" for k, v in kwargs.items()]
    return f"{op} {dtype} {device} " + " ".join(parts)


#: the stamp's file, in the first of numba_ops' cache folders
STAMP = "numba_ops-warm.json"


def _state(request, calls, dirs):
    """What a warm-up of ``request`` (``calls``: its calls' labels) found or left behind
    (see the module's docstring): a JSON-able dict, equal between two runs only when
    nothing that numba's cache depends on has changed."""
    import hashlib

    import numba

    from .kernels._compat import cpu_magic_tuple

    def files(root, suffixes, recurse):
        out = []
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            return out
        for e in entries:
            if recurse and e.is_dir() and e.name != "__pycache__":
                out += files(e.path, suffixes, recurse)
            elif e.name.endswith(suffixes):
                st = e.stat()
                out.append([e.path, st.st_size, st.st_mtime_ns])
        return out

    cuda = None
    if "cuda" in request["devices"]:
        from numba import cuda as nc
        cuda = [getattr(sys.modules.get("numba_cuda"), "__version__", None),
                list(nc.get_current_device().compute_capability)]
    return {
        "request": request, "calls": hashlib.sha1("\n".join(calls).encode()).hexdigest(),
        "numba": numba.__version__, "python": sys.version,
        "cpu": list(cpu_magic_tuple()), "cuda": cuda,
        "sources": files(os.path.dirname(os.path.abspath(__file__)), (".py",), True),
        "cache": [f for d in dirs for f in files(d, (".nbi", ".nbc"), False)],
    }


def _stamp_path(dirs):
    return os.path.join(dirs[0], STAMP) if dirs else None


def _read_stamp(dirs):
    import json
    try:
        with open(_stamp_path(dirs)) as f:
            return json.load(f)
    except (OSError, ValueError, TypeError):
        return None


def _write_stamp(dirs, state):
    """Best effort: a cache folder that cannot be written only costs the next run its shortcut."""
    import json
    path = _stamp_path(dirs)
    if path is None:
        return
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)
    except OSError:
        pass


def warm(ops: str | Iterable[str] | None = None, dtypes: str | Iterable[Any] | None = None,
         devices: str | Iterable[str] | None = None, *, jobs: int = 1,
         progress: Callable[[int, int, str, float], Any] | None = None, quiet: bool = False,
         force: bool = False) -> dict[str, Any]:
    """Compile every kernel variant of ``ops`` x ``dtypes`` x ``devices`` into
    numba's on-disk cache, so that later processes start with no compile.

    Kernels compile on first use (seconds each) and numba keeps them in its
    disk cache (see ``numba-ops info`` for where; ``NUMBA_CACHE_DIR`` moves
    it). Warming once, at image build or before starting a cluster, means no
    later process on that cache compiles anything. Ranks above 3 are not
    warmed: they compile on first use and are cached then.

    Parameters
    ----------
    ops : str or iterable of str, optional
        Op names ("affine_grid", "deform_conv", "grid_sample", "affine_warp",
        "ms_deform_attn"); default: every op of this build.
    dtypes : str or iterable, optional
        Float dtype names ("float16", "bfloat16", "float32", "float64") or
        dtypes; default: all four.
    devices : str or iterable of str, optional
        "cpu" and/or "cuda"; default: the usable devices (``numba_ops.devices()``).
        Under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) "cuda" is skipped:
        the simulator runs Python and compiles nothing to cache.
    jobs : int, default 1
        Worker processes compiling at once (numba compiles one function at a
        time per process): with ``jobs > 1`` each (op, dtype, device) is warmed
        in a process of its own, ``jobs`` at a time, and then this process makes
        every call once more, loading what they saved (and compiling whatever a
        worker could not save), so that the result is the same as with 1.
    progress : callable, optional
        Called as ``progress(i, total, label, elapsed_s)`` before each warm-up
        call, and with ``jobs > 1`` as each worker starts and ends
        (``numba-ops warm`` prints it).
    force : bool, default False
        True: make every call even where the stamp of an earlier warm-up says the
        cache is as that run left it (see the module's docstring).
    quiet : bool, default False
        False: print a summary (what was compiled, seconds, the cache
        folder and its size, any failures) to stdout, besides returning it.

    Returns
    -------
    dict
        ``ops``, ``dtypes``, ``devices`` (those warmed), ``calls`` (calls made),
        ``compiled`` (functions numba compiled, kernels and the jitted functions
        they call), ``loaded`` (found in the cache), ``seconds``, ``cache_dir``
        (the folder holding numba_ops' cache files), ``cache_dirs``,
        ``cache_bytes`` (their size), ``failures`` (a list of dicts: op, dtype,
        device, call, error), ``skipped`` ({device: why}) and ``up_to_date``
        (True when the stamp of an earlier warm-up of the same ops, dtypes and
        devices matched: no call was made, nothing compiled or loaded; ``loaded``
        is then the count of functions that run compiled or loaded, found in the
        cache unchanged).

    Raises
    ------
    ValueError
        An unknown op, dtype or device name (the message lists the allowed
        ones), or an op this build does not have.
    RuntimeError
        ``devices`` asks for "cuda" where no GPU (and no simulator) is usable.

    Examples
    --------
    >>> import numba_ops
    >>> report = numba_ops.warm("affine_grid", "float32", "cpu", quiet=True)
    >>> report["ops"], report["devices"], report["failures"]
    (['affine_grid'], ['cpu'], [])
    >>> numba_ops.warm("affine_grid", "float32", "cpu", quiet=True)["up_to_date"]  # nothing changed since
    True
    """
    t0 = time.perf_counter()
    ops = _check_ops(ops)
    dtypes = _names(dtypes, "dtypes", NAMES, NAMES)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an integer >= 1; got {jobs!r}")
    if devices is None:
        devices = ("cpu", "cuda") if cuda_usable() else ("cpu",)  # numba_ops.devices()
    devices = _names(devices, "devices", DEVICES, ())
    if "cuda" in devices and not cuda_usable():
        raise RuntimeError("devices asks for 'cuda' but no CUDA GPU is usable here "
                           "(install numba-cuda and a driver)")
    skipped = {}
    if "cuda" in devices and cuda_simulator():
        skipped["cuda"] = ("numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs Python: "
                           "it compiles nothing to cache")
        devices = tuple(d for d in devices if d != "cuda")

    plan = []
    for op in ops:
        front = importlib.import_module(f"numba_ops.{op}")
        public = getattr(front, op)
        for dtype in dtypes:
            for args, kwargs in front.warm_calls(dtype):
                for device in devices:
                    plan.append((op, dtype, device, public, args, kwargs))
            backward = getattr(front, op + "_backward", None)  # the gradients, warmed with their op
            for args, kwargs in (front.warm_backward_calls(dtype) if backward is not None else ()):
                for device in devices:
                    plan.append((op, dtype, device, backward, args, kwargs))
            if "cpu" in devices and _session_installed():
                # the shim and the compiled tasks of numba_ops.onnx.session's nodes of this op
                from .onnx._capi import warm_calls, warm_task
                plan += [(op, dtype, "cpu", warm_task, ("onnxruntime session",) + args, {})
                         for args in warm_calls(op, dtype)]
    # the kernel modules, so that their dispatchers are counted from the start
    for op in ops:
        for device in devices:
            for key in ((op, device), (op + "_backward", device)):
                if key in LAUNCHERS:
                    importlib.import_module(LAUNCHERS[key])
    found = _dispatchers()
    dirs = _cache_dirs(found)
    request = {"ops": list(ops), "dtypes": list(dtypes), "devices": list(devices)}
    calls = [_label(f.__name__ if f.__name__.endswith("_backward") else op, dtype, device, args, kwargs)
             for op, dtype, device, f, args, kwargs in plan]
    stamp = None if force else _read_stamp(dirs)
    if isinstance(stamp, dict):
        functions = stamp.pop("functions", 0)
        if stamp == _state(request, calls, dirs):
            return _result(request, 0, 0, functions, t0, dirs, [], skipped, True, progress, quiet)
    before = _counts(found)
    in_workers = 0  # functions compiled by worker processes (this process then loads them)
    groups = list(dict.fromkeys((op, dtype, device) for op, dtype, device, *_ in plan))
    probe_loads = 0
    if jobs > 1 and len(groups) > 1:
        todo = _uncached(plan, groups)
        # the probe's aborted compiles count as cache misses: count from here on
        mid = _counts(_dispatchers())
        probe_loads = sum(h - before.get(k, (None, 0, 0))[2] for k, (_, _, h) in mid.items())
        before = mid
        if len(todo) > 1:
            in_workers = _in_workers(todo, jobs, progress, t0)
    failures = []
    for i, (op, dtype, device, public, args, kwargs) in enumerate(plan):
        label = calls[i]
        if progress is not None:
            progress(i, len(plan), label, time.perf_counter() - t0)
        try:
            public(*args, **kwargs, device=device)
        except Exception as exc:  # report every failure, keep warming the rest
            failures.append({"op": op, "dtype": dtype, "device": device, "call": label,
                             "error": f"{type(exc).__name__}: {exc}"})
    found = _dispatchers()
    after = _counts(found)
    compiled, loaded = 0, probe_loads
    for key, (_, misses, hits) in after.items():
        _, m0, h0 = before.get(key, (None, 0, 0))
        compiled += misses - m0
        loaded += hits - h0
    dirs = _cache_dirs(found)
    if not failures:  # (the functions this process compiled or loaded: each one once)
        _write_stamp(dirs, dict(_state(request, calls, dirs), functions=compiled + loaded))
    return _result(request, len(plan), in_workers + compiled, loaded, t0, dirs, failures, skipped, False, progress,
                   quiet)


def _session_installed():
    """Whether ``numba_ops.onnx.session`` can run here (extra ``onnxruntime``)."""
    return all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime", "onnxruntime_extensions"))


def _result(request, ncalls, compiled, loaded, t0, dirs, failures, skipped, up_to_date, progress, quiet):
    """``warm``'s result dict (printed unless ``quiet``)."""
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress(ncalls, ncalls, "done", seconds)
    result = dict(request, calls=ncalls, compiled=compiled, loaded=loaded, seconds=seconds,
                  cache_dir=os.path.commonpath(dirs) if dirs else None, cache_dirs=dirs,
                  cache_bytes=_cache_bytes(dirs), failures=failures, skipped=skipped, up_to_date=up_to_date)
    if not quiet:
        summary(result)
    return result


class _Uncached(Exception):
    pass


def _uncached(plan, groups):
    """The groups (op, dtype, device) of ``plan`` that need a compile. Each CPU
    group's calls are tried here with a listener on numba's "numba:compile" event
    (fired after a cache miss, before any compiling) that aborts a numba_ops
    compile: what the cache holds loads, anything else fails at once. CUDA groups
    (their kernels are made per call by factories) always count as uncached."""
    from .kernels._compat import on_compile

    def abort(dispatcher):
        if (getattr(dispatcher.py_func, "__module__", "") or "").startswith("numba_ops"):
            raise _Uncached()

    cpu = {g for g in groups if g[2] == "cpu"}
    todo = {g for g in groups if g[2] != "cpu"}
    with on_compile(abort):
        for op, dtype, device, public, args, kwargs in plan:
            g = (op, dtype, device)
            if g in cpu and g not in todo:
                try:
                    public(*args, **kwargs, device=device)
                except Exception:  # not in the cache (or failing: the last pass says)
                    todo.add(g)
    return [g for g in groups if g in todo]


_WORKER = """
import json, sys
from numba_ops._warm import warm
op, dtype, device = json.loads(sys.argv[1])
r = warm(op, dtype, device, quiet=True)
print("@@" + json.dumps({"compiled": r["compiled"], "failures": len(r["failures"])}))
"""


def _in_workers(groups, jobs, progress, t0):
    """Warm each (op, dtype, device) of ``groups`` in a fresh process, ``jobs`` at
    a time, the costliest (deform_conv) first and each op's 16-bit dtypes after its
    compute types (their CPU calls run the float32 kernels: by then they load them
    instead of compiling them in two processes at once); returns the functions they
    compiled. Their failures are found again, and reported, by the caller's own pass."""
    import json
    import subprocess
    import threading
    from concurrent.futures import ThreadPoolExecutor

    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    order = sorted(groups, key=lambda g: (g[0] != "deform_conv", g[1] not in ("float32", "float64")))
    lock = threading.Lock()
    done = [0]

    def one(group):
        label = " ".join(group)
        if progress is not None:
            with lock:
                progress(done[0], len(order), f"{label}: compiling in a worker process", time.perf_counter() - t0)
        p = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(group)], capture_output=True, text=True,
                           env=env)
        n = 0
        if p.returncode == 0 and "@@" in p.stdout:
            n = json.loads(p.stdout.split("@@")[-1])["compiled"]
        with lock:
            done[0] += 1
            if progress is not None:
                state = f"{n} compiled" if p.returncode == 0 else f"worker exit {p.returncode}"
                progress(done[0] - 1, len(order), f"{label}: done ({state})", time.perf_counter() - t0)
        return n

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return sum(pool.map(one, order))


def summary(r, out=None):
    """Print ``warm``'s result ``r`` as a few lines (to stdout by default)."""
    out = sys.stdout if out is None else out
    for dev, why in r["skipped"].items():
        print(f"skipped {dev}: {why}", file=out)
    what = f"{', '.join(r['ops'])} x {', '.join(r['dtypes'])} on {', '.join(r['devices']) or 'no device'}"
    if r["up_to_date"]:
        print(f"up to date: {what}: the cache is as the last warm-up of these left it (its stamp: same sources, "
              f"cache files, numba and CPU): 0 calls, 0 functions compiled, {r['loaded']} found in the cache, "
              f"{r['seconds']:.1f} s", file=out)
    else:
        print(f"warmed {what}: {r['calls']} calls, {r['compiled']} functions compiled, {r['loaded']} loaded "
              f"from the cache, {r['seconds']:.1f} s", file=out)
    where = "NUMBA_CACHE_DIR" if os.environ.get("NUMBA_CACHE_DIR") else "beside the kernels; NUMBA_CACHE_DIR moves it"
    print(f"cache: {r['cache_dir']} ({_size_text(r['cache_bytes'])}; {where})", file=out)
    for f in r["failures"]:
        print(f"FAILED {f['call']}: {f['error']}", file=out)
    if r["failures"]:
        print(f"{len(r['failures'])} of {r['calls']} calls failed", file=out)


def _size_text(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def main(ops=None, dtypes=None, devices=None, jobs=1, out=None, force=False):
    """``numba-ops warm``: ``warm`` with a progress line per call (which call, how
    many left, seconds so far) and a summary; returns the exit status: 0, 1 when
    a call failed (a kernel that does not compile), 2 for bad arguments."""
    out = sys.stdout if out is None else out
    tty = out.isatty()

    def progress(i, total, label, elapsed):
        if label == "done":
            if tty:
                out.write("\r\033[K")
            return
        line = f"[{i + 1:>{len(str(total))}}/{total}] {elapsed:6.1f} s  {total - i - 1} left  {label}"
        out.write(("\r\033[K" + line) if tty else line + "\n")
        out.flush()

    try:
        r = warm(ops, dtypes, devices, jobs=jobs, progress=progress, quiet=True, force=force)
    except (ValueError, RuntimeError) as exc:
        print(f"numba-ops warm: error: {exc}", file=sys.stderr)
        return 2
    summary(r, out)
    return 1 if r["failures"] else 0
