"""Cost model: per-device memory (bytes) and time (seconds) of each strategy for each parameter.

Notation, per parameter i: p_i its bytes, o_i the bytes of its optimizer state (from
``jax.eval_shape(optimizer.init, params)``, e.g. 2 p_i for Adam in the parameter dtype), N the
data-parallel device count.

Memory held for the whole step (the step's arguments; outputs alias them by donation)::

    replicate:  p_i + o_i
    zero3:      (p_i + o_i) / N

Transient memory (XLA's temp) is not a sum of per-parameter terms: it is set by which buffers XLA
keeps alive together. For the step of ``_train.py`` (every zero3 weight gathered before the loss
runs) the measured pattern is: replicated gradients (R bytes in all) live until the update, and at
the peak either XLA's combined all-reduce buffer for them (rho R) or the gathered zero3 weights
with their full-size gradients (zeta Z, Z the zero3 bytes) is alive, not both::

    temp(plan) = c + R + max(rho * R, zeta * Z)          rho = 1

A stacked parameter the model gathers per layer inside its loop (``osdp_jax.gather_params``)
counts p_i / L_i in Z: one layer's slice is alive at a time.

Per batch size, two compiles of the real step calibrate it: all-replicate gives the activation
and scratch term ``c = temp_R - 2 P`` (P all parameter bytes), all-zero3 gives
``zeta = (temp_Z - c - R_fixed) / Z_all`` (R_fixed: bytes no strategy but replicate can hold).
Without a loss function to compile: c = 0 (activations not counted) and zeta = 2 (gathered
weight plus its gradient), an estimate.

The max makes the search a two-pool knapsack (``_search.solve_pools``), solved exactly.

Time per step: compute + communication, not overlapped::

    compute    = FLOPs per device (XLA cost_analysis) / Hardware.flops
    replicate: all-reduce(p_i)                                  = a + 2(N-1)/N p_i / W
    zero3:     all-gather(p_i) + reduce-scatter(p_i)            = 2a + 2(N-1)/N p_i / W
    zero3, gathered per layer (L_i layers, re-gathered in the backward pass):
               L_i (2 all-gather + reduce-scatter)(p_i / L_i)   = 3 L_i a + 3(N-1)/N p_i / W

(one all-gather: this step keeps the gathered weight for the backward pass instead of gathering
it again).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from ._describe import ParamInfo
from ._hardware import Hardware
from ._xla import StepProfile

GATHERS_PER_STEP = 1  # all-gathers of one zero3 weight per step in _train.py


@dataclasses.dataclass(frozen=True)
class CostTables:
    """Per-parameter costs for one batch size, per device.

    ``time[i, s]`` seconds; ``mem[i, s]`` bytes held through the step; ``pools[i, s, k]`` transient
    bytes in pool k (0: replicated-gradient buffer, 1: gathered zero3 weights). ``inf`` marks a
    strategy the parameter cannot take. Peak = ``base_mem + sum mem + max_k sum pools[..., k]``;
    step time = ``base_time + sum time``.
    """

    strategies: tuple[str, ...]
    time: np.ndarray
    mem: np.ndarray
    pools: np.ndarray
    base_mem: float
    base_time: float

    def peak(self, choices) -> float:
        idx = np.arange(len(choices))
        return float(self.base_mem + self.mem[idx, choices].sum() + self.pools[idx, choices].sum(axis=0).max())


@dataclasses.dataclass(frozen=True)
class Calibration:
    """XLA's figures for one batch size, from the all-replicate and all-zero3 compiles."""

    replicate: StepProfile
    zero3: StepProfile


def optimizer_bytes(optimizer, params) -> tuple[np.ndarray, int]:
    """Optimizer-state bytes per parameter leaf, and bytes of state tied to no parameter.

    >>> import jax.numpy as jnp
    >>> optimizer_bytes(optax.adam(1e-3), {"w": jax.ShapeDtypeStruct((4,), jnp.float32)})[0]
    array([32])
    """
    state = jax.eval_shape(optimizer.init, params)
    leaves, treedef = jax.tree.flatten(params)
    index = jax.tree.unflatten(treedef, list(range(len(leaves))))
    per_leaf = np.zeros(len(leaves), dtype=np.int64)

    def add(x, i):
        per_leaf[i] += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        return x

    optax.tree_map_params(optimizer, add, state, index, transform_non_params=lambda x: x)
    total = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    return per_leaf, total - int(per_leaf.sum())


