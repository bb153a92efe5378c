"""How CPU kernels go parallel: the threading layer and its spin policy, the
threshold below which a kernel runs serially, and the lock that keeps concurrent
callers off the thread pool at the same time.

Measured on 2-core VMs (README, "Devices"):

- numba's OpenMP layer fills a buffer 2-4x faster than its workqueue layer (the
  workqueue is slower than one thread there), so OpenMP is preferred.
- libgomp's default spin (GOMP_SPINCOUNT=300000, ~8 ms) makes the second and
  later launches of a call that follows idle time take ~4 ms each; a longer spin
  (3,000,000, ~0.1 s of one core after a call, like Intel OpenMP's default
  200 ms block time) keeps back-to-back launches at ~10 us and a launch after
  idle at ~0.2 ms. The variable is read when libgomp loads, so it is set in the
  environment while numba_ops' first parallel launch starts numba's pool, and
  removed again (it reaches no other OpenMP runtime nor child process), unless
  the user set it.

A user's NUMBA_THREADING_LAYER / NUMBA_THREADING_LAYER_PRIORITY / GOMP_SPINCOUNT
win. Parallel launches from several Python threads are serialised here (the
workqueue layer must not be entered twice). Every kernel entry releases the GIL
(``nogil=True``), so serial kernels (small calls, and every call of a thread whose
numba thread count is 1) run without the lock, concurrently.

GNU OpenMP cannot run in a process forked after it started (numba terminates
such a child at its first parallel launch), so in a child forked after the pool
started every CPU kernel runs serially on the calling thread, with one warning.
"""
import os
import threading
import types
import warnings

import numba

from .._compat import launch_threads, pool_started, pool_thread_count

if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    # in the environment too: numba re-reads its config from it when it changes
    os.environ["NUMBA_THREADING_LAYER_PRIORITY"] = "omp workqueue tbb"
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]
#: libgomp's spin while numba's OpenMP pool starts (see the module docstring)
SPINCOUNT = "3000000"

#: below this many output elements (times work per element) a kernel runs serially:
#: waking the pool costs more than the work.
PARALLEL_MIN_WORK = 1 << 16

#: pool items per thread: a few, so that uneven items still balance
ITEMS_PER_THREAD = 4

def _start_pool():
    """Start numba's pool with ``GOMP_SPINCOUNT=SPINCOUNT`` in the environment for as
    long as it takes libgomp to load and read it (unless the user set it): the
    setting reaches numba's OpenMP layer and nothing else (other OpenMP runtimes,
    child processes)."""
    if pool_started():
        return
    mine = "GOMP_SPINCOUNT" not in os.environ
    if mine:
        os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
    try:
        launch_threads()
    except Exception:  # noqa: S110 (the launch itself starts it then, as numba does)
        pass
    finally:
        if mine:
            os.environ.pop("GOMP_SPINCOUNT", None)


class _PoolLock:
    """A lock that starts numba's pool (``_start_pool``) before its first holder
    launches onto it."""

    def __init__(self):
        self._lock = threading.Lock()

    def __enter__(self):
        if not pool_started():
            _start_pool()
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()


#: held by every parallel launch (affine_grid via ``run``, deform_conv directly)
POOL_LOCK = _PoolLock()

_forked_after_omp = False
_warned = False


def _after_fork_in_child():
    global _forked_after_omp
    if pool_started() and numba.threading_layer() == "omp":
        _forked_after_omp = True


if hasattr(os, "register_at_fork"):  # POSIX only; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)


def pool_usable():
    """False in a process forked after numba's OpenMP pool started (see above)."""
    global _warned
    if not _forked_after_omp:
        return True
    if not _warned:
        _warned = True
        warnings.warn("numba_ops runs its CPU kernels serially in this process: it was forked after "
                      "numba's GNU OpenMP thread pool started, and that pool cannot run in a forked "
                      "child (the 'spawn' or 'forkserver' start method, or "
                      "NUMBA_THREADING_LAYER=workqueue, keeps them parallel)", RuntimeWarning, stacklevel=4)
    return False


def num_threads():
    """``numba.get_num_threads()``: the calling thread's count. Once the pool is up it
    is read from numba's thread-local slot; ``get_num_threads()`` takes a
    multiprocessing lock on every call, which beside a spinning pool costs 5-15 us
    (2-4 % of a large AffineGrid here)."""
    n = pool_thread_count()
    return n if n > 0 else numba.get_num_threads()


def threads_for(work):
    """The threads ``run`` runs ``work`` on: 1 for small work or where the pool cannot
    run, else the caller's count (e.g. a Dask task's share)."""
    return num_threads() if work >= PARALLEL_MIN_WORK and pool_usable() else 1


def run(serial, parallel, work, *args):
    """``serial(*args)`` for small work, at one thread (the caller's count, e.g. a
    Dask task's share) or where the pool cannot run, without the lock; else
    ``parallel(*args, nchunks)`` under the pool lock, ``nchunks`` being a few pieces
    per thread for balance."""
    nth = threads_for(work)
    if nth == 1:
        return serial(*args)
    with POOL_LOCK:
        return parallel(*args, ITEMS_PER_THREAD * nth)


def pool_items(work, units, nth):
    """How many pool items a kernel's ``units`` (segments, rows) are dealt into on a
    pool of ``nth`` threads, as ``run`` deals them: 1 (the caller's thread alone) for
    small work or one thread, else a few per thread (numba_ops.onnx's session deals
    them onto onnxruntime's pool)."""
    if work < PARALLEL_MIN_WORK or nth <= 1:
        return 1
    return max(1, min(units, ITEMS_PER_THREAD * nth))



def serial_twin(parallel):
    """``parallel``'s function compiled without ``parallel=True`` (its ``prange`` loops run
    in order), for ``call``. A function of its own name: numba's disk cache keys a
    function's code by its qualified name and signature, not by its options, so the
    same name would hand one dispatcher the other's cached code."""
    fn = parallel.py_func
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                              fn.__closure__)
    twin.__qualname__ = fn.__qualname__ + "_serial"
    twin.__module__ = fn.__module__
    twin.__doc__ = fn.__doc__
    return numba.njit(cache=True, nogil=True)(twin)


def call(serial, parallel, work, *args):
    """``parallel(*args)`` (a kernel whose ``prange`` split does not depend on the
    thread count) under the pool lock, or ``serial(*args)``, the same function
    compiled without ``parallel``, for small work, at one thread or where the pool
    cannot run."""
    if work < PARALLEL_MIN_WORK or not pool_usable() or num_threads() == 1:
        return serial(*args)
    with POOL_LOCK:
        return parallel(*args)
