"""numba's and numba-cuda's internals that numba_ops uses (numba_ops/kernels/_compat.py),
one test per internal, each naming it: when a numba release moves one, its test
fails with "numba X.Y changed <internal>" before any user's first call does.

These check the internal itself (that it exists and behaves as used) and cost no
kernel compile; tests/test_opaque.py, test_grid_sample.py, test_warm.py and
test_cuda.py check the behaviour built on them.
"""
import importlib.metadata
import os
import subprocess
import sys
import textwrap
import threading

import llvmlite
import numba
import numpy as np
import pytest
from llvmlite import ir
from numba import njit, types

from numba_ops.kernels import _compat


def changed(internal, dist="numba"):
    version = numba.__version__ if dist == "numba" else (
        llvmlite.__version__ if dist == "llvmlite" else importlib.metadata.version(dist))
    return f"{dist} {version} changed {internal}"


def _builder():
    fn = ir.Function(ir.Module(), ir.FunctionType(ir.VoidType(), []), "f")
    return ir.IRBuilder(fn.append_basic_block())


def _cpu_context():
    from numba.core.registry import cpu_target
    return cpu_target.target_context


# --- code generation -------------------------------------------------------------

def test_code_library_reload_init():
    """``CodeLibrary._reload_init``: a set of callables numba runs before loading a
    cached function's machine code (kernels/cpu/_opaque.py registers callees there)."""
    lib = _cpu_context().codegen().create_library("numba_ops_compat_test")
    assert isinstance(getattr(lib, "_reload_init", None), set), changed("CodeLibrary._reload_init")

    class Context:
        active_code_library = lib

    def hook():
        pass
    _compat.add_reload_init(Context, hook)
    assert hook in lib._reload_init, changed("CodeLibrary._reload_init")


def test_compiled_reload_init_reaches_the_cache():
    """``compiler.compile_result(reload_init=...)``: what a library's ``_reload_init``
    holds is saved with the compile result, to be run on a cache load."""
    from numba.core import compiler
    assert "reload_init" in compiler.CompileResult._fields, changed("CompileResult.reload_init")


def test_irbuilder_insert():
    """llvmlite's ``IRBuilder._insert``: appends an instruction made outside the
    builder (kernels/cpu/_gather.py's vector GEP)."""
    b = _builder()
    assert callable(getattr(b, "_insert", None)), changed("IRBuilder._insert", "llvmlite")
    ptr = ir.Constant(ir.IntType(32).as_pointer(), None)
    instr = ir.instructions.GEPInstr(b.block, ptr, [ir.Constant(ir.IntType(32), 1)], inbounds=False, name="g")
    _compat.insert(b, instr)
    assert b.block.instructions[-1] is instr, changed("IRBuilder._insert", "llvmlite")


def test_no_nrt_option():
    """numba's ``_nrt`` njit option (``NO_NRT``): a function compiled with it counts no
    references to its array arguments (kernels/cpu/grid_sample.py's ``plan``)."""
    @njit(**_compat.NO_NRT)
    def bump(a):
        a[0] += 1.0
        return a[0]

    a = np.zeros(3)
    assert bump(a) == 1.0 and a[0] == 1.0, changed("the _nrt option")
    (ir_text,) = bump.inspect_llvm().values()
    assert "NRT_incref" not in ir_text and "NRT_decref" not in ir_text, changed("the _nrt option")

    @njit
    def counted(a):
        b = a
        a[0] = 1.0
        return b[0] + a.sum()

    counted(np.zeros(3))
    (ir_text,) = counted.inspect_llvm().values()
    assert "NRT_" in ir_text, "the control: a function compiled with numba's runtime refers to it"


