# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""`optax_accum.distributed`: its argument checks, and the error a stuck peer gives.

The checks run before anything starts, so they are tested in this process
(whose JAX backend is already up). One slow test runs a real two-process job.
"""

import sys
import textwrap

import jax
import pytest

from optax_accum import distributed
from optax_accum.distributed import initialize_distributed, launch_local

ECHO = [sys.executable, "-c", "print(1)"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # Issue 23: 2.0 passed the check and failed inside with a bare TypeError.
        ({"num_processes": 2.0}, TypeError, r"`num_processes`.*2\.0"),
        ({"num_processes": "2"}, TypeError, r"`num_processes`.*'2'"),
        ({"num_processes": True}, TypeError, r"`num_processes`"),
        ({"num_processes": 0}, ValueError, r"`num_processes`.*>= 1.*0"),
        # Issue 23: never checked.
        ({"cpu_devices_per_process": 0}, ValueError, r"`cpu_devices_per_process`.*0"),
        ({"cpu_devices_per_process": 1.5}, TypeError, r"`cpu_devices_per_process`"),
        ({"cpu_devices_per_process": "4"}, TypeError, r"`cpu_devices_per_process`"),
        ({"timeout_s": 0}, ValueError, r"`timeout_s`.*> 0"),
        ({"timeout_s": float("nan")}, ValueError, r"`timeout_s`.*nan"),
        ({"timeout_s": "60"}, TypeError, r"`timeout_s`"),
        ({"grace_s": -1}, ValueError, r"`grace_s`.*>= 0.*-1"),
        ({"argv": []}, ValueError, r"`argv`.*empty"),
        ({"argv": "python train.py"}, TypeError, r"`argv`.*list of strings"),
        ({"argv": [sys.executable, 3]}, TypeError, r"`argv`.*strings"),
        ({"env": {"A": 1}}, TypeError, r"`env`.*strings"),
    ],
)
def test_launch_local_bad_arguments(kwargs, error, match, monkeypatch):
    spawned = []
    monkeypatch.setattr(distributed._Job, "spawn", lambda *a: spawned.append(a))
    monkeypatch.setattr(distributed._Job, "wait", lambda *a: None)
    args = {"argv": ECHO, "num_processes": 2, **kwargs}
    with pytest.raises(error, match=match):
        launch_local(echo=False, **args)
    assert not spawned  # refused before any process starts


def test_launch_local_passes_the_cpu_device_count():
    code = textwrap.dedent("""
        import os
        env = os.environ
        print(env["OPTAX_ACCUM_PROCESS_ID"], env["OPTAX_ACCUM_CPU_DEVICES"])
    """)
    run = launch_local(
        [sys.executable, "-c", code], 2, cpu_devices_per_process=3, echo=False
    )
    assert run.ok, run.report()
    assert [out.split() for out in run.outputs] == [["0", "3"], ["1", "3"]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # Issue 23: None reached int() and failed with int()'s own TypeError.
        ({"failure_timeout_s": None}, TypeError, r"`failure_timeout_s`.*None"),
        ({"failure_timeout_s": 2.5}, TypeError, r"`failure_timeout_s`.*2\.5"),
        ({"failure_timeout_s": True}, TypeError, r"`failure_timeout_s`"),
        ({"failure_timeout_s": 0}, ValueError, r"`failure_timeout_s`.*>= 1.*0"),
        ({"num_processes": 0}, ValueError, r"`num_processes`.*0"),
        ({"num_processes": 2.0}, TypeError, r"`num_processes`"),
        ({"process_id": 2, "num_processes": 2}, ValueError, r"`process_id`.*\[0, "),
        ({"process_id": -1}, ValueError, r"`process_id`.*-1"),
        ({"process_id": "0"}, TypeError, r"`process_id`"),
    ],
)
def test_initialize_distributed_bad_arguments(kwargs, error, match, monkeypatch):
    called = []
    monkeypatch.setattr(distributed.jax.distributed, "initialize", called.append)
    with pytest.raises(error, match=match):
        initialize_distributed(**kwargs)
    assert not called


def test_initialize_distributed_after_a_backend_raises(monkeypatch):
    # Good arguments get as far as that check, and it comes before any setting.
    jax.block_until_ready(jax.numpy.zeros(1))  # this process has a backend
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(distributed.jax.distributed, "initialize", None)
    with pytest.raises(RuntimeError, match="before JAX initialises a backend"):
        initialize_distributed(num_processes=2, process_id=1, failure_timeout_s=5)


_STUCK_PEER = """
import sys, time
from optax_accum.distributed import initialize_distributed
initialize_distributed(failure_timeout_s=3)
import jax, jax.numpy as jnp
from jax.experimental import multihost_utils
multihost_utils.process_allgather(jnp.ones(2))  # both take part
if jax.process_index() == 1:
    time.sleep(20)  # alive, heart-beating, but never joins
    sys.exit(0)
try:
    multihost_utils.process_allgather(jnp.ones(2))
except Exception as e:
    print("CAUGHT", type(e).__name__, str(e).splitlines()[0], flush=True)
"""


@pytest.mark.slow
def test_a_peer_that_never_joins_gives_the_documented_error(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_PEER)
    run = launch_local(
        [sys.executable, str(script)],
        2,
        cpu_devices_per_process=1,
        env={"JAX_PLATFORMS": "cpu"},
        timeout_s=120,
        grace_s=30,
        echo=False,
    )
    caught = [line for line in run.outputs[0].splitlines() if "CAUGHT" in line]
    assert caught, run.report()
    # As initialize_distributed's docstring says: a ValueError, by its message.
    assert caught[0].startswith("CAUGHT ValueError UNKNOWN: Gloo AllGather failed")
    assert "Timed out" in caught[0]
