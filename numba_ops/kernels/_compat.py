"""Every use of numba's and numba-cuda's internals, in one place.

numba_ops reaches below numba's public API where the public API cannot do the job
(a call between compiled kernels that does not copy the callee, vector gathers,
views without ``reshape``, the pool's state without a lock, the JIT cache's
counters, compiling for a GPU that is not there, patches to numba-cuda). Each such
use is a function or name here, and each has a test in ``tests/test_compat.py``
that names the internal and fails with "numba X.Y changed <internal>" when a
release moves it. The rest of the package uses numba's public API only
(``numba``, ``numba.extending``, ``numba.types``, ``numba.cuda``, llvmlite).

numba-cuda is imported only by the functions that need it, so importing this
module never loads numba-cuda.
"""
import contextlib
import sys
import types as _pytypes

import numba
import numba.core.registry
from numba.core import cgutils  # noqa: F401  (LLVM IR helpers of numba's own lowering)
from numba.core.imputils import impl_ret_borrowed  # noqa: F401  (an intrinsic returning a borrowed array)
from numba.np.ufunc import parallel as _parallel


# --- code generation (CPU) ------------------------------------------------------------

def add_reload_init(context, fn):
    """Run ``fn()`` before the machine code of the function being lowered in
    ``context`` is loaded from numba's on-disk cache (``CodeLibrary._reload_init``)."""
    context.active_code_library._reload_init.add(fn)


def insert(builder, instr):
    """Append the llvmlite instruction ``instr``, made outside ``builder``, at its
    position (``IRBuilder._insert``: llvmlite has no public call for instructions it
    does not build itself, such as a vector GEP)."""
    builder._insert(instr)


#: ``njit`` options (numba's ``_nrt`` flag) of a function that allocates nothing: it is
#: compiled without numba's reference counting, so its array arguments are not
#: incremented and decremented (two atomic operations each) at every call. A kernel
#: helper called once per segment of a few hundred positions spent 8-14 % of a
#: GridSample call on them.
NO_NRT = dict(_nrt=False)

#: ``njit`` options of functions that only jitted code calls: numba then generates neither
#: the Python wrapper nor the C wrapper of each compiled signature, up to a third of a
#: small function's compile time (GridSample's first forward compiled in 11 s with its
#: helpers' wrappers, in 8 s without). Such a function cannot be called from Python.
INTERNAL = dict(cache=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)

#: ``njit`` options of the per-element helpers that both devices share (``kernels/_sample``,
#: ``_scalar``, ``_msda``): ``INTERNAL``, except under numba's CUDA simulator. There the
#: CUDA kernels are Python and call those helpers from Python, so they keep their wrappers
#: and stay out of the JIT cache, whose index does not tell a compilation with wrappers
#: from one without (a simulated kernel calling a cached wrapper-less helper crashed the
#: process). The CPU kernels' own functions stay ``INTERNAL`` and cached in every process:
#: the simulator's CPU calls load them from the cache as any other run does. (numba's own
#: config reads NUMBA_ENABLE_CUDASIM too: no need to load numba-cuda here.)
SHARED = dict() if numba.config.ENABLE_CUDASIM else INTERNAL


def struct_value(proxy):
    """The LLVM value of a numba struct proxy (``cgutils.Structure._getvalue``)."""
    return proxy._getvalue()


def blas():
    """``(ensure_blas, get_blas_kind)`` of numba's ``np.dot`` lowering (numba.np.linalg):
    the check that SciPy's BLAS is there, and the cblas symbol's kind letter."""
    from numba.np.linalg import ensure_blas, get_blas_kind
    return ensure_blas, get_blas_kind


# --- the thread pool --------------------------------------------------------------------

def pool_started():
    """True once numba's thread pool has started (``numba.np.ufunc.parallel._is_initialized``)."""
    return bool(_parallel._is_initialized)


def launch_threads():
    """Start numba's thread pool now (what its first parallel launch does:
    ``parallel._launch_threads``)."""
    _parallel._launch_threads()


def pool_thread_count():
    """The calling thread's numba thread count read from the pool's thread-local slot
    without ``get_num_threads()``'s lock (``parallel._get_num_threads``, set as the pool
    starts); 0 before the pool has started."""
    get = getattr(_parallel, "_get_num_threads", None)
    return get() if get is not None and _parallel._is_initialized else 0



def set_pool_thread_count(n):
    """Set the calling thread's numba thread count to ``n`` (at most the pool's size):
    through the pool's own binding (``parallel._set_num_threads``) once the pool has
    started, since ``numba.set_num_threads`` re-checks the pool and the value on every
    call, which costs more than a tiny kernel; ``numba.set_num_threads`` before."""
    import numba
    fast = getattr(_parallel, "_set_num_threads", None) if _parallel._is_initialized else None
    (fast or numba.set_num_threads)(n)

# --- dispatchers and the JIT cache ------------------------------------------------------

def dispatcher_types():
    """The dispatcher classes of the loaded targets: numba's CPU ``Dispatcher``, and
    numba-cuda's ``CUDADispatcher`` once numba-cuda is loaded (not loaded here)."""
    from numba.core.dispatcher import Dispatcher
    kinds = [Dispatcher]
    cuda_mod = sys.modules.get("numba.cuda.dispatcher")
    if cuda_mod is not None and hasattr(cuda_mod, "CUDADispatcher"):
        kinds.append(cuda_mod.CUDADispatcher)
    return tuple(kinds)


