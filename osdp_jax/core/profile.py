"""Measure the current mesh: collective times against message size, and matmul throughput.

Fits the ring model of ``_hardware.py`` to medians of timed runs::

    t_all_gather(V)     = a + (N-1)/N * V / W
    t_reduce_scatter(V) = a + (N-1)/N * V / W
    t_all_reduce(V)     = a + 2(N-1)/N * V / W

by least squares (relative error) over all three collectives and every message size V (bytes,
full array), giving
one latency a (s) and one bandwidth W (bytes/s); on a mesh with several data-parallel axes the
same fit over each axis alone gives that axis's link (``Hardware.links``); and FLOP/s from a
per-device f32 matmul, 2 n^3 / t; and the share of compute a collective runs behind
(:func:`measure_overlap`).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from osdp_jax.core.hardware import Hardware, default_hardware, load, save
from osdp_jax.core.strategies import axes_size, axis_entry, data_axes

DEFAULT_SIZES = (2**16, 2**18, 2**20, 2**22, 2**24)  # bytes per collective


def _time(fn, arg, repeats: int) -> float:
    jax.block_until_ready(fn(arg))  # compile and warm up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def collective_times(mesh, axes, sizes=DEFAULT_SIZES, repeats: int = 5) -> dict[str, list[tuple[int, float]]]:
    """Median seconds of all-gather, reduce-scatter and all-reduce for each message size (bytes)."""
    n = axes_size(mesh, axes)
    entry = axis_entry(axes)
    sharded = NamedSharding(mesh, P(entry))
    ops = {
        "all_gather": (lambda x: jax.lax.all_gather(x, axes, tiled=True), P(entry), P()),
        "reduce_scatter": (lambda x: jax.lax.psum_scatter(x, axes, tiled=True), P(), P(entry)),
        "all_reduce": (lambda x: jax.lax.psum(x, axes), P(), P()),
    }
    out = {}
    for name, (body, in_spec, out_spec) in ops.items():
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))
        rows = []
        for size in sizes:
            elems = max(n, size // 4 // n * n)
            x = jax.device_put(jnp.ones((elems,), jnp.float32),
                               sharded if in_spec != P() else NamedSharding(mesh, P()))
            rows.append((elems * 4, _time(fn, x, repeats)))
        out[name] = rows
    return out


def fit_ring(times: dict, n: int) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of the ring model, least squares in *relative* error so small
    messages (latency-bound) count as much as large ones."""
    factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
    a_rows, t = [], []
    for name, rows in times.items():
        for nbytes, seconds in rows:
            a_rows.append([1.0, factor[name] * nbytes])
            t.append(seconds)
    a_rows, t = np.array(a_rows), np.array(t)
    (latency, inv_bw), *_ = np.linalg.lstsq(a_rows / t[:, None], np.ones_like(t), rcond=None)
    return max(float(latency), 0.0), 1.0 / max(float(inv_bw), 1e-30)