def test_shared_helpers_under_the_simulator():
    """The per-element helpers both devices share (``SHARED``) have no Python wrapper,
    except under numba's CUDA simulator, whose CUDA kernels are Python calling them:
    there they keep it and skip the JIT cache, which holds this process's wrapper-less
    compilations (a simulated kernel calling one of those crashed the process). The CPU
    kernels' own functions (``INTERNAL``) stay cached in both, so a simulated run loads
    the CPU kernels this process compiled instead of compiling them again."""
    import numba_ops
    theta = np.array([[[1.0, 0.2, 0.1], [0.0, 0.9, -0.1]]], np.float32)
    numba_ops.affine_grid(theta, [1, 1, 2, 2])
    simulated = _compat.cuda_simulator_enabled()
    assert ("no_cpython_wrapper" in _compat.SHARED) != simulated, "the shared helpers: no wrappers"
    assert "no_cpython_wrapper" in _compat.INTERNAL and _compat.INTERNAL["cache"]
    code = textwrap.dedent("""
        import numpy as np, numba_ops
        from numba_ops.kernels import _compat
        from numba_ops.kernels.cpu import affine_grid
        assert "no_cpython_wrapper" not in _compat.SHARED and "cache" not in _compat.SHARED
        theta = np.array([[[1.0, 0.2, 0.1], [0.0, 0.9, -0.1]]], np.float32)
        grid = numba_ops.affine_grid(theta, [1, 1, 2, 2], device="cuda")  # (its base_coord is SHARED)
        np.testing.assert_array_equal(grid, numba_ops.affine_grid(theta, [1, 1, 2, 2]))
        # the CPU call loaded its kernel (INTERNAL) from the cache the parent process filled
        assert affine_grid._rows.stats.cache_hits, affine_grid._rows.stats
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.returncode, proc.stderr[-3000:])


def test_struct_proxy_getvalue():
    """``cgutils.Structure._getvalue``: the LLVM value of a struct proxy (kernels/cpu/_views.py)."""
    context = _cpu_context()
    aty = types.Array(types.float64, 1, "C")
    proxy = context.make_array(aty)(context, _builder())
    assert callable(getattr(proxy, "_getvalue", None)), changed("cgutils.Structure._getvalue")
    value = _compat.struct_value(proxy)
    assert value.type == context.get_value_type(aty), changed("cgutils.Structure._getvalue")


@pytest.mark.parametrize("name", ["alloca_once_value", "get_item_pointer", "get_or_insert_function", "if_unlikely",
                                  "pack_array", "unpack_tuple"])
def test_cgutils_helpers(name):
    """The ``numba.core.cgutils`` helpers the CPU kernels' intrinsics call."""
    assert callable(getattr(_compat.cgutils, name, None)), changed(f"numba.core.cgutils.{name}")


def test_impl_ret_borrowed():
    """``numba.core.imputils.impl_ret_borrowed(context, builder, type, value)``."""
    import inspect
    params = list(inspect.signature(_compat.impl_ret_borrowed).parameters)
    assert params == ["ctx", "builder", "retty", "ret"], changed("numba.core.imputils.impl_ret_borrowed")


def test_blas_binding():
    """``numba.np.linalg.ensure_blas`` and ``get_blas_kind``: the check that SciPy's
    BLAS is there and the kind letter of its cblas symbols (DeformConv's GEMM)."""
    try:
        ensure_blas, get_blas_kind = _compat.blas()
    except ImportError as exc:
        raise AssertionError(changed("numba.np.linalg.ensure_blas/get_blas_kind")) from exc
    ensure_blas()
    assert (get_blas_kind(types.float32), get_blas_kind(types.float64)) == ("s", "d"), \
        changed("numba.np.linalg.get_blas_kind")


# --- the thread pool ---------------------------------------------------------------

def test_pool_state():
    """``numba.np.ufunc.parallel._is_initialized`` and ``_get_num_threads`` (the pool's
    thread-local count, read without ``get_num_threads``'s lock; kernels/cpu/_runtime.py)."""
    from numba.np.ufunc import parallel
    assert isinstance(getattr(parallel, "_is_initialized", None), bool), changed("parallel._is_initialized")
    n = numba.get_num_threads()  # starts the pool
    assert _compat.pool_started(), changed("parallel._is_initialized")
    assert callable(getattr(parallel, "_get_num_threads", None)), changed("parallel._get_num_threads")
    assert _compat.pool_thread_count() == n, changed("parallel._get_num_threads")
    seen = []
    t = threading.Thread(target=lambda: (numba.set_num_threads(1), seen.append(_compat.pool_thread_count())))
    t.start()
    t.join()
    assert seen == [1], changed("parallel._get_num_threads (per thread)")



def test_set_pool_thread_count():
    """``parallel._set_num_threads``: the pool's per-thread setter (the ONNX session's
    numba_ops nodes run on their own thread count)."""
    from numba.np.ufunc import parallel
    numba.get_num_threads()  # starts the pool
    assert callable(getattr(parallel, "_set_num_threads", None)), changed("parallel._set_num_threads")
    seen = []

    def body():
        _compat.set_pool_thread_count(1)
        seen.append((numba.get_num_threads(), _compat.pool_thread_count()))
    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [(1, 1)], changed("parallel._set_num_threads (per thread)")

# --- dispatchers and the JIT cache -------------------------------------------------

def test_dispatcher_cache_counters():
    """``Dispatcher._cache_misses`` / ``_cache_hits``: Counters per signature; a compile
    counts one miss (numba_ops.warm's compiled/loaded counts)."""
    @njit
    def f(x):
        return x + 1
    assert isinstance(f, _compat.dispatcher_types()), changed("numba.core.dispatcher.Dispatcher")
    assert _compat.cache_counts(f) == (0, 0), changed("Dispatcher._cache_misses/_cache_hits")
    f(1)
    assert _compat.cache_counts(f) == (1, 0), changed("Dispatcher._cache_misses/_cache_hits")


def test_plain_signatures():
    """``Dispatcher.get_call_template(args, kws)`` compiles the signature that jitted
    code's call needs, one per literal value; ``plain_signatures`` hands it the
    arguments' plain types, so calls with other literal values reach one compiled
    signature (``_opaque.inline``'s helpers)."""
    def h(a, flag, s):
        return a * s if flag else a + s

    def caller(hh):
        @njit
        def f(a):
            return hh(a, True, 1) + hh(a, False, 2)
        return f

    literal = njit(h)
    assert caller(literal)(2.0) == 6.0
    assert len(literal.signatures) == 2, changed("Dispatcher.get_call_template (literal arguments)")
    plain = _compat.plain_signatures(njit(h))
    assert caller(plain)(2.0) == 6.0
    assert [tuple(map(str, s)) for s in plain.signatures] == [("float64", "bool", "int64")], \
        changed("Dispatcher.get_call_template (plain_signatures)")


def test_dispatcher_cache_path():
    """``Dispatcher._cache.cache_path``: the folder of a cached function's cache, None
    for an uncached one (``numba-ops info``, numba_ops.warm's stamp)."""
    from numba_ops.kernels.cpu import affine_grid
    cached = [v for v in vars(affine_grid).values()
              if isinstance(v, _compat.dispatcher_types()) and v.py_func.__module__ == affine_grid.__name__]
    assert cached
    paths = {_compat.cache_path(d) for d in cached}
    assert len(paths) == 1 and isinstance(next(iter(paths)), str), changed("Dispatcher._cache.cache_path")

    @njit
    def g(x):
        return x
    assert _compat.cache_path(g) is None, changed("Dispatcher._cache (NullCache.cache_path)")


def test_cpu_magic_tuple():
    """``registry.cpu_target.target_context.codegen().magic_tuple()``: (triple, CPU, features)."""
    magic = _compat.cpu_magic_tuple()
    assert len(magic) == 3 and "-" in magic[0] and all(isinstance(v, str) for v in magic), \
        changed("codegen().magic_tuple()")


def test_compile_event():
    """``numba.core.event``: "numba:compile" starts with the dispatcher in ``ev.data``,
    and what the listener raises aborts the compile (numba_ops.warm's cache probe)."""
    seen = []

    @njit
    def h(x):
        return x * 2
    with _compat.on_compile(seen.append):
        h(2)
    assert seen and seen[0] is h, changed('numba.core.event "numba:compile"')

    class Stop(Exception):
        pass

    def stop(dispatcher):
        raise Stop()

    @njit
    def k(x):
        return x - 1
    with pytest.raises(Stop), _compat.on_compile(stop):
        k(1)


# --- numba-cuda --------------------------------------------------------------------

cuda_dist = "numba-cuda"


@pytest.fixture
def numba_cuda():
    return pytest.importorskip("numba.cuda", reason="numba-cuda is not installed (pip install 'numba_ops[cuda]')")


def test_cuda_config(numba_cuda):
    """numba-cuda's ``config.ENABLE_CUDASIM`` (``numba.cuda.core.config``)."""
    assert isinstance(_compat.cuda_simulator_enabled(), bool), changed("config.ENABLE_CUDASIM", cuda_dist)


def test_pretend_device(numba_cuda):
    """``numba.cuda.dispatcher.get_current_device`` and ``config.FORCE_CUDA_CC``: replaced
    for the block, restored after (compile_ptx for a GPU that is not there)."""
    import numba.cuda.dispatcher as disp
    from numba.cuda import config
    assert hasattr(disp, "get_current_device") and hasattr(config, "FORCE_CUDA_CC"), \
        changed("numba.cuda.dispatcher.get_current_device / config.FORCE_CUDA_CC", cuda_dist)
    before = disp.get_current_device, config.FORCE_CUDA_CC
    with _compat.pretend_device((9, 0)):
        assert disp.get_current_device().compute_capability == (9, 0)
        assert config.FORCE_CUDA_CC == (9, 0)
    assert (disp.get_current_device, config.FORCE_CUDA_CC) == before


def test_nvvm_loader(numba_cuda):
    """``numba.cuda.cudadrv.nvvm.NVVM``: the libNVVM loader."""
    from numba.cuda.cudadrv import nvvm
    assert callable(getattr(nvvm, "NVVM", None)), changed("numba.cuda.cudadrv.nvvm.NVVM", cuda_dist)


def test_stream_types(numba_cuda):
    """``numba.cuda.cudadrv.driver.Stream`` and the simulator's ``simulator.api.stream``."""
    for simulator in (False, True):
        try:
            cls = _compat.stream_type(simulator)
        except ImportError as exc:
            raise AssertionError(changed("the stream classes", cuda_dist)) from exc
        assert isinstance(cls, type)


def test_simulated_device_array(numba_cuda):
    """``simulator.cudadrv.devicearray.FakeCUDAArray(host)``: over the host memory."""
    host = np.arange(3.0)
    arr = _compat.simulated_device_array(host)
    host[0] = 7.0
    assert arr.copy_to_host()[0] == 7.0, changed("simulator FakeCUDAArray", cuda_dist)


def test_np_floor_lowering(numba_cuda):
    """``numba.cuda.ufuncs.ufunc_db`` and ``mathimpl.get_unary_impl_for_fn_and_ty``:
    np.floor's lowering, registered where numba-cuda lacks it."""
    if _compat.cuda_simulator_enabled():
        pytest.skip("the simulator compiles nothing")
    assert _compat.register_np_floor(), changed("numba.cuda.ufuncs.ufunc_db / mathimpl", cuda_dist)
    from numba.cuda import ufuncs
    assert np.floor in ufuncs.ufunc_db(), changed("numba.cuda.ufuncs.ufunc_db", cuda_dist)


def test_simulated_shared_array_lock(numba_cuda, monkeypatch):
    """``simulator.kernelapi.FakeCUDAShared.array`` and its ``_allocations`` (per calling
    line): replaced by the same lookup under a lock."""
    from numba.cuda.simulator import kernelapi
    shared = getattr(kernelapi, "FakeCUDAShared", None)
    assert shared is not None and callable(getattr(shared, "array", None)), \
        changed("simulator FakeCUDAShared.array", cuda_dist)
    monkeypatch.setattr(shared, "array", shared.array)  # restored after the test
    assert _compat.lock_simulated_shared_arrays(), changed("simulator FakeCUDAShared", cuda_dist)
    assert getattr(shared.array, "_numba_ops_locked", False)
    block = shared(0)
    assert isinstance(getattr(block, "_allocations", None), dict), changed("FakeCUDAShared._allocations", cuda_dist)
    arrays = [block.array((4,), np.float32) for _ in range(2)]  # one calling line: one array
    assert arrays[0] is arrays[1] and arrays[0].shape == (4,), changed("FakeCUDAShared.array's keys", cuda_dist)
