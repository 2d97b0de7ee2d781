"""JAX's persistent compilation cache, for planning again (another budget, ``compare``, a resumed
run) without compiling the same probe steps again."""
from __future__ import annotations

import os
import pathlib

import jax

from osdp_jax.planner import probe_store as _probe_store


def enable_compilation_cache(path, min_compile_seconds: float = 0.0, probes: bool = True) -> pathlib.Path:
    """Cache every XLA compile of this process longer than ``min_compile_seconds`` under ``path``.

    Call it before the first compile. A step or probe compiled before (same program, same devices,
    same jax version) is then read from disk instead of compiled: the planner's probe steps when
    planning again, and the train step (the one ``plan(verify="full")`` compiled, or
    ``make_train_step``'s). One cache folder
    per process: concurrent writers are not supported.

    ``probes``: also keep the planner's probe figures under ``path/probes`` (a JSON file of a few
    hundred bytes per probe, ``osdp_jax.planner.probe_store``), so that a new process planning the same
    model again (another budget, ``compare``) neither traces nor compiles the probes it finds
    there, where the compilation cache alone saves their compiles but not their traces.
    """
    path = pathlib.Path(os.path.expanduser(str(path))).absolute()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if probes:
        _probe_store.enable(path / _probe_store.SUBDIR)
    else:
        _probe_store.disable()
    return path
