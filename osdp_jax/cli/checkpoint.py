"""Checkpoints of a training run (orbax-checkpoint), and export of trained parameters.

A run directory holds ``checkpoints/<step>/`` written by ``orbax.checkpoint.CheckpointManager``:
``state`` (params and optimizer state, sharded, restored onto any mesh and plan by giving target
shardings) and ``meta`` (JSON: the step, the data position, the seed, the model's parameter
fingerprint, the plan and the config). Orbax writes each checkpoint into a temporary directory and
renames it when complete, so a save killed half-way leaves no checkpoint that looks valid; the
manager ignores (and here cleans up) such leftovers, and keeps the newest ``keep``.

``step`` is the number of completed training steps: resuming from checkpoint ``s`` runs step
``s`` next, with the batch that step would have had (data are a function of seed and step).

Export writes the parameters as a plain ``.npz`` (one array per ``/``-joined path), readable with
``numpy.load`` alone; import reads it back onto a mesh under a plan.
"""
from __future__ import annotations

import contextlib
import logging
import pathlib
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

import osdp_jax
from osdp_jax.core.describe import flat_params, path_name


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here: another model, a missing one, an existing run."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint directory that orbax lists as complete but that cannot be read back."""

    def __init__(self, path: pathlib.Path, step: int, reason: str):
        super().__init__(f"checkpoint {path} is damaged: {reason}")
        self.path, self.step, self.reason = path, step, reason


