"""Experiment configs: typed, frozen dataclasses read from TOML (``tomllib``), with overrides.

A config file has the sections below; every key is optional except ``model.preset``. An unknown
section or key, or a value of the wrong type, raises one ``ConfigError`` naming it.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
import tomllib
import typing


class ConfigError(ValueError):
    """A bad config: the message names the section and key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str = ""  # a name from models.PRESETS, e.g. "gpt2-mini"
    compute_dtype: str = ""  # e.g. "bfloat16": layers compute in it, parameters stay float32 ("": float32);
    #                          the plan then gathers sharded parameters in it too (plan.compute_dtype)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    task: str = "random"  # "addition", "chars" or "random"
    digits: int = 2  # addition: digits per operand
    path: str = ""  # chars: a local text file
    seq_len: int = 32  # chars/random: tokens per example


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    shape: tuple[int, ...] = (8,)  # devices along each mesh axis
    axes: tuple[str, ...] = ("data",)  # axis names; all are data-parallel


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    budget: str = "1GiB"  # per-device memory budget, e.g. "64MiB", "8GB"
    batch_sizes: tuple[int, ...] = (32,)  # global batch sizes to sweep
    strategies: tuple[str, ...] = ("replicate", "zero3", "hsdp")  # hsdp needs 2+ mesh axes
    splits: tuple[int, ...] = (1, 2, 4, 8)  # operator-splitting slice counts to consider; [1] = off
    remat: tuple[str, ...] = ("full", "dots", "none")  # remat policies a layer stack's layers may take
    per_layer: bool = True  # decide each layer of a stack (segments); false: one choice per stack
    segment_gain: float = 0.0  # speed-up each segment of a stack beyond its first must bring (0.01: 1%)
    units: tuple[str, ...] = ("auto",)  # units (osdp_jax.units): ["auto"] the default policy, [] none, or
    #                                     fnmatch patterns of submodule paths, e.g. ["blocks_*"]
    unit_remat: str = "full"  # the remat policy units run under
    compute_dtype: str = ""  # e.g. "bfloat16": sharded parameters gathered in it (fp32 masters); "": own dtype
    microbatches: tuple[int, ...] = (1,)  # gradient-accumulation counts searched with the batch size
    measure_time: bool = False  # time the probe steps on this mesh to calibrate the time model
    hardware: str = ""  # a preset name (osdp_jax.PRESETS) or a profile .json; empty: the mesh's default
    tensor: str = "off"  # "on": compare also adds OSDP+TP, the model's column/row pairs split over model_axis
    model_axis: str = "model"  # the mesh axis tensor parallelism splits over (with tensor = "on")
    sequence: str = "off"  # with tensor = "on": "on" sequence parallelism in the OSDP+TP row; "auto" with and without
    model_sizes: tuple[int, ...] = ()  # with tensor = "on": the model-axis sizes the OSDP+TP row plans (the model
    #                                    axis and its neighbouring data axis shared anew); [] = the mesh's own
    compilation_cache: str = "~/.cache/osdp-jax/xla"  # JAX's persistent compilation cache; "" = off
    probe_store: bool = True  # also keep the planner's probe figures in compilation_cache/probes


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # "adam", "adamw" or "sgd"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up, then constant
    grad_clip: float = 0.0  # global-norm clip; 0 disables


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    seed: int = 0
    log_every: int = 10  # progress-bar refresh, steps
    checkpoint_every: int = 0  # save a checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2  # newest complete checkpoints kept


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    plan: PlanConfig = PlanConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        _check(self)


def _fail(where: str, message: str):
    raise ConfigError(f"config error: {where}: {message}")


