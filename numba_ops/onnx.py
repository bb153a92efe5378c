"""numba_ops kernels as operators of ONNX's reference evaluator.

``AffineGrid`` and ``DeformConv`` are ``onnx.reference.op_run.OpRun`` subclasses
in the default domain, so they replace the built-in implementations::

    from onnx.reference import ReferenceEvaluator
    from numba_ops.onnx import AffineGrid, DeformConv

    sess = ReferenceEvaluator(model, new_ops=[AffineGrid, DeformConv])
    y, = sess.run(None, feeds)

Attributes are read from the node, with ONNX's defaults where the node leaves
one out (``align_corners=0``; ``group=1``, ``offset_group=1``, and strides,
pads, dilations, kernel_shape from the inputs' shapes). Optional inputs (``B``,
``mask``) may be absent or given the empty name.

Device: the class attribute ``device`` (``None``: follow the inputs, i.e. the
CPU for NumPy inputs; ``"cpu"``; ``"cuda"``). ``ops(device)`` returns the pair
bound to one device, for example::

    ReferenceEvaluator(model, new_ops=numba_ops.onnx.ops("cuda"))

A model's local functions (``ModelProto.functions``) are a gap in onnx: the
evaluator runs their bodies without ``new_ops``, so an op inside one runs on
onnx's own implementation. ``evaluator(model, device)`` closes it: a
``ReferenceEvaluator`` whose functions run on these ops too.

This module needs onnx (``pip install numba_ops[onnx]``); ``import numba_ops``
does not import it.
"""
import numpy as np
from onnx.reference.op_run import OpRun

from ._dispatch import check_device
from .affine_grid import affine_grid
from .deform_conv import deform_conv

__all__ = ["AffineGrid", "DeformConv", "evaluator", "ops"]


def _host(a):
    """The reference evaluator works on NumPy arrays: bring a device result home."""
    return a.copy_to_host() if hasattr(a, "copy_to_host") else np.asarray(a)


class _Carried(Exception):
    """Carries our TypeError through ``OpRun.run``, which would re-wrap it in a message
    of its own ("Issues with types ...") that says neither the input nor what was expected."""


class _Op(OpRun):
    op_domain = ""
    device = None

    def run(self, *args, **kwargs):
        try:
            return super().run(*args, **kwargs)
        except _Carried as carried:
            raise carried.args[0] from None

    def _call(self, fn, *args, **kwargs):
        """``fn`` on this class's device, its result on the host, a TypeError carried."""
        try:
            return (_host(fn(*args, device=self.device, **kwargs)),)
        except TypeError as exc:
            raise _Carried(exc) from None


class AffineGrid(_Op):
    """ONNX AffineGrid (opset 20) on numba_ops' kernels."""

    def _run(self, theta, size, align_corners=None):
        return self._call(affine_grid, theta, np.asarray(size).tolist(),
                          align_corners=0 if align_corners is None else align_corners)


class DeformConv(_Op):
    """ONNX DeformConv (opset 19 and 22) on numba_ops' kernels."""

    def _run(self, X, W, offset, B=None, mask=None, dilations=None, group=None, kernel_shape=None,
             offset_group=None, pads=None, strides=None):
        return self._call(deform_conv, X, W, offset, B, mask, kernel_shape=kernel_shape, strides=strides,
                          pads=pads, dilations=dilations, group=1 if group is None else group,
                          offset_group=1 if offset_group is None else offset_group)


def ops(device=None):
    """``[AffineGrid, DeformConv]`` bound to ``device`` (None, "cpu" or "cuda"), for ``new_ops``.

    The classes keep their ONNX names, which is how the evaluator matches them to nodes.
    """
    if check_device(device) is None:
        return [AffineGrid, DeformConv]
    return [type(cls.__name__, (cls,), {"device": device, "__module__": __name__})
            for cls in (AffineGrid, DeformConv)]


def evaluator(model, device=None, new_ops=(), **kwargs):
    """``ReferenceEvaluator(model, new_ops=ops(device))``, with the model's local
    functions also run on numba_ops' kernels (onnx evaluates function bodies
    without ``new_ops``). ``new_ops``: more operator classes, used before ours (an
    evaluator takes the first class of a name). ``kwargs`` go to every evaluator
    (``verbose``...)."""
    from onnx import ModelProto
    from onnx.reference import ReferenceEvaluator

    new = list(new_ops or ()) + ops(device)
    if not isinstance(model, ModelProto) or not model.functions:
        return ReferenceEvaluator(model, new_ops=new, **kwargs)
    funcs = []
    for f in model.functions:  # in order: a function may call the ones before it
        funcs.append(ReferenceEvaluator(f, new_ops=new, functions=list(funcs), **kwargs))
    return ReferenceEvaluator(model.graph, opsets={d.domain: d.version for d in model.opset_import},
                              functions=funcs, new_ops=new, **kwargs)
