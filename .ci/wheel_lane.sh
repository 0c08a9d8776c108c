#!/usr/bin/env bash
# The install a user meets: the built wheel (not an editable checkout) in a
# fresh virtual environment with the `examples` extra, used from a folder
# outside the checkout. Run by .ci/run after `python -m build`; takes the
# wheel in dist/.
#   1. the installed package is the wheel's (not the checkout's), at the
#      version the wheel was built with;
#   2. every public module imports;
#   3. `python -m optax_accum demo` (exits 1 if accumulation is not exact);
#   4. the README's quickstarts, each pasted into a fresh interpreter.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
wheels=("$repo"/dist/optax_accum-*-py3-none-any.whl)
wheel="${wheels[0]}"
[[ -f "$wheel" ]] || { echo "no wheel in $repo/dist: build it first" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
py="$work/venv/bin/python"
install() {  # quiet, but the whole log when it fails
    "$py" -m pip install "$@" > "$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
}
install --upgrade pip
install "${wheel}[examples]"
cd "$work"  # outside the checkout: nothing of it is importable from here
mkdir user && cd user
"$py" - "$repo" "$wheel" <<'PY'
import importlib
import pathlib
import sys

repo, wheel = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
import optax_accum

where = pathlib.Path(optax_accum.__file__).resolve()
assert repo not in where.parents, f"imported the checkout, not the wheel: {where}"
assert "site-packages" in where.parts, where
version = wheel.name.split("-")[1]
assert optax_accum.__version__ == version, (optax_accum.__version__, version)
for name in ("optax_accum", "optax_accum.pipeline", "optax_accum.privacy",
             "optax_accum.flax", "optax_accum.distributed"):
    module = importlib.import_module(name)
    for public in getattr(module, "__all__", []):
        getattr(module, public)
    print("imported", name, len(getattr(module, "__all__", [])), "public names")
print("optax_accum", optax_accum.__version__, "from", where.parent)
PY
"$py" -m optax_accum demo --out demo --no-progress
# The pipeline quickstart takes 4 devices: on a CPU, as the README says.
XLA_FLAGS=--xla_force_host_platform_device_count=4 \
    "$py" "$repo/.ci/readme_blocks.py" "$repo/README.md"
echo "wheel lane: passed"