def _check(cfg: ExperimentConfig):
    from osdp_jax import models
    if not cfg.model.preset:
        _fail("model.preset", f"missing; choose one of {sorted(models.PRESETS)}")
    if cfg.model.preset not in models.PRESETS:
        close = difflib.get_close_matches(cfg.model.preset, models.PRESETS, n=1)
        _fail("model.preset", f"unknown preset {cfg.model.preset!r}"
              + (f"; did you mean {close[0]!r}?" if close else f"; choose one of {sorted(models.PRESETS)}"))
    if cfg.data.task not in ("addition", "chars", "random"):
        _fail("data.task", f"must be 'addition', 'chars' or 'random', got {cfg.data.task!r}")
    if cfg.data.task == "chars" and not cfg.data.path:
        _fail("data.path", "task 'chars' needs a local text file path")
    for key in ("digits", "seq_len"):
        if getattr(cfg.data, key) <= 0:
            _fail(f"data.{key}", "must be positive")
    if len(cfg.mesh.shape) != len(cfg.mesh.axes) or not cfg.mesh.shape:
        _fail("mesh.shape", f"{list(cfg.mesh.shape)} and mesh.axes {list(cfg.mesh.axes)} must have the "
                            f"same, non-zero length")
    if any(s <= 0 for s in cfg.mesh.shape):
        _fail("mesh.shape", f"sizes must be positive, got {list(cfg.mesh.shape)}")
    if len(set(cfg.mesh.axes)) != len(cfg.mesh.axes):
        _fail("mesh.axes", f"names must be distinct, got {list(cfg.mesh.axes)}")
    if cfg.plan.tensor not in ("off", "on"):
        _fail("plan.tensor", f"must be 'off' or 'on', got {cfg.plan.tensor!r}")
    if cfg.plan.sequence not in ("off", "on", "auto"):
        _fail("plan.sequence", f"must be 'off', 'on' or 'auto', got {cfg.plan.sequence!r}")
    if any(t <= 0 for t in cfg.plan.model_sizes):
        _fail("plan.model_sizes", f"sizes must be positive, got {list(cfg.plan.model_sizes)}")
    if cfg.plan.model_sizes and cfg.plan.tensor != "on":
        _fail("plan.model_sizes", "applies to the OSDP+TP row: set plan.tensor = 'on' too, or drop it")
    if cfg.plan.tensor == "on" and (cfg.plan.model_axis not in cfg.mesh.axes or len(cfg.mesh.axes) < 2):
        _fail("plan.model_axis", f"tensor = 'on' needs a mesh with the model axis {cfg.plan.model_axis!r} and a "
                                 f"data axis beside it, e.g. mesh.shape = [2, 4] and mesh.axes = ['data', "
                                 f"'{cfg.plan.model_axis}']; the mesh's axes are {list(cfg.mesh.axes)}")
    if cfg.plan.model_sizes and cfg.plan.tensor == "on":
        from osdp_jax.planner.pipeline import model_sizes_for
        shape = dict(zip(cfg.mesh.axes, cfg.mesh.shape))
        try:
            model_sizes_for(tuple(cfg.plan.model_sizes), {}, shape, cfg.plan.model_axis,
                            tuple(a for a in cfg.mesh.axes if a != cfg.plan.model_axis))
        except ValueError as e:
            _fail("plan.model_sizes", str(e))
    n = math.prod(cfg.mesh.shape)
    if not cfg.plan.batch_sizes:
        _fail("plan.batch_sizes", "give at least one batch size")
    bad = [b for b in cfg.plan.batch_sizes if b <= 0 or b % n]
    if bad:
        _fail("plan.batch_sizes", f"{bad[0]} is not a positive multiple of the mesh's {n} devices")
    from osdp_jax import PRESETS, parse_bytes
    from osdp_jax.strategies import check_microbatches, check_splits, check_strategies
    try:
        parse_bytes(cfg.plan.budget)
    except ValueError as e:
        _fail("plan.budget", str(e))
    try:
        check_strategies(cfg.plan.strategies)
    except ValueError as e:
        _fail("plan.strategies", str(e))
    try:
        check_splits(cfg.plan.splits)
    except ValueError as e:
        _fail("plan.splits", str(e))
    try:
        check_microbatches(cfg.plan.microbatches, cfg.plan.batch_sizes, n)
    except ValueError as e:
        _fail("plan.microbatches", str(e))
    from osdp_jax.core.layout import check_dtype
    for where, value in (("plan.compute_dtype", cfg.plan.compute_dtype), ("model.compute_dtype",
                                                                          cfg.model.compute_dtype)):
        try:
            check_dtype(value)
        except ValueError as e:
            _fail(where, str(e))
    from osdp_jax.layers import REMAT_POLICIES
    if not cfg.plan.remat:
        _fail("plan.remat", f"give at least one remat policy of {list(REMAT_POLICIES)}")
    bad = [r for r in cfg.plan.remat if r not in REMAT_POLICIES]
    if bad:
        _fail("plan.remat", f"unknown remat policy {bad[0]!r}; give one or more of {list(REMAT_POLICIES)}")
    if "auto" in cfg.plan.units and len(cfg.plan.units) > 1:
        _fail("plan.units",
              f"'auto' (the default policy) cannot be combined with patterns, got {list(cfg.plan.units)}; "
                            f"give [\"auto\"], [] (no units) or patterns such as [\"blocks_*\"]")
    if cfg.plan.unit_remat not in REMAT_POLICIES:
        _fail("plan.unit_remat", f"unknown remat policy {cfg.plan.unit_remat!r}; give one of {list(REMAT_POLICIES)}")
    from osdp_jax.planner.pipeline import check_segment_gain
    try:
        check_segment_gain(cfg.plan.segment_gain)
    except ValueError as e:
        _fail("plan.segment_gain", str(e))
    hw = cfg.plan.hardware
    if hw and hw not in PRESETS and not (hw.endswith(".json") and pathlib.Path(hw).is_file()):
        _fail("plan.hardware", f"unknown preset {hw!r}; give one of {sorted(PRESETS)} or a profile .json "
                               f"file written by 'osdp-jax profile'")
    if cfg.optim.name not in ("adam", "adamw", "sgd"):
        _fail("optim.name", f"must be 'adam', 'adamw' or 'sgd', got {cfg.optim.name!r}")
    if cfg.optim.learning_rate <= 0:
        _fail("optim.learning_rate", "must be positive")
    if cfg.train.steps < 0:
        _fail("train.steps", "must be >= 0")
    if cfg.train.checkpoint_every < 0:
        _fail("train.checkpoint_every", "must be >= 0 (0: only at the end)")
    if cfg.train.keep_checkpoints < 1:
        _fail("train.keep_checkpoints", "must be >= 1")


