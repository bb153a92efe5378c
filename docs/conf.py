"""Sphinx configuration: the user guide, the API reference (from the numpydoc
docstrings), performance, design and contributing pages. Build with
``tox -e docs`` (warnings are errors)."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # document this checkout, not an installed copy

import numba_ops  # noqa: E402

project = "numba_ops"
author = "The numba_ops developers"
copyright = "2026, The numba_ops developers"
release = numba_ops.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "numpydoc",
]
autosummary_generate = False
autodoc_typehints = "none"  # the numpydoc sections state the types
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
intersphinx_mapping = {}  # offline builds: no inventories fetched

exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_theme_options = {"description": "ONNX spatial ops as Numba kernels", "fixed_sidebar": True}
