"""Python's cyclic garbage collector paused while planning runs.

Planning traces and lowers a train step a dozen times or more (the probes, the verifications, a
sweep's compiles ahead), each in Python on the main thread, which is the critical path while the
compile threads work. Tracing allocates millions of objects, and every full collection walks all
of the process's objects (JAX's, Flax's, the model's and the kept jaxprs': 190,000 to 330,000 on
the paper configs), about 0.15 s each. Measured on this repository's 2-core machine (``gc``
callbacks around a cold ``plan()`` and a seven-budget sweep of gpt2-48l-1536): the collector took
0.8 to 1.0 s of a 10 s cold plan and 3.2 s of a 25 to 30 s sweep, while a collection at the end of
the sweep found only 3,000 to 6,000 unreachable objects (no change in resident memory): tracing
leaves little cyclic garbage, and reference counting frees the rest as it goes.

So :func:`paused` turns the collector off for a planning call and back on after it (when it was
on): reference counting still frees every object that is not in a cycle, and the collector then
resumes with the few cycles left. It nests (only the outermost call turns it back on) and is a
decorator as well as a context manager.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """Run the body with Python's cyclic garbage collector off; it is turned back on after, if it
    was on before (``gc.isenabled()``)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


__all__ = ["paused"]
