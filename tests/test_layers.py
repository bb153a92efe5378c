"""The package's layers import downward only; private names stay in their module;
numba's internals are reached through ``kernels/_compat.py`` alone.

Every module's imports are read from its source (``ast``: module-level imports and
the lazy ones inside functions alike), so an import that runs back up a layer
fails here even when no test happens to execute it.

Layers, lowest first (a module may import its own layer and those below):

1. ``kernels``: the kernels and what they share (``numba_ops.kernels``): the shared
   modules (``kernels/_*.py``) below the CPU and CUDA kernels, which do not import
   each other;
2. ``runtime``: the front ends, the dispatcher, the dtype and argument checks, the
   accuracy table, the warm-up, the ONNX and Dask front ends;
3. ``benchmark``: the case table, the harness and the reports (``numba_ops.benchmark``);
4. ``cli``: the ``numba-ops`` command.
"""
import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "numba_ops"

RUNTIME = {"numba_ops", "numba_ops._accuracy", "numba_ops._dispatch", "numba_ops._dtypes", "numba_ops._shapes",
           "numba_ops._validate", "numba_ops._warm", "numba_ops.affine_grid", "numba_ops.affine_warp",
           "numba_ops.deform_conv", "numba_ops.grid_sample", "numba_ops.ms_deform_attn", "numba_ops.onnx",
           "numba_ops.onnx._ort", "numba_ops.onnx._capi", "numba_ops.onnx._specs", "numba_ops.dask",
           "numba_ops.torch"}
#: the ops' front ends (Python API, ONNX, Dask): never the benchmark's case table
FRONT_ENDS = {"numba_ops.affine_grid", "numba_ops.affine_warp", "numba_ops.deform_conv", "numba_ops.grid_sample",
              "numba_ops.ms_deform_attn", "numba_ops.onnx", "numba_ops.onnx._ort", "numba_ops.onnx._capi", "numba_ops.onnx._specs", "numba_ops.dask",
              "numba_ops.torch"}
CASE_TABLE = "numba_ops.benchmark.cases"
CLI = {"numba_ops.cli", "numba_ops.__main__"}
#: the only module that may import numba's internals
COMPAT = "numba_ops.kernels._compat"
#: numba's public modules (numba-cuda's ``numba.cuda`` itself included)
NUMBA_PUBLIC = {"numba", "numba.extending", "numba.types", "numba.typed", "numba.cuda"}

def layer(mod):
    """(rank, sub-layer) of a numba_ops module; KeyError for one no layer names."""
    if mod == "numba_ops.kernels" or mod.startswith("numba_ops.kernels."):
        parts = mod.split(".")
        sub = parts[2] if len(parts) > 2 and parts[2] in ("cpu", "cuda") else "shared"
        return 0, sub
    if mod in RUNTIME:
        return 1, None
    if mod == "numba_ops.benchmark" or mod.startswith("numba_ops.benchmark."):
        return 2, None
    if mod in CLI:
        return 3, None
    raise KeyError(mod)


def module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules():
    return sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