@contextlib.contextmanager
def _quiet():
    """Reading a damaged checkpoint makes orbax log warnings and its futures' callbacks log
    tracebacks ("Event loop is closed") after the real error; the error is reported as one line,
    so these are silenced while orbax reads."""
    loggers = [logging.getLogger(name) for name in ("absl", "concurrent.futures", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _ignore_closed_loop_callbacks(unraisable, _default=sys.unraisablehook):
    """After orbax fails to read a damaged checkpoint, tensorstore's threads still call back into
    the event loop orbax has closed; each callback's ``RuntimeError('Event loop is closed')`` would
    print a traceback after the one-line error. Those are dropped; anything else is reported."""
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
        return
    _default(unraisable)


sys.unraisablehook = _ignore_closed_loop_callbacks


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return (line[:160] + "...") if len(line) > 160 else line


def fingerprint(params) -> list[list]:
    """``[[path, shape, dtype], ...]`` of a params tree: what a checkpoint must match to restore."""
    return [[i.path, list(i.shape), str(i.dtype)] for i in osdp_jax.describe(params)]


class Checkpoints:
    """The checkpoints of one run directory."""

    def __init__(self, directory: pathlib.Path, keep: int = 2, read_only: bool = False):
        self.directory = pathlib.Path(directory).absolute()
        # read_only: look without touching anything (leftovers of a killed save stay until a
        # writing manager cleans them)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, cleanup_tmp_directories=not read_only,
                                               enable_async_checkpointing=False, create=not read_only)
        with _quiet():  # orbax warns about each step folder it cannot fully read; validate() says it once
            self.manager = ocp.CheckpointManager(
                self.directory, options=options,
                item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        with _quiet():
            return sorted(self.manager.all_steps())

    def latest(self) -> int | None:
        with _quiet():
            return self.manager.latest_step()

    def save(self, step: int, params, opt_state, meta: dict) -> None:
        """Save the state with every layer stack whole (``osdp_jax.merge_segments``), so that it
        restores under any segmentation, plan or device count."""
        whole = osdp_jax.merge_segments({"params": params, "opt_state": opt_state})
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(whole),
            meta=ocp.args.JsonSave({**meta, "step": step})))
        self.manager.wait_until_finished()

    def meta(self, step: int) -> dict:
        """Checkpoint ``step``'s JSON meta; a :class:`DamagedCheckpoint` if it cannot be read."""
        try:
            with _quiet():
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax/tensorstore raise many types, with long texts
            raise DamagedCheckpoint(self.directory / str(step), step,
                                    f"its meta cannot be read ({_first_line(e)})") from None
        if not isinstance(meta, dict) or meta.get("step") != step:
            raise DamagedCheckpoint(self.directory / str(step), step,
                                    "its meta does not record this step")
        return meta

    def validate(self, step: int, expected_fingerprint) -> dict:
        """Checkpoint ``step``'s meta, after checking what can be checked without reading the
        arrays: the meta, the model's fingerprint and the state's tree metadata. Raises
        :class:`DamagedCheckpoint` or, for another model, :class:`CheckpointError`."""
        meta = self.check_model(step, expected_fingerprint)
        where = self.directory / str(step)
        try:
            with _quiet():
                state = self.manager.item_metadata(step)["state"]
        except Exception as e:
            raise DamagedCheckpoint(where, step, f"its state cannot be read ({_first_line(e)})") from None
        if state is None or not jax.tree.leaves(state):
            raise DamagedCheckpoint(where, step, "its state holds no arrays")
        return meta

    def restore(self, step: int, params_target, opt_state_target, expected_fingerprint) -> tuple:
        """``(params, opt_state, meta)`` of checkpoint ``step``, laid out as the targets'
        shardings (``jax.ShapeDtypeStruct`` with ``sharding``): any mesh, any plan. A checkpoint
        whose arrays cannot be read raises :class:`DamagedCheckpoint`."""
        meta = self.validate(step, expected_fingerprint)
        target = {"params": params_target, "opt_state": opt_state_target}
        try:
            with _quiet():
                state = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(
                    osdp_jax.whole_target(target))))["state"]
        except Exception as e:
            raise DamagedCheckpoint(self.directory / str(step), step,
                                    f"its arrays cannot be restored ({_first_line(e)})") from None
        state = osdp_jax.cut_segments(state, target)
        return state["params"], state["opt_state"], meta

    def restore_params(self, step: int, abstract_params, optimizer, device=None):
        """Checkpoint ``step``'s parameters on one device (default: the first), checked against
        ``abstract_params``; the optimizer state (``optimizer`` gives its structure) is dropped."""
        one = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)  # noqa: E731
        params, _, _ = self.restore(step, jax.tree.map(place, abstract_params),
                                    jax.tree.map(place, jax.eval_shape(optimizer.init, abstract_params)),
                                    fingerprint(abstract_params))
        return params

    def check_model(self, step: int, expected_fingerprint) -> dict:
        """Checkpoint ``step``'s meta, or a ``CheckpointError`` if it is of another model."""
        meta = self.meta(step)
        if meta.get("fingerprint") != expected_fingerprint:
            theirs = {p for p, *_ in meta.get("fingerprint", [])}
            ours = {p for p, *_ in expected_fingerprint}
            diff = sorted(theirs ^ ours)[:3] or [p for (p, *a), (_, *b) in
                                                 zip(sorted(meta.get("fingerprint", [])), sorted(expected_fingerprint))
                                                 if a != b][:3]
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} is of another model "
                f"({meta.get('model', '?')!r}; parameters differ, e.g. {diff}); use another --out "
                f"directory or the config that wrote it")
        return meta

    def close(self):
        self.manager.close()


def export_params(params, path: pathlib.Path) -> pathlib.Path:
    """Write ``params`` (any sharding; layer stacks whole) to a plain ``.npz``, one array per
    ``/``-joined path."""
    params = osdp_jax.merge_segments(params)
    arrays = {name: np.asarray(jax.device_get(x)) for name, x in flat_params(params).items()}
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return path


def import_params(path: pathlib.Path, like):
    """Parameters from an exported ``.npz``, shaped like the tree ``like`` (checked leaf by leaf)."""
    with np.load(path) as f:
        stored = dict(f)

    def one(p, x):
        name = path_name(p)
        if name not in stored:
            raise CheckpointError(f"{path} has no parameter {name!r}; it holds {sorted(stored)[:3]}...")
        if tuple(stored[name].shape) != tuple(x.shape):
            raise CheckpointError(f"{path}: parameter {name!r} has shape {stored[name].shape}, the "
                                  f"model needs {tuple(x.shape)}")
        return stored[name].astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, like)
