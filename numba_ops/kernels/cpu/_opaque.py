"""Calls between compiled CPU kernels that do not copy the callee's code (compile time).

numba compiles a call from one jitted function to another by linking the callee's
whole LLVM module, with every function it calls in turn, into the caller's, and then
optimises and compiles that module again: each level of calls pays again for all the
code below it (the DeformConv tile, ~5 s to compile, was compiled once for the tile,
again in the serial entry and again in the parallel one's loop body).

``opaque(dispatcher)`` makes a function (an intrinsic) that calls ``dispatcher``'s
own compiled code through its native symbol instead: the caller declares the symbol
and calls it with numba's calling convention, as numba calls a linked function, so
arguments, return values and raised exceptions behave the same; LLVM only cannot
inline the callee into the caller, which costs nothing for calls that each do a
tile's worth of work. The arguments' literal types are dropped (a literal ``0``
and an int64 reach the same compiled callee).

The symbol has a name that is the same in every process (``_publish``: the callee's
module, name and signature, hashed), registered with LLVM's process symbol table
(``llvmlite.binding.add_symbol``) when the caller is compiled, and again, through
numba's ``reload_init`` hook, before a caller's cached code is loaded from numba's
on-disk cache: the callee is compiled or loaded from the cache first, so the caller's
cached machine code always finds it.

``INTERNAL`` (``kernels/_compat.py``): the ``njit`` options of functions that only
jitted code calls (the opaque callees and the hot loops they call), compiled without
numba's Python and C wrappers; ``INLINE``: those of the per-element helpers, the same
and inlined by LLVM; ``@inline``: such a helper, compiled once per plain signature
(numba compiles a function again for each literal value a caller passes: a stride
``1``, a flag ``True``; LLVM folds the constant where it inlines the helper anyway).
"""
import functools
import hashlib
import importlib

from llvmlite import binding as ll
from numba import njit, types
from numba.extending import intrinsic

from .._compat import INTERNAL, add_reload_init, cgutils, plain_signatures

#: the ``njit`` options of the per-element helpers that the kernels' loops call: compiled
#: once per signature without wrappers (``INTERNAL``), and inlined by LLVM at each call
INLINE = dict(INTERNAL, forceinline=True)


def inline(fn=None, **options):
    """``@njit(**INLINE, **options)`` for a per-element helper (``INLINE``), compiled
    once per plain signature (``_compat.plain_signatures``: numba would compile it again
    for each literal value a caller passes; LLVM, which inlines the helper, still folds
    the constant at each call)."""
    def wrap(f):
        return plain_signatures(njit(**INLINE, **options)(f))
    return wrap(fn) if fn is not None else wrap


def _publish(dispatcher, args):
    """Compile (or load from the cache) ``dispatcher`` for the argument types ``args``
    and register its native entry under its stable name; ``(name, fndesc)``."""
    dispatcher.compile(args)
    cres = dispatcher.overloads[args]
    key = "%s.%s%s" % (dispatcher.py_func.__module__, dispatcher.py_func.__qualname__, args)
    name = "numba_ops.opaque." + hashlib.sha1(key.encode()).hexdigest()
    ll.add_symbol(name, cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name))
    return name, cres.fndesc


def _reload(module, qualname, args):
    """numba's ``reload_init`` for a cached caller: publish the callee first."""
    _publish(getattr(importlib.import_module(module), qualname), args)


def _returnable(t):
    """Whether values of type ``t`` hold no reference (None, scalars, tuples of them):
    what an opaque call may return."""
    if isinstance(t, types.BaseTuple):
        return all(isinstance(e, (types.Number, types.Boolean)) for e in t)
    return isinstance(t, (types.NoneType, types.Number, types.Boolean))


def opaque(dispatcher, failed=False):
    """A jitted-code function ``f(*args)`` that calls ``dispatcher(*args)`` through
    the callee's own compiled code (see the module's docstring). With ``failed``, the
    callee returns nothing and ``f`` returns whether it raised, instead of raising in
    turn: what a C callback needs, without a ``try`` block (numba's exception
    handling made a two-line callback take 0.4 s to compile, 0.04 s without it). The
    exception itself is dropped."""

    @intrinsic
    def call(typingctx, *args):
        args = tuple(types.unliteral(a) for a in args)
        name, fndesc = _publish(dispatcher, args)
        if not _returnable(fndesc.restype):
            raise TypeError("opaque calls return None, a scalar or a tuple of scalars, not %s" % fndesc.restype)
        if failed and fndesc.restype != types.none:
            raise TypeError("opaque(..., failed=True) calls return None, not %s" % fndesc.restype)
        reload = functools.partial(_reload, dispatcher.py_func.__module__, dispatcher.py_func.__qualname__, args)

        def codegen(context, builder, sig, llargs):
            add_reload_init(context, reload)
            vals = cgutils.unpack_tuple(builder, llargs[0], len(args))
            fnty = context.call_conv.get_function_type(fndesc.restype, fndesc.argtypes)
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            context.call_conv.decorate_function(fn, fndesc.args, fndesc.argtypes, noalias=fndesc.noalias)
            status, res = context.call_conv.call_function(builder, fn, fndesc.restype, fndesc.argtypes, vals)
            if failed:
                return status.is_error
            with cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return res
        restype = types.boolean if failed else fndesc.restype
        return restype(types.StarArgTuple.from_types(args)), codegen

    return call
