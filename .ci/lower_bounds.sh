#!/usr/bin/env bash
# The lower-bound lane: the package and its `dev` extra installed, not
# editable, in a fresh virtual environment with every declared lower bound
# pinned (.ci/lower_bounds.txt, which must equal pyproject.toml's `>=`
# bounds), then a smoke subset of the fast lane run against that install.
#   1. the pins took: each installed version equals its line in the file;
#   2. the installed package is the venv's (site-packages), not the checkout:
#      the tests, README.md and pyproject.toml (pytest's settings) are copied
#      into a temporary folder and pytest runs there, so `tests.helpers`
#      imports and `optax_accum` does not resolve to the checkout;
#   3. the smoke subset, one process (-n 0), `-m "not slow"`, JAX's
#      persistent compilation cache off:
#        - the README's quickstart blocks,
#        - the oracle's fast cells (accumulate, MultiSteps, microbatch, the
#          Flax and pipeline faces, privacy) and its state cells,
#        - the Equinox oracle (equinox's bound),
#        - the Flax train steps (flax's bound),
#        - the privacy accountant and DP accumulation (dp-accounting,
#          jax-privacy),
#        - checkpoint and resume (orbax-checkpoint's bound);
#      and the `examples` extra's libraries import.
# It first checks that each pin equals pyproject.toml's `>=` bound (and
# stops if not).
# Extra arguments go to pytest (e.g. -x, -k EXPR, -v).
# Prints how long each stage took and the total, install included.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
constraints="$repo/.ci/lower_bounds.txt"
python="${PYTHON:-python3}"

stage_start=$SECONDS
stage() {
    local now=$SECONDS
    if [[ -n "${stage_name:-}" ]]; then
        echo "=== lower bounds: ${stage_name}: $((now - stage_start)) s"
    fi
    stage_name=$1
    stage_start=$now
    [[ -n "$stage_name" ]] && echo "=== lower bounds: ${stage_name} ..."
    return 0
}

stage "the pins equal pyproject.toml's lower bounds"
"$python" - "$repo/pyproject.toml" "$constraints" <<'PY'
# Every `name==X` in the constraints file is `name>=X` wherever pyproject.toml
# names that package (jaxlib: jax's version); no package is pinned that
# pyproject.toml does not name.
import re
import sys
import tomllib


def key(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def release(v):
    parts = [int(p) for p in v.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


project = tomllib.load(open(sys.argv[1], "rb"))["project"]
requirements = list(project["dependencies"])
for extra in project["optional-dependencies"].values():
    requirements += extra
floors = {}
for r in requirements:
    m = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*>=\s*([0-9.]+)", r)
    if m:
        floors.setdefault(key(m[1]), set()).add(m[2])
pins = {}
for line in open(sys.argv[2], encoding="utf-8"):
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
        pins[key(name)] = version
wrong = []
for name, pinned in pins.items():
    declared_as = "jax" if name == "jaxlib" else name
    declared = floors.get(declared_as)
    if not declared:
        wrong.append(f"{name}=={pinned}: pyproject.toml declares no `>=` bound")
    for floor in declared or ():
        if release(floor) != release(pinned):
            wrong.append(
                f"{name}=={pinned}: pyproject.toml says {declared_as}>={floor}"
            )
if wrong:
    sys.exit("the lower-bound pins and pyproject.toml disagree (change them "
             "together):\n  " + "\n  ".join(wrong))
print(len(pins), "pins, each equal to pyproject.toml's lower bound")
PY

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

stage "install (fresh venv, pip -c .ci/lower_bounds.txt '.[dev]')"
"$python" -m venv "$work/venv"
py="$work/venv/bin/python"
install() {  # quiet, but the whole log when it fails
    "$py" -m pip install --disable-pip-version-check "$@" > "$work/pip.log" 2>&1 \
        || { cat "$work/pip.log"; exit 1; }
}
install --upgrade pip
install -c "$constraints" "$repo[dev]"
"$py" -m pip check
"$py" -m pip list --disable-pip-version-check 2>/dev/null \
    | grep -iE "jax|optax|flax|orbax|chex|privacy|accounting|equinox|numpy"
"$py" - "$constraints" <<'PY'
import re
import sys
from importlib.metadata import version

wrong = []
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, pinned = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
    if version(name) != pinned:
        wrong.append(f"{name}: installed {version(name)}, pinned {pinned}")
if wrong:
    sys.exit("the lower-bound pins did not take:\n  " + "\n  ".join(wrong))
print("every pin in", sys.argv[1], "is installed")
PY
# The `examples` extra's libraries load (the smoke subset does not run them).
"$py" -c "import jmp, matplotlib, sklearn.linear_model, tqdm, orbax.checkpoint
matplotlib.use('Agg')
import matplotlib.pyplot
print('examples extra: imports')"

stage "smoke subset (pytest -n 0 -m 'not slow', the installed package)"
mkdir "$work/src"
cp -r "$repo/tests" "$repo/README.md" "$repo/pyproject.toml" "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
cd "$work/src"
"$py" - "$repo" <<'PY'
import pathlib
import sys

import optax_accum

where = pathlib.Path(optax_accum.__file__).resolve()
repo = pathlib.Path(sys.argv[1]).resolve()
assert repo not in where.parents, f"imported the checkout, not the install: {where}"
assert "site-packages" in where.parts, where
print("optax_accum", optax_accum.__version__, "from", where.parent)
PY
OPTAX_ACCUM_TEST_CACHE=off "$py" -m pytest -n 0 -p no:cacheprovider -m "not slow" \
    tests/test_readme.py::test_python_block_runs \
    tests/oracle/test_oracle.py \
    tests/oracle/test_state_cells.py \
    tests/oracle/test_equinox.py \
    tests/flax/test_steps.py \
    tests/privacy/test_accounting.py \
    tests/privacy/test_dp_accumulate.py \
    tests/test_checkpoint.py \
    "$@"

cd "$repo"
stage "clean up"
rm -rf "$work"
stage ""
echo "=== lower bounds: total: ${SECONDS} s"
