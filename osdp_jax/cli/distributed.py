"""Several processes, one mesh: ``jax.distributed`` set-up, and a launcher for local processes.

On a cluster, a scheduler starts one ``osdp-jax train`` per host with ``--coordinator HOST:PORT
--num-processes N --process-id I``; :func:`initialize` joins them into one set of global devices
before anything touches a device. On one machine, ``osdp-jax launch --processes N CONFIG ...``
(:func:`launch`) starts N such processes on loopback and watches them: if one dies, the others
are stopped and the launcher exits with an error naming it. Each process's heartbeat to the
coordinator times out after ``HEARTBEAT_S`` seconds, so a process whose peer vanished also stops
on its own rather than wait in a collective forever.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

INIT_TIMEOUT_S = 60  # a peer that never shows up: give up after this long
HEARTBEAT_S = 20  # a peer that stops answering is declared dead after this long


class DistributedError(RuntimeError):
    """Processes could not form (or keep) one mesh."""


def initialize(coordinator: str, num_processes: int, process_id: int, timeout_s: int = INIT_TIMEOUT_S):
    """``jax.distributed.initialize`` with bounded waits and one clear error."""
    import jax
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"--process-id {process_id} is not in [0, {num_processes})")
    # A peer that never shows up makes jax's coordination client abort the process (a C++ fatal
    # error, DEADLINE_EXCEEDED, not an exception), so say first what is being waited for.
    print(f"osdp-jax: process {process_id} of {num_processes} joining the coordinator at {coordinator}; "
          f"if every process has not joined within {timeout_s} s, this process stops (jax reports "
          f"DEADLINE_EXCEEDED): start every process with the same --coordinator and --num-processes",
          file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=HEARTBEAT_S,
                                   coordinator_bind_address=coordinator if process_id == 0 else None)
    except Exception as e:  # jax raises XlaRuntimeError/RuntimeError with a long status text
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"process {process_id} of {num_processes} could not join the coordinator at {coordinator} "
            f"within {timeout_s} s ({first}); start every process with the same --coordinator and "
            f"--num-processes, and check that the coordinator's port is reachable") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, processes: int, devices_per_process: int, extra: list[str],
           poll_s: float = 0.2) -> int:
    """Run ``osdp-jax train CONFIG`` as ``processes`` local processes on loopback; exit code."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # each process asks for its own devices (--devices); the user's other XLA flags reach it
    flags = [f for f in os.environ.get("XLA_FLAGS",
                                       "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "osdp_jax.cli.main", "train", config, "--coordinator", coordinator,
               "--num-processes", str(processes), "--process-id", str(i),
               "--devices", str(devices_per_process), *extra]
        # their own session: a Ctrl-C in the terminal reaches the launcher alone, which forwards
        # exactly one SIGTERM to each process (a second signal would make them exit at once)
        procs.append(subprocess.Popen(cmd, env=env, stdout=None if i == 0 else subprocess.DEVNULL,
                                      start_new_session=True))
        print(f"osdp-jax launch: process {i} pid {procs[-1].pid}", file=sys.stderr, flush=True)
    stopping: list[int] = []  # the signal the launcher got, forwarded to every process

    def forward(signum, frame):
        if stopping:  # a second signal: stop them now
            _stop(procs, grace_s=0.0)
            os._exit(128 + signum)
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            if stopping:
                # every process checkpoints after the step they agree on, then exits
                if all(c is not None for c in codes):
                    name = signal.Signals(stopping[0]).name
                    print(f"osdp-jax launch: {name}: all {processes} processes stopped (exit codes {codes})",
                          file=sys.stderr, flush=True)
                    return 128 + stopping[0]
                time.sleep(poll_s)
                continue
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # a peer's death makes the others fail in their next collective: within one poll
                # several may be gone, so name every one
                why = lambda c: f"killed by signal {-c}" if c < 0 else f"exit code {c}"  # noqa: E731
                dead = "; ".join(f"process {i} of {processes} died ({why(c)})" for i, c in failed)
                _stop(procs)
                print(f"osdp-jax: error: {dead}; stopped the others", file=sys.stderr, flush=True)
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    finally:
        for s_, h in previous.items():
            signal.signal(s_, h)


def _stop(procs, grace_s: float = 5.0):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
