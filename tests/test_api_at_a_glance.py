# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""API.md, the API at a glance, lists every public name (issue 33, §4).

Every wing's ``__all__`` is found by walking the package, so a new wing's
names are required too; API.md must be what ``docs/_ext/api_at_a_glance.py``
writes (rerun it: ``python docs/_ext/api_at_a_glance.py > API.md``).
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import api_at_a_glance as glance  # noqa: E402

TABLE = (ROOT / "API.md").read_text()
RERUN = "rerun `python docs/_ext/api_at_a_glance.py > API.md`"


def test_every_public_name_of_every_wing_has_a_row():
    wings = {module.__name__ for module in glance.wings()}
    assert {"optax_accum", "optax_accum.flax", "optax_accum.pipeline"} <= wings
    assert "optax_accum.distributed" in wings
    missing = [
        f"{module.__name__}.{name}"
        for module in glance.wings()
        for name in module.__all__
        if f"| `{module.__name__}.{name}` |" not in TABLE
    ]
    assert not missing, f"API.md lacks {missing}: {RERUN}"
    rows = re.findall(r"^\| `([\w.]+)` \|", TABLE, re.MULTILINE)
    assert len(rows) == len(set(rows)) == sum(len(m.__all__) for m in glance.wings())


def test_api_md_is_what_the_script_writes():
    assert glance.render() == TABLE, RERUN


def test_each_guide_link_names_its_row():
    for qualified, _, _, guide in glance.rows():
        name = qualified.rsplit(".", 1)[1]
        if guide is not None:
            assert name in (glance.GUIDES / f"{guide}.md").read_text(), qualified


def test_the_readme_links_it_and_it_has_the_choosing_rule():
    assert "(API.md)" in (ROOT / "README.md").read_text()
    assert "**Which fused face?**" in TABLE
