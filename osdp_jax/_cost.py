"""Cost model: per-device memory (bytes) and time (seconds) of each strategy for each parameter.

Notation, per parameter i: p_i its bytes, o_i the bytes of its optimizer state (from
``jax.eval_shape(optimizer.init, params)``, e.g. 2 p_i for Adam in the parameter dtype), N the
data-parallel device count.

Memory held for the whole step (the step's arguments; outputs alias them by donation)::

    replicate:  p_i + o_i
    zero3:      (p_i + o_i) / N

Transient memory (XLA's temp) is not a sum of per-parameter terms in general: it depends on how
long XLA keeps each gathered weight and gradient buffer alive. For the step of ``_train.py``,
which gathers every zero3 weight before the loss runs, XLA keeps all gathered weights alive at
once, so the temp grows with the zero3 bytes. The model is calibrated on two compiles of the real
step per batch size, all-replicate (temp_R) and all-zero3 (temp_Z)::

    temp(plan) = temp_R + kappa * sum_{i zero3} p_i,   kappa = (temp_Z - temp_R) / sum_{i shardable} p_i

Without a loss function to compile, temp is estimated as 2 p_i per parameter (its gradient plus a
collective buffer, or a gathered weight plus its gradient) and activations are not counted.

Time per step: compute + communication, not overlapped::

    compute    = FLOPs per device (XLA cost_analysis) / Hardware.flops
    replicate: all-reduce(p_i)                                  = a + 2(N-1)/N p_i / W
    zero3:     all-gather(p_i) + reduce-scatter(p_i)            = 2a + 2(N-1)/N p_i / W

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
    """Per-parameter costs for one batch size: ``time[i, s]`` s, ``mem[i, s]`` bytes per device.

    ``inf`` marks a strategy the parameter cannot take. The step's peak is
    ``base_mem + sum_i mem[i, s_i]`` and its time ``base_time + sum_i time[i, s_i]``.
    """

    strategies: tuple[str, ...]
    time: np.ndarray
    mem: np.ndarray
    base_mem: float
    base_time: float


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


def comm_seconds(nbytes: float, strategy: str, hw: Hardware, n: int) -> float:
    """Seconds of collectives per step for one parameter of ``nbytes`` (formulas in the module doc)."""
    if strategy == "replicate":
        return hw.all_reduce(nbytes, n)
    if strategy == "zero3":
        return GATHERS_PER_STEP * hw.all_gather(nbytes, n) + hw.reduce_scatter(nbytes, n)
    raise ValueError(f"unknown strategy {strategy!r}")


def cost_tables(infos: list[ParamInfo], available: np.ndarray, strategies: tuple[str, ...],
                opt_bytes: np.ndarray, other_opt_bytes: int, n: int, hw: Hardware,
                batch_bytes: int, calibration: Calibration | None) -> CostTables:
    """Cost tables for one batch size.

    Args:
      infos: the parameters.
      available: ``(n_params, n_strategies)`` bool, whether parameter i can take strategy s.
      strategies: strategy names, the columns.
      opt_bytes: optimizer-state bytes per parameter; ``other_opt_bytes`` the rest of the state.
      n: data-parallel devices.
      hw: hardware for the time model.
      batch_bytes: bytes of the *global* batch (each device holds 1/n).
      calibration: XLA figures for this batch size, or None to use the uncalibrated estimate.
    """
    p = np.array([i.nbytes for i in infos], dtype=np.float64)
    o = opt_bytes.astype(np.float64)
    shardable = np.array([i.nbytes for i, ok in zip(infos, available[:, strategies.index("zero3")])
                          if ok] if "zero3" in strategies else [], dtype=np.float64).sum()
    mem = np.full((len(infos), len(strategies)), np.inf)
    time = np.full_like(mem, np.inf)
    if calibration is None:
        kappa = 0.0
        transient = 2 * p
        base_mem = other_opt_bytes + batch_bytes / n
        base_time = 0.0
    else:
        r, z = calibration.replicate, calibration.zero3
        kappa = (z.temp_bytes - r.temp_bytes) / shardable if shardable else 0.0
        transient = np.zeros_like(p)
        # arguments other than params/opt state (the batch), plus temp and the unaliased outputs
        base_mem = (r.argument_bytes - (p + o).sum()) + r.output_bytes - r.alias_bytes + r.temp_bytes
        base_time = r.flops / hw.flops
    for s, name in enumerate(strategies):
        ok = available[:, s]
        if name == "replicate":
            held = p + o
        else:
            held = (p + o) / n + kappa * p
        mem[ok, s] = (held + transient)[ok]
        time[ok, s] = [comm_seconds(b, name, hw, n) for b in p[ok]]
    return CostTables(strategies, time, mem, float(base_mem), float(base_time))
