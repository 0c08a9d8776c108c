# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Sphinx configuration of the optax_accum docs.

Build (warnings are errors, as on CI and Read the Docs):

    sphinx-build -W --keep-going -b html docs docs/_build/html

The API pages, the notebook pages and the benchmark results are generated at
the start of each build by ``_ext/optax_accum_docs.py``. The notebooks are
rendered from the copies that the notebook tests executed, where those are up
to date (``_ext/executed_notebooks.py``), and executed here otherwise.
No inventory is fetched over the network (no intersphinx): the build runs
offline.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import optax_accum

project = "optax_accum"
author = "The optax_accum Authors"
copyright = "2026, The optax_accum Authors"
release = optax_accum.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_nb",
    "optax_accum_docs",
]

exclude_patterns = [
    "_build",
    "_benchmark_results.md",  # generated, and included by benchmarks.md
    "_templates",
    "_ext",
]
templates_path = ["_templates"]
# `name` in a docstring links to that object where it is documented.
default_role = "py:obj"
# The results tables of benchmarks/ are included as they are written, and
# jump heading levels (## to ####).
suppress_warnings = ["myst.header"]

# autodoc, autosummary, napoleon: Google-style docstrings.
autosummary_generate = True
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_include_init_with_doc = False

# MyST and myst-nb.
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "force"  # `optax_accum_docs` excludes the executed copies
nb_execution_timeout = 300  # per cell, as in tests/test_notebooks.py
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_in_temp = True  # notebooks must not write next to themselves
nb_merge_streams = True

html_theme = "sphinx_book_theme"
html_title = "optax_accum"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
}
