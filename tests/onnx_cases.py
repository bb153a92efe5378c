"""ONNX's backend test cases for one op, generated from onnx.backend.test.case.node
(the wheel ships no data files): each export function runs with ``expect`` captured."""
import importlib

import pytest

onnx = pytest.importorskip("onnx")  # a test dependency ([test] extra); skip only if absent


def backend_cases(module_name):
    """[(name, node, inputs, outputs)] from onnx.backend.test.case.node.<module_name>."""
    mod = importlib.import_module(f"onnx.backend.test.case.node.{module_name}")
    found = []
    real = mod.expect
    mod.expect = lambda node, inputs, outputs, name, **kw: found.append((name, node, inputs, outputs))
    try:
        for obj in vars(mod).values():
            if isinstance(obj, type) and obj.__module__ == mod.__name__:
                for attr in dir(obj):
                    if attr.startswith("export"):
                        getattr(obj, attr)()
    finally:
        mod.expect = real
    return found


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