def _coerce(where: str, value, typ):
    """``value`` as ``typ`` (int, float, str, bool or tuple[X, ...]), or a ConfigError."""
    origin = typing.get_origin(typ)
    if origin is tuple:
        (item,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
        if not isinstance(value, (list, tuple)):
            value = [value]
        return tuple(_coerce(where, v, item) for v in value)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is bool or isinstance(value, bool):
        if typ is bool and isinstance(value, bool):
            return value
        _fail(where, f"expected {typ.__name__}, got {type(value).__name__} {value!r}")
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, typ):
        _fail(where, f"expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _section_types():
    hints = typing.get_type_hints(ExperimentConfig)
    return {name: hints[name] for name in hints}


def _check_name(where: str, name: str, known, show) -> None:
    """Fail for a name not in ``known``, suggesting the closest one; ``show`` formats a name."""
    if name in known:
        return
    close = difflib.get_close_matches(name, known, n=1)
    what = "unknown section" if where.startswith("[") else "unknown key"
    _fail(where, what + (f"; did you mean {show(close[0])}?" if close else f"; known: {sorted(known)}"))


def from_dict(d: dict) -> ExperimentConfig:
    """Build and validate a config from nested dicts (as TOML gives)."""
    sections = _section_types()
    built = {}
    for name, value in d.items():
        _check_name(f"[{name}]", name, sections, lambda k: f"[{k}]")
        if not isinstance(value, dict):
            _fail(f"[{name}]", "must be a table of keys")
        cls = sections[name]
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, v in value.items():
            _check_name(f"{name}.{key}", key, hints, lambda k: f"{name}.{k}")
            kwargs[key] = _coerce(f"{name}.{key}", v, hints[key])
        built[name] = cls(**kwargs)
    return ExperimentConfig(**built)


def to_dict(cfg: ExperimentConfig) -> dict:
    return {f.name: {k: list(v) if isinstance(v, tuple) else v
                     for k, v in dataclasses.asdict(getattr(cfg, f.name)).items()}
            for f in dataclasses.fields(cfg)}


def load(path, overrides: dict[str, str] | None = None) -> ExperimentConfig:
    """Read a TOML config and apply ``{"section.key": "text value"}`` overrides."""
    path = pathlib.Path(path)
    try:
        d = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config error: {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config error: {path}: invalid TOML: {e}") from None
    for dotted, text in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        sections = _section_types()
        if section not in sections or not key:
            _fail(f"--{dotted}", f"overrides look like --section.key=value with a section from {sorted(sections)}")
        hints = typing.get_type_hints(sections[section])
        _check_name(f"--{dotted}", key, hints, lambda k: f"--{section}.{k}")
        d.setdefault(section, {})[key] = _parse_text(f"--{dotted}", text, hints[key])
    return from_dict(d)


def _parse_text(where: str, text: str, typ):
    """A command-line value as ``typ``: numbers and bools parsed, tuples comma-separated (``2,4``),
    or written as in TOML (``[2, 4]``, ``["hsdp", "zero3"]``)."""
    if typing.get_origin(typ) is tuple:
        (item,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
        inner = text.strip()
        if inner.startswith("[") and inner.endswith("]"):
            inner = inner[1:-1]
        items = [t.strip().strip("'\"").strip() for t in inner.split(",")]
        return [_parse_text(f"{where} (a comma-separated list, e.g. 2,4)", t, item) for t in items if t]
    try:
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
        if typ is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
    except ValueError:
        _fail(where, f"expected {typ.__name__}, got {text!r}")
    return text
