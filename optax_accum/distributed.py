# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""``optax_accum.distributed``: start a multi-process JAX job that fails fast.

Not imported by ``import optax_accum``: ``import optax_accum.distributed``.
This module owns `initialize_distributed`, which starts `jax.distributed` so
that a dead or stuck peer makes every other process fail within a bounded
time instead of hanging, and `launch_local`, which runs N copies of a script
as the processes of one JAX job on this machine (loopback, CPU devices).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

from . import _checks

__all__ = ["LocalRun", "initialize_distributed", "launch_local"]

# What `launch_local` tells each process; `initialize_distributed` reads them.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # also read by jax itself
ENV_NUM_PROCESSES = "OPTAX_ACCUM_NUM_PROCESSES"
ENV_PROCESS_ID = "OPTAX_ACCUM_PROCESS_ID"
ENV_CPU_DEVICES = "OPTAX_ACCUM_CPU_DEVICES"

# XLA:CPU collective timeouts. Without them a process waiting in a gloo
# all-reduce for a peer that is alive but never joins waits for ever (the
# peer keeps heart-beating, so the coordination service sees nothing wrong).
_CPU_TIMEOUT_FLAGS = (
    "--xla_cpu_collective_timeout_seconds",
    "--xla_cpu_collective_call_terminate_timeout_seconds",
)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value in (None, "") else int(value)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    failure_timeout_s: int = 300,
    **kwargs: Any,
) -> None:
    """Calls `jax.distributed.initialize` with a bounded failure time.

    With the defaults of `jax.distributed.initialize`, a process whose peer
    hangs without dying can wait in a CPU collective for ever. This sets, to
    ``failure_timeout_s``:

    - ``heartbeat_timeout_seconds``: a peer that dies or freezes (no
      heartbeats) makes every other process abort, with "Terminating process
      because the JAX distributed service detected fatal errors";
    - ``shutdown_timeout_seconds``: how long a failing process waits for the
      others at exit;
    - the XLA:CPU collective timeouts (in ``XLA_FLAGS``, unless already set
      there): a gloo collective that a live peer never joins fails where its
      result is waited for or read (``jax.block_until_ready``, ``float``,
      ``np.asarray``, ``process_allgather``). In jax 0.10.2 that error is a
      ``ValueError`` (not ``jax.errors.JaxRuntimeError``) whose message reads
      "UNKNOWN: Gloo all-reduce failed: ... Timed out" ("Gloo AllGather
      failed" for ``process_allgather``): match the message, not the type.
      The process then aborts at exit, as its peer missed the shutdown
      barrier.

    A peer whose process is gone closes its sockets, so a gloo collective
    often fails at once ("Connection closed by peer"); where it waits
    instead, the heartbeat timeout ends the job. ``failure_timeout_s`` must
    exceed the longest time one process may legitimately wait in a collective
    for another: a slower compile, a checkpoint, data loading.

    Arguments left as ``None`` are read from the variables that `launch_local`
    sets, and otherwise auto-detected by JAX (Cloud TPU, SLURM, Open MPI,
    Kubernetes). Under `launch_local` this also sets ``jax_num_cpu_devices``.
    Call it before anything touches a JAX backend.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: the number of processes in the job.
      process_id: this process's index, in ``[0, num_processes)``.
      failure_timeout_s: seconds after which a dead or stuck peer makes the
        other processes fail.
      **kwargs: passed to `jax.distributed.initialize`, e.g.
        ``initialization_timeout`` or ``local_device_ids``.

    Raises:
      RuntimeError: if a JAX backend is already initialised.
      TypeError: for a ``failure_timeout_s``, ``num_processes`` or
        ``process_id`` that is not an integer.
      ValueError: for a ``failure_timeout_s`` or ``num_processes`` below 1,
        or a ``process_id`` outside ``[0, num_processes)``.

    Examples:
      At the top of a training script, before any JAX array exists (not run
      here: it starts the distributed runtime):

      >>> from optax_accum.distributed import initialize_distributed
      >>> initialize_distributed(failure_timeout_s=60)  # doctest: +SKIP
    """
    from jax._src import xla_bridge

    timeout = _checks.positive_int(failure_timeout_s, "failure_timeout_s")
    _check_place(num_processes, process_id)
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "`initialize_distributed` must run before JAX initialises a backend "
            "(before any array is created or any `jax.devices()` call)."
        )
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    cpu_devices = _env_int(ENV_CPU_DEVICES)
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)

    flags = os.environ.get("XLA_FLAGS", "")
    extra = [f"{f}={timeout}" for f in _CPU_TIMEOUT_FLAGS if f not in flags]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()

    kwargs.setdefault("heartbeat_timeout_seconds", timeout)
    kwargs.setdefault("shutdown_timeout_seconds", timeout)
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)