def comm_seconds(nbytes: float, strategy: str, hw: Hardware, n: int, layers: int = 0) -> float:
    """Seconds of collectives per step for one parameter of ``nbytes`` (formulas in the module doc).

    ``layers`` > 0: a stacked parameter gathered per layer inside the model's loop, so each of
    its collectives runs ``layers`` times on 1/layers of the bytes, and the backward pass gathers
    again (rematerialisation): 2 all-gathers and 1 reduce-scatter per layer.
    """
    if strategy == "replicate":
        return hw.all_reduce(nbytes, n)
    if strategy == "zero3" and layers:
        per = nbytes / layers
        return layers * (2 * hw.all_gather(per, n) + hw.reduce_scatter(per, n))
    if strategy == "zero3":
        return GATHERS_PER_STEP * hw.all_gather(nbytes, n) + hw.reduce_scatter(nbytes, n)
    raise ValueError(f"unknown strategy {strategy!r}")


def interpolate(probed: dict[int, Calibration], size: int) -> Calibration:
    """A calibration for ``size`` from two probed batch sizes, each figure linear in the batch."""
    (b0, c0), (b1, c1) = sorted(probed.items())
    w = (size - b0) / (b1 - b0)

    def mix(p0: StepProfile, p1: StepProfile) -> StepProfile:
        lin = lambda a, b: int(round(a + w * (b - a)))  # noqa: E731
        return StepProfile(lin(p0.argument_bytes, p1.argument_bytes), lin(p0.output_bytes, p1.output_bytes),
                           lin(p0.alias_bytes, p1.alias_bytes), lin(p0.temp_bytes, p1.temp_bytes),
                           p0.flops + w * (p1.flops - p0.flops), p0.collectives)

    return Calibration(mix(c0.replicate, c1.replicate), mix(c0.zero3, c1.zero3))


RHO = 1.0  # combined all-reduce buffer per replicated gradient byte
ZETA_ESTIMATE = 2.0  # uncalibrated: gathered weight + its full-size gradient


def cost_tables(infos: list[ParamInfo], available: np.ndarray, strategies: tuple[str, ...],
                opt_bytes: np.ndarray, other_opt_bytes: int, n: int, hw: Hardware,
                batch_bytes: int, calibration: Calibration | None,
                in_loop: frozenset = frozenset()) -> CostTables:
    """Cost tables for one batch size (formulas in the module docstring).

    Args:
      infos: the parameters.
      available: ``(n_params, n_strategies)`` bool, whether parameter i can take strategy s.
      strategies: strategy names, the columns.
      opt_bytes: optimizer-state bytes per parameter; ``other_opt_bytes`` the rest of the state.
      n: data-parallel devices.
      hw: hardware for the time model.
      batch_bytes: bytes of the *global* batch (each device holds 1/n).
      calibration: XLA figures for this batch size, or None for the uncalibrated estimate.
      in_loop: paths of stacked parameters the model gathers per layer; their gathered bytes
        count 1/layers (one layer's slice is alive at a time).
    """
    p = np.array([i.nbytes for i in infos], dtype=np.float64)
    layers = np.array([i.shape[0] if i.path in in_loop else 0 for i in infos])
    gathered = p / np.maximum(layers, 1)  # bytes alive when the parameter is gathered
    o = opt_bytes.astype(np.float64)
    can_shard = available[:, strategies.index("zero3")] if "zero3" in strategies else np.zeros(len(p), bool)
    z_all, r_fixed = gathered[can_shard].sum(), p[~can_shard].sum()
    if calibration is None:
        c, zeta, base_time = 0.0, ZETA_ESTIMATE, 0.0
        base_mem = other_opt_bytes + batch_bytes / n
    else:
        r, z = calibration.replicate, calibration.zero3
        c = r.temp_bytes - (1 + RHO) * p.sum()
        zeta = max(0.0, (z.temp_bytes - c - r_fixed) / z_all) if z_all else 0.0
        # the batch and state tied to no parameter, and outputs that do not alias an input
        base_mem = r.argument_bytes - (p + o).sum() + r.output_bytes - r.alias_bytes
        base_time = r.flops / hw.flops
    mem = np.full((len(infos), len(strategies)), np.inf)
    pools = np.zeros((len(infos), len(strategies), 2))
    time = np.full_like(mem, np.inf)
    for s, name in enumerate(strategies):
        ok = available[:, s]
        if name == "replicate":
            mem[ok, s] = (p + o + p)[ok]  # stored param and state, and its gradient
            pools[ok, s, 0] = RHO * p[ok]
        else:
            mem[ok, s] = ((p + o) / n)[ok]
            pools[ok, s, 1] = zeta * gathered[ok]
        time[ok, s] = [comm_seconds(b, name, hw, n, int(k)) for b, k in zip(p[ok], layers[ok])]
    return CostTables(strategies, time, mem, pools, float(base_mem + c), float(base_time))
