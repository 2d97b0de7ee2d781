"""JAX's persistent compilation cache, for planning again (another budget, ``compare``, a resumed
run) without compiling the same probe steps again."""
from __future__ import annotations

import os
import pathlib

import jax

MAX_BYTES = 4 * 2**30  # default bound on a cache folder's entries, bytes


def enable_compilation_cache(path, min_compile_seconds: float = 0.0,
                             max_bytes: int | None = MAX_BYTES) -> pathlib.Path:
    """Cache every XLA compile of this process longer than ``min_compile_seconds`` under ``path``.

    Call it before the first compile. A step or probe compiled before (same program, same devices,
    same jax version) is then read from disk instead of compiled: the planner's probe steps when
    planning again, and the train step the planner compiled to verify its plan.

    ``max_bytes``: the folder's entries are kept under this many bytes, the least recently read
    removed first (JAX's LRU eviction); an entry larger than it is not written. With a bound,
    JAX also takes a file lock around every read and write, so processes may share the folder.
    ``None``: no bound, and no lock (JAX then writes entries in place: one folder per process).
    """
    path = pathlib.Path(os.path.expanduser(str(path))).absolute()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", -1 if max_bytes is None else int(max_bytes))
    return path
