"""Python's cyclic garbage collector paused while planning runs.

Planning traces and lowers a train step a dozen times or more (the probes, the verifications, a
sweep's compiles ahead), each in Python on the main thread, which is the critical path while the
compile threads work. Tracing allocates millions of objects, and every full collection walks all
of the process's objects (JAX's, Flax's, the model's and the kept jaxprs'), while tracing leaves
little cyclic garbage: reference counting frees the rest as it goes. So the collector is paused
while planning runs, and what it would have found is collected once at the end.

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
