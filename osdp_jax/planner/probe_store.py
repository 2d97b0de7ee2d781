"""Probe figures kept on disk, so that planning the same model again in a new process (the CLI at
another budget, ``compare`` after ``plan``) neither traces nor compiles a probe it has seen.

JAX's persistent compilation cache (``enable_compilation_cache``) saves a probe's compile, but
not its trace and lowering, which is most of a probe on a small model. A probe's figures are a few
numbers (:class:`~osdp_jax.core.xla.StepProfile`),
so they are kept whole: one JSON file per probe, named by a SHA-256 digest of

- the in-process probe cache's key (``XlaCalibrator._key``): the loss's fingerprint (a digest of
  its jaxpr, ``Problem.fingerprint``), the optimizer state's and the parameters' structure, shapes
  and dtypes, the probe's layout, the batch's shapes;
- the mesh as devices: axis names and sizes, device ids in order, platform and device kind, and
  the process count;
- what else decides XLA's figures: the versions of jax, jaxlib, flax and optax, ``XLA_FLAGS``, the
  backend's platform version, and a digest of osdp_jax's own source (the probe steps it builds).

Any change to one of these is another file, so a figure is never read for another program. Timed
probes (``measure_time=True``) are not kept: they measure this run's hardware. A file that cannot
be read or parsed is a miss (and is written again); files are written whole and renamed into
place, so a process killed mid-write or two processes writing the same probe leave either no file
or a whole one.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import tempfile

import jax

from osdp_jax.core.xla import StepProfile

log = logging.getLogger("osdp_jax")

SUBDIR = "probes"  # enable_compilation_cache(path) keeps them in path/probes

_DIR: pathlib.Path | None = None  # where probe figures are kept; None: not kept on disk
_READS = 0  # probe figures read from disk in this process


def reads() -> int:
    """Probe figures read from disk so far in this process (``Plan.probes_read`` counts a plan's)."""
    return _READS


def enable(path) -> pathlib.Path:
    """Keep probe figures under ``path`` (created if missing) from now on, in this process."""
    global _DIR
    _DIR = pathlib.Path(os.path.expanduser(str(path))).absolute()
    _DIR.mkdir(parents=True, exist_ok=True)
    return _DIR


def disable() -> None:
    """Keep probe figures in this process only (the default)."""
    global _DIR
    _DIR = None


def directory() -> pathlib.Path | None:
    """Where probe figures are kept on disk, or None."""
    return _DIR


@functools.cache
def _source_digest() -> str:
    """SHA-256 of osdp_jax's Python sources, in path order (computed once per process)."""
    root = pathlib.Path(__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@functools.cache
def _environment() -> tuple:
    """The library versions, ``XLA_FLAGS`` and the backend, once per process (XLA reads its flags
    when the backend starts, so later changes to the variable do not reach the compiles)."""
    import flax
    import jaxlib
    import optax
    backend = jax.devices()[0].client
    return (jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__,
            os.environ.get("XLA_FLAGS", ""), backend.platform, backend.platform_version)


def _mesh(mesh) -> tuple:
    devices = mesh.devices
    first = devices.flat[0]
    return (tuple(mesh.axis_names), tuple(devices.shape), tuple(int(d.id) for d in devices.flat),
            first.platform, first.device_kind, jax.process_count())


def _file(key) -> pathlib.Path | None:
    """The file of the probe keyed ``key`` (``XlaCalibrator._key``), or None if it is not kept on
    disk (no folder, a timed probe, or a loss without a fingerprint)."""
    fingerprint, optimizer, params, layout, batch, mesh, timed = key
    if _DIR is None or timed or not isinstance(fingerprint, str) or not fingerprint:
        return None
    text = repr((fingerprint, optimizer, params, layout, batch, _mesh(mesh), _environment(), _source_digest()))
    return _DIR / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def load(key) -> StepProfile | None:
    """The figures kept for ``key``, or None."""
    global _READS
    path = _file(key)
    if path is None or not path.is_file():
        return None
    try:
        profile = StepProfile(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:  # damaged or of another format: a miss
        log.info("probe store: ignoring %s (%s)", path, e)
        return None
    _READS += 1
    return profile


def save(key, profile: StepProfile) -> None:
    """Keep ``profile`` for ``key`` (written whole, then renamed into place)."""
    path = _file(key)
    if path is None:
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(dataclasses.asdict(profile), f)
        os.replace(tmp, path)
    except OSError as e:  # a full or read-only disk costs the next process a compile, nothing more
        log.warning("probe store: could not write %s (%s)", path, e)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