def _path(mod):
    base = ROOT.joinpath(*mod.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def is_module(name):
    """True when ``name`` (dotted) is a module or package of numba_ops."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(mod):
    """``(line, imported module, names or None)`` for every import in ``mod``'s source,
    relative ones resolved; ``names``: what ``from M import ...`` takes."""
    path = _path(mod)
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((node.lineno, target, [a.name for a in node.names]))
    return tree, out


def targets(target, names):
    """The numba_ops modules an import statement loads: ``from P import m`` loads
    ``P.m`` when that is a module, ``P`` otherwise."""
    if names is None:
        return [target]
    subs = [f"{target}.{n}" for n in names if is_module(f"{target}.{n}")]
    return subs if len(subs) == len(names) else [target] + subs


def violations(mod):
    rank, sub = layer(mod)
    tree, found = imports(mod)
    bad = []
    for line, target, names in found:
        where = f"{mod}:{line}"
        if target == "numba" or target.startswith("numba."):
            if mod != COMPAT and target not in NUMBA_PUBLIC:
                bad.append(f"{where} imports numba's internal {target} (only {COMPAT} may)")
            continue
        if not (target == "numba_ops" or target.startswith("numba_ops.")):
            continue
        for t in targets(target, names):
            r, s = layer(t)
            if r > rank:
                bad.append(f"{where} imports {t}: up a layer")
            elif rank == 0 and s != sub and s != "shared":
                bad.append(f"{where} imports {t}: the {sub} kernels import only their own and the shared modules")
            if mod in FRONT_ENDS and t == CASE_TABLE:
                bad.append(f"{where}: a front end imports the case table {t}")
        for n in names or ():
            if n.startswith("_") and not n.startswith("__") and not is_module(f"{target}.{n}"):
                bad.append(f"{where} takes the private name {n} of {target}")
    # a private attribute of another numba_ops module read through the name it is bound to: ``k._name``
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = next(t for ln, t, _ in found if ln == node.lineno)
            for a in node.names:
                if is_module(f"{target}.{a.name}"):
                    bound[a.asname or a.name] = f"{target}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith("numba_ops"):
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and not is_module(f"{bound[node.value.id]}.{node.attr}")):
            bad.append(f"{mod}:{node.lineno} reads the private name {node.attr} of {bound[node.value.id]}")
    return bad


def test_every_module_has_a_layer():
    unplaced = []
    for mod in modules():
        try:
            layer(mod)
        except KeyError:
            unplaced.append(mod)
    assert not unplaced, f"modules no layer names (add them to tests/test_layers.py): {unplaced}"


@pytest.mark.parametrize("mod", modules())
def test_imports_run_downward(mod):
    bad = violations(mod)
    assert not bad, "\n".join(bad)


def test_the_checker_sees_each_kind_of_violation(tmp_path, monkeypatch):
    """The rules fail on what they forbid: a kernel importing the dispatcher (lazily,
    in a function), a front end importing the case table, the runtime importing the
    benchmark, cpu kernels importing cuda ones, a private name taken or read across
    modules, numba's internals outside the compatibility module."""
    sources = {
        "numba_ops.kernels.cpu.affine_grid": "def f():\n    from ..._dispatch import launcher\n",
        "numba_ops.affine_grid": "from .benchmark import cases\n",
        "numba_ops._warm": "def f():\n    import numba_ops.benchmark.harness\n",
        "numba_ops.kernels.cpu.grid_sample": "from ..cuda import grid_sample\n",
        "numba_ops.dask": "from .deform_conv import _helper\nfrom .kernels.cpu import affine_grid as k\nk._parallel\n",
        "numba_ops.kernels.cpu._views": "from numba.core import cgutils\n",
    }
    expect = {
        "numba_ops.kernels.cpu.affine_grid": "up a layer",
        "numba_ops.affine_grid": "case table",
        "numba_ops._warm": "up a layer",
        "numba_ops.kernels.cpu.grid_sample": "only their own",
        "numba_ops.dask": "private name _parallel",
        "numba_ops.kernels.cpu._views": "numba's internal numba.core",
    }
    real = _path

    def fake(mod):
        if mod not in sources:
            return real(mod)
        p = tmp_path / (mod + ".py")
        p.write_text(sources[mod])
        return p

    monkeypatch.setitem(globals(), "_path", fake)
    for mod, text in expect.items():
        found = "\n".join(violations(mod))
        assert text in found, (mod, found)
    assert "private name _helper" in "\n".join(violations("numba_ops.dask"))


def test_modules_resolve():
    """The relative imports resolve the way the checker reads them (a spot check
    against Python's own resolution)."""
    assert importlib.util.resolve_name("..._dtypes", "numba_ops.kernels.cpu") == "numba_ops._dtypes"
    _, found = imports("numba_ops.kernels.cpu._runtime")
    assert (any(t == "numba_ops.kernels._compat" for _, t, _ in found))