class _PlainDispatcher(numba.core.registry.CPUDispatcher):
    """numba's CPU dispatcher, typing the calls of jitted code with the arguments'
    plain types (``get_call_template``, where numba would compile a signature per
    literal value: a ``1``, a ``True``)."""

    def get_call_template(self, args, kws):
        return super().get_call_template(tuple(numba.types.unliteral(a) for a in args),
                                         {k: numba.types.unliteral(v) for k, v in kws.items()})


def plain_signatures(dispatcher):
    """``dispatcher`` (an ``njit`` one), made to compile once per plain signature when
    jitted code calls it: a literal argument reaches the signature of its plain type."""
    dispatcher.__class__ = _PlainDispatcher
    return dispatcher


def cache_counts(dispatcher):
    """``(misses, hits)`` of ``dispatcher``'s on-disk cache so far (every compile of a
    cached function is a miss; ``Dispatcher._cache_misses``/``_cache_hits``)."""
    return sum(dispatcher._cache_misses.values()), sum(dispatcher._cache_hits.values())


def cache_path(dispatcher):
    """The folder of ``dispatcher``'s on-disk cache as numba's locator chose it, or
    None for an uncached function (``Dispatcher._cache``)."""
    return getattr(getattr(dispatcher, "_cache", None), "cache_path", None)


def cpu_magic_tuple():
    """The CPU target's (triple, CPU name, features): what numba's cache index keys
    machine code by (``registry.cpu_target``)."""
    from numba.core.registry import cpu_target
    return tuple(str(v) for v in cpu_target.target_context.codegen().magic_tuple())


@contextlib.contextmanager
def on_compile(callback):
    """Within the block, ``callback(dispatcher)`` runs as numba starts compiling any
    function (after a cache miss; a load from the cache compiles nothing), and what
    it raises aborts that compile (``numba.core.event``, "numba:compile")."""
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev):
            callback(ev.data["dispatcher"])

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", Listener()):
        yield


# --- numba-cuda -------------------------------------------------------------------------

def cuda_config():
    """numba-cuda's config module (its own since numba's built-in CUDA target left
    numba; numba's config before)."""
    try:
        from numba.cuda.core import config
    except ImportError:
        from numba.core import config
    return config


def cuda_simulator_enabled():
    """``NUMBA_ENABLE_CUDASIM`` as numba-cuda read it."""
    return bool(cuda_config().ENABLE_CUDASIM)


@contextlib.contextmanager
def pretend_device(cc):
    """Compile for compute capability ``cc`` with no GPU: numba-cuda asks the current
    device for the cc of nested device functions (``numba.cuda.dispatcher.get_current_device``),
    and NVRTC for the closest supported arch unless it is forced (``config.FORCE_CUDA_CC``).
    Restored on exit."""
    import numba.cuda.dispatcher
    from numba.cuda import config
    saved = numba.cuda.dispatcher.get_current_device, config.FORCE_CUDA_CC
    numba.cuda.dispatcher.get_current_device = lambda: _pytypes.SimpleNamespace(compute_capability=cc)
    config.FORCE_CUDA_CC = cc
    try:
        yield
    finally:
        numba.cuda.dispatcher.get_current_device, config.FORCE_CUDA_CC = saved


def load_nvvm():
    """Load numba-cuda's libNVVM (``numba.cuda.cudadrv.nvvm.NVVM``); raises where it cannot."""
    from numba.cuda.cudadrv import nvvm
    return nvvm.NVVM()


def stream_type(simulator):
    """The class of numba-cuda's streams: the driver's, or the simulator's."""
    if simulator:
        from numba.cuda.simulator.api import stream as cls  # the simulator's (synchronous) stream
    else:
        from numba.cuda.cudadrv.driver import Stream as cls
    return cls


def simulated_device_array(host):
    """A simulator device array over the host array ``host`` (its memory, not a copy)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray(host)


def register_np_floor():
    """numba-cuda (0.30) types ``np.floor`` on scalars but has no lowering for it
    in its ufunc table (``numba.cuda.ufuncs.ufunc_db``), though ``math.floor``'s
    libdevice one (``__nv_floor[f]``, one ``cvt.rmi`` instruction) is there
    (``numba.cuda.mathimpl.get_unary_impl_for_fn_and_ty``). Register that lowering
    so shared helpers using ``np.floor`` compile for the GPU. No-op if numba-cuda
    already has it; False where numba-cuda has no such table."""
    import math

    import numpy as np
    try:
        from numba.cuda import ufuncs
        from numba.cuda.mathimpl import get_unary_impl_for_fn_and_ty
    except ImportError:
        return False

    def floor_impl(context, builder, sig, args):
        return get_unary_impl_for_fn_and_ty(math.floor, sig.args[0])(context, builder, sig, args)

    db = ufuncs.ufunc_db()
    if np.floor not in db:
        db[np.floor] = {"f->f": floor_impl, "d->d": floor_impl}
    return True


def lock_simulated_shared_arrays():
    """numba-cuda's simulated ``cuda.shared.array`` (``simulator.kernelapi.FakeCUDAShared``)
    looks up the block's array for the calling line in ``_allocations`` and creates it
    when missing, without a lock: two threads of a block can each create their own,
    and then never see each other's writes. Replace it with the same lookup under a
    lock (static arrays only; the dynamic case keeps the original). False where the
    simulator has another layout."""
    import threading

    import numpy as np
    try:
        from numba.cuda.simulator import kernelapi
        shared = kernelapi.FakeCUDAShared
    except (ImportError, AttributeError):
        return False
    if getattr(shared.array, "_numba_ops_locked", False):
        return True
    original = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0 or not hasattr(self, "_allocations"):
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)  # the original's key
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    array._numba_ops_locked = True
    shared.array = array
    return True
