"""BLAS for the CPU kernels: a GEMM called from jitted code on strided rows, and the
thread count of SciPy's OpenBLAS held at one while numba's workers call it.

``gemm_tn`` calls numba's own ``numba_xxgemm`` (the entry ``np.dot`` calls, which
reaches SciPy's BLAS): one call per tile, on rows of its operands that lie any
stride apart, so that a share of a reduction axis needs no copy and no reorder.

``ONE_THREAD`` (a context manager) keeps SciPy's OpenBLAS at one thread while
numba_ops' kernels run, so that its pool and numba's never fight over the cores.
"""
import ctypes
import glob
import os
import threading

from numba import types
from numba.extending import intrinsic

from .._compat import blas, cgutils


def _xxgemm(context, builder, dt):
    """numba's ``numba_xxgemm`` (its BLAS entry, numba.np.linalg) declared in the module
    being built, and the BLAS kind letter of float type ``dt`` as a byte: numba's
    internals, kept in this one function."""
    from llvmlite import ir
    ensure_blas, get_blas_kind = blas()
    ensure_blas()
    char, vp = ir.IntType(8), ir.IntType(8).as_pointer()
    ip = context.get_value_type(types.intp)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.IntType(32), [char, char, char, ip, ip, ip, vp, vp, ip, vp, ip, vp, vp, ip]), "numba_xxgemm")
    return fn, ord(get_blas_kind(dt))


def _gemm(trans_a):
    """The codegen of a GEMM intrinsic whose A is transposed (``"t"``) or not (``"n"``)."""

    def gemm(typingctx, a, ao, lda, b, bo, ldb, c, co, ldc, m, n, k):
        if not all(isinstance(t, types.Array) and t.dtype in (types.float32, types.float64) for t in (a, b, c)) \
                or len({a.dtype, b.dtype, c.dtype}) != 1:
            return None
        sig = types.void(a, ao, lda, b, bo, ldb, c, co, ldc, m, n, k)

        def codegen(context, builder, sig, args):
            from llvmlite import ir
            dt = sig.args[0].dtype
            fn, kind = _xxgemm(context, builder, dt)
            char, vp = ir.IntType(8), ir.IntType(8).as_pointer()
            # the integer arguments as intp (an array cast to intp would be numba's size-1
            # array-to-scalar conversion: np.take compiled for nothing, 0.36 s)
            av = [context.cast(builder, v, t, types.intp) if isinstance(t, types.Integer) else None
                  for v, t in zip(args, sig.args)]

            def ptr(i):
                data = context.make_array(sig.args[i])(context, builder, args[i]).data
                return builder.bitcast(builder.gep(data, [av[i + 1]]), vp)
            one = cgutils.alloca_once_value(builder, context.get_constant(dt, 1))
            zero = cgutils.alloca_once_value(builder, context.get_constant(dt, 0))
            # column-major C (m x n) = op(A) B, B stored (k x n) with ldb; A stored (k x m)
            # with lda for "t", (m x k) for "n"
            builder.call(fn, (ir.Constant(char, kind), ir.Constant(char, ord(trans_a)),
                              ir.Constant(char, ord("n")), av[9], av[10], av[11], builder.bitcast(one, vp), ptr(0),
                              av[2], ptr(3), av[5], builder.bitcast(zero, vp), ptr(6), av[8]))
            return context.get_dummy_value()
        return sig, codegen
    gemm.__name__ = gemm.__qualname__ = f"gemm_{trans_a}n"
    return gemm


gemm_tn = intrinsic(_gemm("t"))
gemm_tn.__doc__ = """``c[co + i + j * ldc] = sum_l a[ao + i * lda + l] * b[bo + j * ldb + l]`` for i < m,
j < n, l < k: one BLAS GEMM (numba's own ``numba_xxgemm``, the one ``np.dot`` calls)
on rows of a and b that are any stride apart, so that a share of the reduction
axis (a column range of w's rows) needs no copy. a, b, c: 1-D arrays of one float
type; offsets, leading dimensions and sizes: integers."""

gemm_nn = intrinsic(_gemm("n"))
gemm_nn.__doc__ = """``c[co + i + j * ldc] = sum_l a[ao + i + l * lda] * b[bo + j * ldb + l]``: as
``gemm_tn``, with A's rows (index i) contiguous instead of its reduction axis."""


class BlasThreads:
    """Holds SciPy's OpenBLAS (the BLAS numba's np.dot calls) at one thread while
    numba_ops' kernels call it, from any number of Python threads at once (a count
    of the holders: the first sets 1, the last restores the caller's setting).
    Other BLAS builds are left alone."""

    def __init__(self):
        self._lock = threading.Lock()
        self._get = self._set = None
        self._loaded = False
        self._holders = 0
        self._prev = None

    def _load(self):
        self._loaded = True
        try:
            import scipy
            libdir = os.path.join(os.path.dirname(os.path.dirname(scipy.__file__)), "scipy.libs")
            for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
                lib = ctypes.CDLL(path)
                for prefix in ("scipy_openblas", "openblas"):
                    get = getattr(lib, prefix + "_get_num_threads", None)
                    put = getattr(lib, prefix + "_set_num_threads", None)
                    if get is not None and put is not None:
                        get.restype = ctypes.c_int
                        put.argtypes = [ctypes.c_int]
                        self._get, self._set = get, put
                        return
        except Exception:  # no SciPy OpenBLAS found: nothing to hold
            pass

    def __enter__(self):
        with self._lock:
            if not self._loaded:
                self._load()
            self._holders += 1
            if self._holders == 1 and self._get is not None:
                prev = self._get()
                if prev != 1:
                    self._set(1)
                    self._prev = prev
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._prev is not None:
                self._set(self._prev)
                self._prev = None


#: the process's one holder: ``with ONE_THREAD:`` around a kernel call that reaches BLAS
ONE_THREAD = BlasThreads()
