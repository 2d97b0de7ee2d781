"""Ask XLA: compile a sharded step with abstract inputs and read its memory, FLOPs and collectives."""
from __future__ import annotations

import collections
import dataclasses
import math
import re
import statistics
import time
import weakref

import jax
import jax.numpy as jnp

_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """What XLA reports for one compiled step, per device.

    ``peak_bytes = argument + output - alias + temp`` (bytes): on CPU ``peak_memory_in_bytes``
    leaves temp out, so the step's peak is assembled from its parts.
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    collectives: dict

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


_COLLECTIVE_OP = re.compile(r"[\s)}](" + "|".join(map(re.escape, _COLLECTIVES)) + r")(?:-start)?\(")


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Occurrences of each collective op in compiled HLO text (async start ops counted once), in
    one pass over the text (not one search per op)."""
    found = collections.Counter(_COLLECTIVE_OP.findall(hlo_text))
    return {op: found.get(op, 0) for op in _COLLECTIVES}


def _computations(hlo_text: str) -> dict[str, str]:
    """HLO module text -> {computation name: its text}."""
    comps, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if name is None and head:
            name, lines = head.group(1), []
        elif name is not None and line.startswith("}"):
            comps[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return comps


def collectives_by_place(hlo_text: str) -> dict[str, dict[str, int]]:
    """Collectives counted separately ``"in_loop"`` (inside any while body, run once per
    iteration) and ``"outside"`` (run once per step)."""
    comps = _computations(hlo_text)
    refs = {n: set(re.findall(r"(?:body|condition|calls|to_apply)=%?([\w.\-]+)", t)) for n, t in comps.items()}
    inside = {b for t in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", t)}
    todo = list(inside)
    while todo:
        for r in refs.get(todo.pop(), ()):
            if r not in inside:
                inside.add(r)
                todo.append(r)
    return {"in_loop": count_collectives("\n".join(t for n, t in comps.items() if n in inside)),
            "outside": count_collectives("\n".join(t for n, t in comps.items() if n not in inside))}


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                yield inner


def _dot_general_flops(eqn) -> float:
    """A ``dot_general`` equation's FLOPs: ``2 * prod(out) * prod(contracted)``."""
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)


def _dot_flops(jaxpr) -> tuple[float, float]:
    """``(every iteration, each loop body once)`` matmul FLOPs of a jaxpr (:func:`_dot_general_flops`
    per ``dot_general``), a ``scan`` body times its length in the first figure and once in the
    second; other sub-jaxprs (jit, remat, custom_vjp, shard_map) as they come."""
    every = once = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            flops = _dot_general_flops(eqn)
            every, once = every + flops, once + flops
            continue
        subs = [_dot_flops(j) for j in _sub_jaxprs(eqn)]
        if not subs:
            continue
        if eqn.primitive.name == "cond":  # one branch runs
            e, o = max(subs)
        else:
            e, o = sum(x[0] for x in subs), sum(x[1] for x in subs)
        every += e * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        once += o
    return every, once


REMAT_PRIMITIVES = ("checkpoint", "remat", "remat2")  # jax.checkpoint's primitive, as jaxprs name it


def matmul_flops(jaxpr, *, remat_only: bool = False, branch=max) -> float:
    """The matmul FLOPs of a jaxpr's every iteration (:func:`_dot_general_flops` per
    ``dot_general``), a ``scan`` body times its length, one branch of a ``cond`` (``branch`` of
    theirs: ``min`` for a lower bound), other sub-jaxprs as they come; ``remat_only``: only those
    inside a ``jax.checkpoint``."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            total += 0.0 if remat_only else _dot_general_flops(eqn)
            continue
        inside = remat_only and eqn.primitive.name not in REMAT_PRIMITIVES
        subs = [matmul_flops(j, remat_only=inside, branch=branch) for j in _sub_jaxprs(eqn)]
        if not subs:
            continue
        flops = branch(subs) if eqn.primitive.name == "cond" else sum(subs)
        total += flops * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    return total


def loop_flops(jaxpr) -> float:
    """The matmul FLOPs XLA's ``cost_analysis`` leaves out of a step: it counts a loop's body once,
    whatever its trip count (a scan of 16 layers reports the FLOPs of 1), so the iterations after
    the first are added from the step's jaxpr (matmuls only: what dominates a layer)."""
    every, once = _dot_flops(getattr(jaxpr, "jaxpr", jaxpr))
    return every - once


def profile_compiled(compiled, missing_flops: float = 0.0) -> StepProfile:
    """XLA's figures of a compiled step; ``missing_flops`` (:func:`loop_flops`) are added to its
    FLOPs. Kept with the executable while it lives: reading them searches the HLO text, and each
    plan of a budget sweep reads a kept step's again."""
    try:
        found = _PROFILES.get(compiled)
    except TypeError:  # not weakly referable: read every time
        return _profile(compiled, missing_flops)
    if found is None or found[0] != missing_flops:
        found = _PROFILES[compiled] = (missing_flops, _profile(compiled, missing_flops))
    return found[1]


_PROFILES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _profile(compiled, missing_flops: float) -> StepProfile:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per program
        cost = cost[0] if cost else {}
    return StepProfile(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                       int(mem.alias_size_in_bytes), int(mem.temp_size_in_bytes),
                       float((cost or {}).get("flops", 0.0)) + missing_flops, count_collectives(compiled.as_text()))


def time_compiled(compiled, abstract, repeats: int = 5) -> float:
    """Median seconds of ``repeats`` real runs of a compiled step (after one warm-up run).

    ``abstract`` are its ``(params, opt_state, batch)`` as ``ShapeDtypeStruct`` with shardings;
    they are allocated as zeros on the mesh (the step's arithmetic does not depend on the values).
    Params and optimizer state are donated, so each run feeds the previous run's outputs.
    """
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    params, state, batch = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract),
                                   out_shardings=shardings)()
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        params, state, loss = compiled(params, state, batch)
        jax.block_until_ready(loss)
        if i:
            times.append(time.perf_counter() - t0)
    jax.block_until_ready((params, state))
    return statistics.median(times)