def matmul_flops(mesh, axes, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s per device: every device multiplies its own n x n f32 matrices, 2 n^3 / t."""
    fn, x = _per_device_matmul(mesh, axes, n)
    return 2 * n**3 / _time(fn, x, repeats)


def _per_device_matmul(mesh, axes, n: int):
    """``(step, operand)``: every device squares its own ``n x n`` f32 matrix."""
    entry = axis_entry(axes)
    x = jax.device_put(jnp.ones((axes_size(mesh, axes), n, n), jnp.float32) * 0.01, NamedSharding(mesh, P(entry)))
    fn = jax.jit(jax.shard_map(lambda a: (a[0] @ a[0])[None], mesh=mesh, in_specs=P(entry),
                               out_specs=P(entry), check_vma=False))
    return fn, x


def measure_overlap(mesh, axes, n: int = 512, repeats: int = 5) -> tuple[float, dict]:
    """The share of compute that a collective runs behind on ``mesh``: every device multiplies its
    own ``n x n`` f32 matrices (F seconds alone) while an all-gather it does not depend on runs (C
    alone), both in one step (B); with ``B = F + max(0, C - overlap * F)``, ``overlap =
    (F + C - B) / F``, clamped to [0, 1]. The all-gather is sized to take about F alone (its
    bytes from a first timing at 1 MiB), where the formula resolves the overlap best. Returns the
    overlap and the three medians."""
    devices = axes_size(mesh, axes)
    entry = axis_entry(axes)
    matmul, mats = _per_device_matmul(mesh, axes, n)

    def timed_gather(elems):
        x = jax.device_put(jnp.ones((elems,), jnp.float32), NamedSharding(mesh, P(entry)))
        fn = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, axes, tiled=True), mesh=mesh, in_specs=P(entry),
                                   out_specs=P(), check_vma=False))
        return x, _time(fn, x, repeats)

    f = _time(matmul, mats, repeats)
    elems = 2**18 // devices * devices
    _, c1 = timed_gather(elems)
    elems = max(devices, int(elems * f / max(c1, 1e-9)) // devices * devices)
    x, c = timed_gather(elems)
    both = jax.jit(jax.shard_map(lambda a, v: ((a[0] @ a[0])[None], jax.lax.all_gather(v, axes, tiled=True)),
                                 mesh=mesh, in_specs=(P(entry), P(entry)), out_specs=(P(entry), P()),
                                 check_vma=False))
    b = _time(lambda args: both(*args), (mats, x), repeats)
    overlap = min(1.0, max(0.0, (f + c - b) / f))
    return overlap, {"compute_s": f, "all_gather_s": c, "all_gather_bytes": elems * 4, "both_s": b}


def profile(mesh, axis=None, sizes=DEFAULT_SIZES, repeats: int = 5) -> tuple[Hardware, dict]:
    """Measure ``mesh``: collective times over message sizes and per-device matmul FLOP/s.

    All-gather, reduce-scatter and all-reduce are timed at each size (the median of ``repeats``
    runs) and fitted to the ring model, ``t = a + (N-1)/N V/W`` per all-gather, by least squares
    in relative error; ``osdp-jax profile`` calls it.

    Args:
      mesh: the mesh measured.
      axis: the data-parallel axis name(s) measured (default: all of the mesh's axes).
      sizes: message sizes in bytes.
      repeats: runs per measurement; the median is kept.

    Returns:
      ``(hardware, measurements)``: the fitted :class:`Hardware` and the raw times.
    """
    axes = data_axes(mesh, axis)
    n = axes_size(mesh, axes)
    times = collective_times(mesh, axes, sizes, repeats)
    latency, bandwidth = fit_ring(times, n)
    flops = matmul_flops(mesh, axes, repeats=repeats)
    overlap, overlap_times = measure_overlap(mesh, axes, repeats=repeats)
    base = default_hardware(mesh, measure=False)
    when = datetime.date.today().isoformat()
    where = f"measured by osdp-jax profile on {when}, {n} {mesh.devices.flat[0].platform} devices"
    # on a mesh with several data-parallel axes, each axis's link is measured on its own
    links, per_axis = {}, {}
    if len(axes) > 1:
        for axis in axes:
            per_axis[axis] = collective_times(mesh, (axis,), sizes, repeats)
            a, w = fit_ring(per_axis[axis], mesh.shape[axis])
            links[axis] = {"bandwidth": w, "latency": a}
    hw = dataclasses.replace(
        base, name=f"measured-{mesh.devices.flat[0].platform}", flops=flops, bandwidth=bandwidth,
        latency=latency, links=links, overlap=overlap,
        sources={**base.sources,
                 "flops": f"{where}: f32 matmul 1024^3 per device, median of {repeats}",
                 "bandwidth": f"{where}: ring-model fit of all-gather/reduce-scatter/"
                              f"all-reduce over {len(sizes)} sizes, over all data axes {list(axes)}",
                 "latency": f"{where}: intercept of the same fit",
                 "overlap": f"{where}: a matmul and an all-gather it does not wait on, alone and in one step "
                            f"(measure_overlap), median of {repeats}",
                 **({"links": f"{where}: the same fit over each axis alone"} if links else {})})
    return hw, {"collectives": times, "fit": {"latency_s": latency, "bandwidth_bytes_per_s": bandwidth},
                "matmul_flops_per_s": flops, "overlap": overlap_times,
                "per_axis": {a: {"collectives": per_axis[a], "fit": links[a]} for a in per_axis}}


CACHE_ENV = "OSDP_JAX_HARDWARE_CACHE"  # the folder of measured CPU profiles (default below)
DEFAULT_CACHE = "~/.cache/osdp-jax/hardware"
_MEASURED: dict = {}  # in-process: cache file -> Hardware


def cpu_profile_path(mesh) -> pathlib.Path:
    """Where :func:`cached_cpu_profile` keeps ``mesh``'s measured profile: one file per device
    count, mesh shape, CPU count, jax version and ``XLA_FLAGS`` (each changes what a collective
    costs), under ``$OSDP_JAX_HARDWARE_CACHE`` or ``~/.cache/osdp-jax/hardware``."""
    key = json.dumps([mesh.devices.size, dict(mesh.shape), os.cpu_count(), jax.__version__,
                      os.environ.get("XLA_FLAGS", "")], sort_keys=True)
    name = f"cpu-{mesh.devices.size}dev-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    return pathlib.Path(os.path.expanduser(os.environ.get(CACHE_ENV, DEFAULT_CACHE))) / name


def cached_cpu_profile(mesh) -> Hardware:
    """The measured :class:`Hardware` of a CPU ``mesh``: :func:`profile` (over all its axes) the
    first time on this machine, a few seconds, kept as an ``osdp-jax profile`` file
    (:func:`cpu_profile_path`) and read back after. A folder that cannot be written keeps it in
    the process only."""
    path = cpu_profile_path(mesh)
    if path in _MEASURED:
        return _MEASURED[path]
    try:
        hw = load(path)
    except (OSError, ValueError):
        hw, measurements = profile(mesh)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            save(hw, tmp, measurements)
            os.replace(tmp, path)  # whole or absent, with several processes measuring at once
        except OSError:
            pass
    _MEASURED[path] = hw
    return hw