def _check_place(num_processes: Any, process_id: Any) -> None:
    """``num_processes`` >= 1 and ``process_id`` in range, where given."""
    if num_processes is not None:
        num_processes = _checks.positive_int(num_processes, "num_processes")
    if process_id is None:
        return
    if isinstance(process_id, bool) or not isinstance(process_id, int):
        raise TypeError(f"`process_id` must be an integer, got {process_id!r}.")
    if process_id < 0 or (num_processes is not None and process_id >= num_processes):
        raise ValueError(
            f"`process_id` must be in [0, num_processes={num_processes}), got "
            f"{process_id}."
        )


def _seconds(value: Any, name: str, *, zero_ok: bool) -> float:
    """A finite number of seconds, > 0 (>= 0 with ``zero_ok``)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`{name}` must be a number of seconds, got {value!r}.")
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value > 0)):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"`{name}` must be finite and {bound}, got {value!r}.")
    return float(value)


class LocalRun(NamedTuple):
    """What `launch_local` returns.

    Attributes:
      returncodes: each process's exit status (negative: killed by that
        signal), in process order.
      outputs: each process's stdout and stderr, interleaved.
      exit_times: seconds from the launch to each process's exit.
      killed: the processes that `launch_local` had to kill.
    """

    returncodes: list[int]
    outputs: list[str]
    exit_times: list[float]
    killed: list[int]

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    def report(self) -> str:
        """Every process's status and output, for an error message."""
        parts = []
        for i, (rc, out) in enumerate(zip(self.returncodes, self.outputs, strict=True)):
            how = "killed by the launcher" if i in self.killed else f"exit status {rc}"
            parts.append(f"----- process {i}: {how} -----\n{out}")
        return "\n".join(parts)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (another program may take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(
    argv: Sequence[str],
    num_processes: int,
    *,
    cpu_devices_per_process: int | None = None,
    timeout_s: float = 600.0,
    grace_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    echo: bool = True,
) -> LocalRun:
    """Runs ``num_processes`` copies of a command as one JAX job on this host.

    Each copy is told its place through environment variables that
    `initialize_distributed` reads: a coordinator on a free loopback port, the
    number of processes and its index (and, with ``cpu_devices_per_process``,
    how many CPU devices to create). The launcher waits for all of them. Once
    one fails, the others get ``grace_s`` seconds to fail on their own (which
    `initialize_distributed`'s timeouts guarantee); then they, and anything
    still running at ``timeout_s``, are killed with SIGKILL (JAX catches
    SIGTERM for its preemption service), so no process outlives the call.

    Args:
      argv: the command, e.g. ``[sys.executable, "train.py", "--steps", "8"]``.
      num_processes: how many processes, >= 1.
      cpu_devices_per_process: CPU devices per process, or ``None`` to keep
        JAX's default.
      timeout_s: limit for the whole job, in seconds.
      grace_s: how long the others may run on after one process failed.
      env: extra environment variables for every process.
      echo: print each line of output as it arrives, prefixed with ``[i]``.

    Returns:
      A `LocalRun`.

    Raises:
      TypeError: for a ``num_processes`` or ``cpu_devices_per_process`` that
        is not an integer, a ``timeout_s`` or ``grace_s`` that is not a
        number, an ``argv`` that is a string or holds a non-string, or an
        ``env`` with a non-string key or value.
      ValueError: for ``num_processes`` or ``cpu_devices_per_process`` < 1,
        ``timeout_s`` <= 0, ``grace_s`` < 0 (or either not finite), or an
        empty ``argv``.

    Examples:
      >>> import sys
      >>> from optax_accum.distributed import launch_local
      >>> code = "import os; print(os.environ['OPTAX_ACCUM_PROCESS_ID'])"
      >>> run = launch_local([sys.executable, "-c", code], 2, echo=False)
      >>> run.ok, [out.strip() for out in run.outputs]
      (True, ['0', '1'])
    """
    num_processes = _checks.positive_int(num_processes, "num_processes")
    if cpu_devices_per_process is not None:
        cpu_devices_per_process = _checks.positive_int(
            cpu_devices_per_process, "cpu_devices_per_process"
        )
    timeout_s = _seconds(timeout_s, "timeout_s", zero_ok=False)
    grace_s = _seconds(grace_s, "grace_s", zero_ok=True)
    _check_command(argv, env)
    job = _Job(num_processes, echo)
    try:
        for i in range(num_processes):
            job.spawn(
                argv, i, _child_env(env, i, num_processes, cpu_devices_per_process)
            )
        job.wait(timeout_s, grace_s)
    finally:
        job.kill_the_rest()
    return LocalRun(
        returncodes=[p.returncode for p in job.procs],
        outputs=["".join(o) for o in job.outputs],
        # kill_the_rest set every exit time that wait left unset.
        exit_times=[float(t) for t in job.exit_times if t is not None],
        killed=job.killed,
    )


def _check_command(argv: Any, env: Any) -> None:
    if isinstance(argv, str | bytes) or not isinstance(argv, Sequence):
        raise TypeError(
            f"`argv` must be a list of strings (the command and its arguments), "
            f"got {argv!r}."
        )
    if not argv:
        raise ValueError("`argv` must name a command, got an empty sequence.")
    if not all(isinstance(a, str | os.PathLike) for a in argv):
        raise TypeError(f"`argv` must hold strings, got {list(argv)!r}.")
    if env is not None and not (
        isinstance(env, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError(f"`env` must map strings to strings, got {env!r}.")


def _child_env(
    env: Mapping[str, str] | None, i: int, n: int, cpu_devices: int | None
) -> dict[str, str]:
    """Process ``i``'s environment: ours, ``env``, and its place in the job."""
    child = dict(os.environ)
    child.update(env or {})
    child.update(
        {
            ENV_NUM_PROCESSES: str(n),
            ENV_PROCESS_ID: str(i),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cpu_devices is not None:
        child[ENV_CPU_DEVICES] = str(cpu_devices)
    return child


class _Job:
    """The processes of one `launch_local` call, their output and exits."""

    def __init__(self, n: int, echo: bool):
        self.address = f"127.0.0.1:{free_port()}"
        self.start = time.monotonic()
        self.echo = echo
        self.procs: list[subprocess.Popen] = []
        self.outputs: list[list[str]] = [[] for _ in range(n)]
        self.exit_times: list[float | None] = [None] * n
        self.killed: list[int] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def spawn(self, argv: Sequence[str], i: int, env: dict[str, str]) -> None:
        env[ENV_COORDINATOR] = self.address
        proc = subprocess.Popen(
            list(argv),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # its own group, to kill its children too
        )
        self.procs.append(proc)
        thread = threading.Thread(target=self.pump, args=(i, proc.stdout), daemon=True)
        thread.start()
        self.threads.append(thread)

    def pump(self, i: int, stream: Any) -> None:
        for line in iter(stream.readline, ""):
            self.outputs[i].append(line)
            if self.echo:
                with self.lock:
                    sys.stdout.write(f"[{i}] {line}")
                    sys.stdout.flush()
        stream.close()

    def wait(self, timeout_s: float, grace_s: float) -> None:
        """Until all exit; once one fails, the others get ``grace_s``."""
        deadline = self.start + timeout_s
        while True:
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if self.exit_times[i] is None and proc.poll() is not None:
                    self.exit_times[i] = now - self.start
                    if proc.returncode != 0:
                        deadline = min(deadline, now + grace_s)
            if all(t is not None for t in self.exit_times) or now >= deadline:
                return
            time.sleep(0.05)

    def kill_the_rest(self) -> None:
        """SIGKILL (JAX catches SIGTERM) whatever still runs; reap all."""
        for i, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.killed.append(i)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for i, proc in enumerate(self.procs):
            proc.wait()
            if self.exit_times[i] is None:
                self.exit_times[i] = time.monotonic() - self.start
        for thread in self.threads:
            thread.join(timeout=5)
