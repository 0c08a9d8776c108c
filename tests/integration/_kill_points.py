# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Runs a script with a pause inside Orbax's deletion of an old checkpoint step.

    python _kill_points.py --pause WHEN [--deletion D] SCRIPT [ARGS...]

runs ``SCRIPT`` as ``__main__`` with Orbax's path deleter wrapped. In the
``D``-th step deletion (default 1) the process prints ``PAUSED_IN_DELETE ...``
to stdout and sleeps at the point ``WHEN`` names, for the test to SIGKILL it
there:

- ``before:N``: before the deletion's ``N``-th filesystem change (an unlink,
  rmdir, rename or replace);
- ``before:last``: before the change that removes or renames the step
  directory itself: a plain deletion has removed everything inside it;
- ``after:last``: right after that change, before Orbax returns.

Nothing is faked: what was deleted before the pause is gone, the rest is there,
as after a kill at that instant. Without ``--pause`` the script runs unchanged.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import threading
import time

_CHANGES = ("unlink", "remove", "rmdir", "rename", "replace")


def install(when: str, deletion: int = 1) -> None:
    """Wraps Orbax's `PathDeleter.delete` and the os calls that change files."""
    from orbax.checkpoint._src.path import deleter

    side, _, at = when.partition(":")
    if side not in ("before", "after") or not (at == "last" or at.isdigit()):
        raise ValueError(f"--pause must be before:N, before:last or after:last: {when}")
    lock = threading.Lock()
    state = {"deletions": 0, "target": None, "changes": 0}

    def pause(what: str) -> None:
        print(f"PAUSED_IN_DELETE {state['target']} {side} {what}", flush=True)
        while True:
            time.sleep(3600)

    def wrap(name: str):
        original = getattr(os, name)

        def wrapped(*args, **kwargs):
            with lock:
                target = state["target"]
                if target is not None:
                    state["changes"] += 1
                    count = state["changes"]
            if target is None:
                return original(*args, **kwargs)
            path = os.fspath(args[0])
            is_step = kwargs.get("dir_fd") is None and os.path.abspath(path) == target
            hit = is_step if at == "last" else count == int(at)
            what = f"{name}({path!r})"
            if hit and side == "before":
                pause(what)
            result = original(*args, **kwargs)
            if hit:
                pause(what)
            return result

        setattr(os, name, wrapped)

    for name in _CHANGES:
        wrap(name)

    delete = deleter.PathDeleter.delete

    def delete_wrapped(self, path, **kwargs):
        with lock:
            state["deletions"] += 1
            mine = state["deletions"] == deletion
            if mine:
                state["target"] = os.path.abspath(os.fspath(path))
        try:
            return delete(self, path, **kwargs)
        finally:
            if mine:
                with lock:
                    state["target"] = None

    deleter.PathDeleter.delete = delete_wrapped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pause")
    p.add_argument("--deletion", type=int, default=1)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    if a.pause is not None:
        install(a.pause, a.deletion)
    sys.argv = [a.script, *a.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(a.script)))
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
