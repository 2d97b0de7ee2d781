"""Stopping a training run on SIGTERM or SIGINT without losing it.

Schedulers preempt jobs with SIGTERM (then SIGKILL after a grace period); people press Ctrl-C
(SIGINT). While a :class:`Preemption` is installed, the first such signal is remembered: the
training loop finishes the step it is in, writes a checkpoint and raises :class:`Preempted`, which
the CLI turns into one line and exit code ``128 + signal`` (143 for SIGTERM, 130 for SIGINT).
Outside the training loop (while planning or compiling) nothing is worth saving, so the signal
raises :class:`Preempted` at once. A second signal exits immediately (``os._exit``): orbax
writes a checkpoint into a temporary directory and renames it when complete, so a save cut short
leaves no checkpoint that looks valid, and every other file is replaced atomically or truncated
to the checkpoint on resume.

With several processes (``jax.distributed``), the processes agree after every step whether any
of them was signalled (:meth:`Preemption.agreed`), so all stop after the same step and write one
checkpoint together.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(BaseException):
    """Training stopped on a signal; ``step`` is the checkpoint written (None: nothing to save).

    A ``BaseException``, like ``KeyboardInterrupt``: ``except Exception`` blocks let it through."""

    def __init__(self, signum: int, step: int | None = None, message: str = ""):
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Preemption:
    """A context that catches SIGTERM and SIGINT (main thread only; elsewhere it does nothing)."""

    def __init__(self):
        self.signum: int | None = None
        self.deferred = False  # inside the training loop: finish the step first
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
        return False

    def _handle(self, signum, frame):
        if self.signum is not None:  # the second signal: stop now
            print(f"\nosdp-jax: second {signal.Signals(signum).name}: exiting at once; the newest complete "
                  f"checkpoint is kept", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signum = signum
        if not self.deferred:
            raise Preempted(signum)

    def agreed(self) -> int | None:
        """The signal that stops the run after this step, agreed by every process (None: go on)."""
        import jax
        if jax.process_count() == 1:
            return self.signum
        import numpy as np
        from jax.experimental import multihost_utils
        mine = np.int32(self.signum or 0)
        signums = np.asarray(multihost_utils.process_allgather(mine))
        hit = signums[signums > 0]
        return int(hit[0]) if hit.size else None
