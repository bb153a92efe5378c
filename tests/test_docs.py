"""The documentation's code runs: the public modules' docstring examples (doctest)
and every script in examples/ (each in a fresh process, as a user runs it).

Examples that need what this machine may lack (torch, CuPy, a GPU) exit 0 with a
"skipped: ..." line there; the test then checks that line instead of the output.
"""
import doctest
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))

#: modules whose docstrings hold the examples of the public API
DOC_MODULES = ["numba_ops", "numba_ops.affine_grid", "numba_ops.deform_conv", "numba_ops.grid_sample",
               "numba_ops.affine_warp", "numba_ops.ms_deform_attn", "numba_ops._dispatch", "numba_ops._warm",
               "numba_ops.dask", "numba_ops.torch"]

#: small arguments, so that the scripts stay quick (their defaults are a user's)
EXAMPLE_ARGS = {"augment_batch.py": ["--n", "3", "--size", "32"],
                "dask_volume.py": ["--n", "2", "--size", "8", "--chunk", "1"],
                "deformable_detr_encoder.py": ["--steps", "20", "--repeat", "3"],
                "register_volumes.py": ["--size", "24"],
                "train_deformable_3d.py": ["--steps", "20", "--size", "10"]}


# (warm's example finds its second warm-up up to date: a cache that another process
# writes to meanwhile is not, so it runs alone in CI's parallel passes)
@pytest.mark.parametrize("name", [pytest.param(m, marks=pytest.mark.serial) if m == "numba_ops._warm" else m
                                  for m in DOC_MODULES])
def test_docstring_examples(name):
    if name == "numba_ops.dask":
        pytest.importorskip("dask.array")
    if name == "numba_ops.torch":
        pytest.importorskip("torch")
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} has no docstring examples"
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (see stdout)"


def test_every_public_function_has_an_example():
    import numba_ops
    nd = pytest.importorskip("numba_ops.dask")
    public = [getattr(numba_ops, n) for n in numba_ops.__all__ if n != "__version__"]
    public += [getattr(nd, n) for n in nd.__all__]
    missing = [f"{f.__module__}.{f.__name__}" for f in public if ">>>" not in (f.__doc__ or "")]
    assert not missing, missing


#: the examples that do real work (seconds each: LocalClusters, ONNX exports, training) run
#: in the full pass (``--full``, which CI runs); the others also by default
_HEAVY = {"augment_batch.py", "dask_volume.py", "deformable_detr_encoder.py", "onnx_deformable_layer.py",
          "register_volumes.py", "train_deformable_3d.py"}


@pytest.mark.parametrize("script", [pytest.param(p, marks=pytest.mark.full) if p.name in _HEAVY else p
                                    for p in EXAMPLES], ids=[p.name for p in EXAMPLES])
def test_example_runs(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg")
    args = list(EXAMPLE_ARGS.get(script.name, []))
    if script.name == "augment_batch.py":
        args += ["--out", str(tmp_path / "augment.png")]
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.strip(), f"{script.name} printed nothing"
    if script.name == "augment_batch.py":
        assert (tmp_path / "augment.png").stat().st_size > 0
    elif not proc.stdout.startswith("skipped:"):
        assert "max |" in proc.stdout, out  # the scripts that compare print their error
