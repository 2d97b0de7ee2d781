"""What units and the remat policies keep alive, by XLA's figures (compile-only).

Three measurements behind statements in the README and in the docstrings of
``osdp_jax.runtime.units`` and ``osdp_jax.core.stack``, on 8 simulated CPU devices, temp bytes per
device of the compiled step:

1. Eight unrolled blocks ``x = tanh(x @ W)``, W 1024x1024 f32 (4 MiB) sharded 8 ways, gathered
   inside ``jax.checkpoint`` (the backward pass gathers again): in straight-line code, and inside
   an always-true ``lax.cond`` (what ``osdp_jax.runtime.units`` does).
2. An unrolled 8-block einsum transformer (``tests/foreign.py``), FSDP with units,
   under each unit remat policy.
3. An 8-layer ZeRO-3 layer stack of 512x512 f32 layers (1 MiB) under each remat policy, and under
   "none" as it was (``save_anything_except_these_names``, which saved the gathers' outputs).

Writes experiments/results/units_memory.md.

Run: python experiments/benchmarks/units_memory.py
"""
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[2]),
                str(pathlib.Path(__file__).resolve().parents[2] / "tests")]

import foreign  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax import Collective  # noqa: E402
from osdp_jax.core.stack import GATHERED_NAME, save_all_but_gathered  # noqa: E402
from osdp_jax.runtime import stack as runtime_stack  # noqa: E402
from osdp_jax.runtime.collectives import gather  # noqa: E402

MIB = 2**20


def unrolled_gathers(in_cond: bool) -> float:
    mesh = jax.make_mesh((8,), ("data",))
    how = Collective(("data",))

    def inner(w, x):
        return jnp.tanh(x @ checkpoint_name(gather(w, 0, how), GATHERED_NAME))

    run = jax.checkpoint(inner, policy=save_all_but_gathered)

    def unit(w, x):
        if not in_cond:
            return run(w, x)
        return jax.lax.cond(jax.lax.axis_index("data") >= 0, run, lambda w, x: jnp.zeros_like(x), w, x)

    def body(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = unit(w, h)
            return (h ** 2).sum()
        return jax.grad(loss)(ws)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"),
                              check_vma=False))
    sharding = NamedSharding(mesh, P("data"))
    ws = [jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=sharding) for _ in range(8)]
    x = jax.ShapeDtypeStruct((16, 1024), jnp.float32, sharding=sharding)
    return f.lower(ws, x).compile().memory_analysis().temp_size_in_bytes


def unit_policies() -> dict:
    mesh = jax.make_mesh((8,), ("data",))
    params, loss_fn, batch = foreign.einsum_lm(layers=8, d=256, vocab=512, batch=16, seq=64)
    units = osdp_jax.units.find(loss_fn, params, batch)
    out = {"no units": osdp_jax.profile_step(loss_fn, optax.adam(1e-3), params, batch, mesh,
                                             osdp_jax.Layout.fsdp(params, mesh)).temp_bytes}
    for policy in osdp_jax.layers.REMAT_POLICIES:
        layout = osdp_jax.Layout.fsdp(params, mesh, units=units, unit_remat=policy)
        out[f"units, {policy}"] = osdp_jax.profile_step(loss_fn, optax.adam(1e-3), params, batch, mesh,
                                                        layout).temp_bytes
    return out


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(x @ self.param("w", nn.initializers.normal(0.02), (512, 512)))


class StackModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return osdp_jax.layers.Stack(Block(), length=8, name="blocks")(x).mean()


def stack_policies() -> dict:
    mesh = jax.make_mesh((8,), ("data",))
    model, x = StackModel(), jnp.ones((16, 512))
    params = model.init(jax.random.key(0), x)["params"]

    def loss(p, b):
        return model.apply({"params": p}, b)
    in_loop, _ = osdp_jax.discover(loss, params, x)

    def temp(policy):
        layout = osdp_jax.Layout.fsdp(params, mesh, in_loop=in_loop, remat=policy)
        return osdp_jax.profile_step(loss, optax.sgd(0.1), params, x, mesh, layout).temp_bytes
    out = {policy: temp(policy) for policy in osdp_jax.layers.REMAT_POLICIES}
    current = runtime_stack.remat_policy
    runtime_stack.remat_policy = lambda p: (jax.checkpoint_policies.save_anything_except_these_names(GATHERED_NAME)
                                            if p == "none" else current(p))
    try:
        out["none, as it was"] = temp("none")
    finally:
        runtime_stack.remat_policy = current
    return out


def main():
    lines = ["# What units and remat policies keep alive", "",
             "Measured with `python experiments/benchmarks/units_memory.py` (XLA's temp bytes per device,",
             "compile-only, 8 simulated CPU devices).", "",
             "## 1. Eight unrolled blocks of 4 MiB weights, gathered under jax.checkpoint", "",
             "| where the gathers run | temp |", "|---|---|"]
    for label, in_cond in (("straight-line code", False), ("inside an always-true lax.cond (units)", True)):
        lines.append(f"| {label} | {unrolled_gathers(in_cond) / MIB:.1f} MiB |")
    lines += ["", "## 2. Unrolled 8-block einsum transformer (d 256), FSDP, unit remat policies", "",
              "| layout | temp |", "|---|---|"]
    lines += [f"| {k} | {v / MIB:.1f} MiB |" for k, v in unit_policies().items()]
    lines += ["", "## 3. Eight-layer ZeRO-3 stack of 1 MiB layers, remat policies", "", "| policy | temp |",
              "|---|---|"]
    lines += [f"| {k} | {v / MIB:.1f} MiB |" for k, v in stack_policies().items()]
    text = "\n".join(lines) + "\n"
    print(text)
    pathlib.Path("experiments/results/units_memory.md").write_text(text)


if __name__ == "__main__":
    main()
