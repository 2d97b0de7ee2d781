"""Operator splitting, measured: per split count k, XLA's per-device temp and peak, the collectives
in the HLO (inside / outside loops) and the step time relative to k=1 in the same run.

Two parts, 8 simulated devices:

1. a wide FFN (``flax.linen.Dense`` D -> 4D -> D, every kernel zero3 and split in k), compiled and
   run: step times are medians over interleaved rounds, so every k sees the same machine load;
2. the ``opt-30b-8l`` preset (batch 8, sequence 512), FSDP with per-layer gathering and every
   dense kernel split in k, compile-only (5.3B parameters do not train on a CPU), plus its layer
   FFN shape (7168 -> 28672 -> 7168) at a few tokens per device, compiled and run.

Run: python experiments/benchmarks/split.py [--d 1024] [--tokens 512] [--rounds 7] [--skip-opt]
Writes experiments/results/split.md (and prints it).
"""
import argparse
import os
import pathlib
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import osdp_jax  # noqa: E402
from osdp_jax.xla import collectives_by_place  # noqa: E402

KS = (1, 2, 4, 8)
AXES = ("data",)
f = osdp_jax.format_bytes


class FFN(nn.Module):
    d: int
    hidden: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.d, use_bias=False)(jax.nn.gelu(nn.Dense(self.hidden, use_bias=False)(x)))


def _places(compiled):
    c = collectives_by_place(compiled.as_text())
    short = lambda d: "/".join(str(d[op]) for op in ("all-gather", "reduce-scatter", "all-reduce"))  # noqa: E731
    return short(c["in_loop"]), short(c["outside"])


def ffn_rows(mesh, d, hidden, tokens, rounds, label):
    """Compile and time the FFN for each k; rows of (k, temp, peak, in-loop, outside, median s)."""
    model = FFN(d, hidden)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, d)))["params"]
    batch = jax.random.normal(jax.random.key(1), (8 * tokens, d))
    loss_fn = lambda p, x: jnp.mean((model.apply({"params": p}, x) - x) ** 2)  # noqa: E731
    opt = optax.sgd(1e-3)
    specs = {"Dense_0/kernel": P("data"), "Dense_1/kernel": P("data")}
    steps, facts = {}, {}
    for k in KS:
        if hidden % (8 * k) or d % (8 * k):
            continue
        layout = osdp_jax.Layout.from_specs(params, mesh, specs, splits={p: k for p in specs}, dense=set(specs))
        compiled = osdp_jax.compile_step(loss_fn, opt, params, batch, mesh, layout)
        prof = osdp_jax.profile_compiled(compiled)
        facts[k] = (prof.temp_bytes, prof.peak_bytes, *_places(compiled))
        steps[k] = compiled
    state = {}
    layout = osdp_jax.Layout.from_specs(params, mesh, specs)
    for k in steps:
        sp = osdp_jax.shard(params, mesh, layout)
        state[k] = [sp, osdp_jax.init_opt_state(opt, sp, layout, mesh)]
        out = steps[k](*state[k], batch)  # warm-up
        state[k] = list(out[:2])
    times = {k: [] for k in steps}
    for _ in range(rounds):  # interleaved: every k sees the same load
        for k in steps:
            t0 = time.perf_counter()
            out = steps[k](*state[k], batch)
            jax.block_until_ready(out)
            times[k].append(time.perf_counter() - t0)
            state[k] = list(out[:2])
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [f"\n## {label}\n",
            "| k | temp (XLA) | peak (XLA) | in-loop AG/RS/AR | outside AG/RS/AR | median step | vs k=1 |",
            "|---|---|---|---|---|---|---|"]
    for k in steps:
        temp, peak, inside, outside = facts[k]
        rows.append(f"| {k} | {f(temp)} | {f(peak)} | {inside} | {outside} | {med[k] * 1e3:.1f} ms "
                    f"| {med[k] / med[1]:.3f} |")
    return rows, {k: facts[k][0] for k in facts}, {k: med[k] / med[1] for k in med}


def opt_rows():
    """opt-30b-8l, FSDP per layer, every dense kernel split in k: compile-only."""
    from osdp_jax.cli import config, runner
    cfg = config.load("experiments/paper/opt_30b_8l.toml", {"plan.batch_sizes": "8"})
    s = runner.setup(cfg)
    params, batch = s.abstract_params(), s.abstract_batch(8)
    infos = osdp_jax.describe(params)
    loop, splittable = osdp_jax.discover(s.loss_fn, params, batch)
    fsdp = osdp_jax.Layout.fsdp(params, s.mesh, in_loop=loop, dense=splittable - loop)
    rows = ["\n## opt-30b-8l (5.3B parameters), batch 8, sequence 512, FSDP gathered per layer, Adam: compile-only\n",
            f"split kernels: {sorted(splittable)}\n",
            "| k | temp (XLA) | peak (XLA) | in-loop AG/RS/AR | outside AG/RS/AR |", "|---|---|---|---|---|"]
    for k in KS:
        splits = {p: k for p in splittable
                  if k > 1 and next(i for i in infos if i.path == p).shape[1 if p in loop else 0] % (8 * k) == 0}
        layout = osdp_jax.Layout.from_specs(params, s.mesh, fsdp.specs_by_path, in_loop=loop, splits=splits,
                                            dense=splittable - loop)
        compiled = osdp_jax.compile_step(s.loss_fn, s.optimizer, params, batch, s.mesh, layout)
        prof = osdp_jax.profile_compiled(compiled)
        rows.append(f"| {k} ({len(splits)} kernels split) | {f(prof.temp_bytes)} | {f(prof.peak_bytes)} | "
                    + " | ".join(_places(compiled)) + " |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per device in the wide FFN")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-opt", action="store_true")
    ap.add_argument("--out", default="experiments/results/split.md")
    args = ap.parse_args()
    mesh = jax.make_mesh((8,), AXES, axis_types=(jax.sharding.AxisType.Auto,))
    lines = ["# Operator splitting, measured",
             "", "Made by `python experiments/benchmarks/split.py` on 8 simulated CPU devices. temp/peak: "
             "XLA's per-device figures of the compiled step (measured); collectives counted in the "
             "compiled HLO, inside while loops (run once per iteration) and outside; step times are "
             "medians over interleaved rounds in one run (measured), relative to k=1."]
    rows, _, ratio = ffn_rows(mesh, args.d, 4 * args.d, args.tokens, args.rounds,
                              f"wide FFN {args.d} -> {4 * args.d} -> {args.d}, {args.tokens} tokens per device, SGD")
    lines += rows
    if not args.skip_opt:
        rows, _, _ = ffn_rows(mesh, 7168, 28672, 8, 3,
                              "opt-30b-8l layer FFN 7168 -> 28672 -> 7168, 8 tokens per device, SGD")
        lines += rows
        lines += opt_rows()
    text = "\n".join(lines) + "\n"
    print(text)
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
