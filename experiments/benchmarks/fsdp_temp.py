"""The FSDP step's transient memory, decomposed: XLA temp = gradient shards + activations + the rest.

For the GPT-2 presets under FSDP (every parameter zero3, the layer stack gathered per layer inside
its scanned, rematerialised loop), 8 simulated devices, sequence 128, compile-only: XLA's temp at
two batch sizes gives ``temp(b) = W + A b`` (A: activations per sample, the part that grows with
the batch). ZeRO-3's bound is ``W <= gradient shards + two layers' gathered weights``: the
gradient shards (1/N of every parameter, ZeRO-3 model state) sit in XLA's temp because the
optimizer update reads them after the backward pass; at most two layers' gathered weights (one
layer's weights and its full-size gradient) may be alive besides.

Rows: osdp-jax's step (XLA:CPU memory-optimized scheduler), the same with XLA:CPU's default
(concurrency-optimized) scheduler, and gpt2-48l-1536 with BERT's unpadded 30,522-token vocabulary
(the embedding is then sharded along its feature dimension). Then the step-time cost of the
memory-optimized scheduler on this CPU: a 4-layer GPT-2 (d 256, vocab 1024, batch 32 x 128),
median of interleaved rounds, measured.

Run: python experiments/benchmarks/fsdp_temp.py [--rounds 15]
Writes experiments/results/fsdp_temp.md (and prints it).
"""
import argparse
import os
import pathlib
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import models  # noqa: E402
import osdp_jax  # noqa: E402
from models.gpt2 import GPT2, gpt2_config  # noqa: E402
from osdp_jax._gather import discover  # noqa: E402
from osdp_jax._strategies import spec_for  # noqa: E402
from osdp_jax._train import CPU_COMPILER_OPTIONS, abstract_args, build_step, spec_tree  # noqa: E402
from osdp_jax._xla import profile_compiled  # noqa: E402

AXES, N, SEQ = ("data",), 8, 128
MIB = 2**20


def _batch(b, seq=SEQ):
    return {"inputs": jax.ShapeDtypeStruct((b, seq), jnp.int32), "targets": jax.ShapeDtypeStruct((b, seq), jnp.int32),
            "weights": jax.ShapeDtypeStruct((b, seq), jnp.float32)}


def _setup(module, strategy="zero3"):
    params = models.abstract_params(module, SEQ)
    loss_fn = models.make_loss(module)
    loop = frozenset(discover(loss_fn, params, _batch(8))[0])
    infos = osdp_jax.describe(params)
    specs = {i.path: spec_for(i, strategy, AXES, N, i.path in loop) or P() for i in infos}
    return params, loss_fn, loop, infos, specs


def decompose(module, options) -> dict:
    """W, A and the bound's terms (MiB) for the FSDP step compiled with ``options``."""
    params, loss_fn, loop, infos, specs = _setup(module)
    mesh = jax.make_mesh((N,), AXES, axis_types=(jax.sharding.AxisType.Auto,))
    opt = optax.adam(1e-4)
    temp = {}
    for b in (8, 16):
        step = jax.jit(build_step(loss_fn, opt, mesh, AXES, specs, loop), donate_argnums=(0, 1),
                       compiler_options=options)
        temp[b] = profile_compiled(step.lower(*abstract_args(opt, params, _batch(b), mesh, AXES, specs)).compile()
                                   ).temp_bytes / MIB
    per_sample = (temp[16] - temp[8]) / 8
    grads = sum(i.nbytes for i in infos) / N / MIB
    layer = sum(i.nbytes / i.shape[0] for i in infos if i.path in loop) / MIB
    w = temp[8] - 8 * per_sample
    return {"temp8": temp[8], "temp16": temp[16], "A": per_sample, "W": w, "grads": grads, "layer": layer,
            "over_grads": w - grads, "holds": w <= grads + 2 * layer}


def time_schedulers(rounds: int) -> dict:
    """Median step seconds of a small GPT-2, FSDP and DDP, under both XLA:CPU schedulers."""
    module = GPT2(gpt2_config(n_layer=4, d_model=256, n_head=8, vocab_size=1024, max_len=SEQ))
    mesh = jax.make_mesh((N,), AXES, axis_types=(jax.sharding.AxisType.Auto,))
    params = models.init_params(module, SEQ, 0)
    rng = np.random.default_rng(0)
    batch = {"inputs": jnp.asarray(rng.integers(0, 1024, (32, SEQ)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, 1024, (32, SEQ)), jnp.int32),
             "weights": jnp.ones((32, SEQ), jnp.float32)}
    out = {}
    for name, strategy in (("FSDP", "zero3"), ("DDP", "replicate")):
        _, loss_fn, loop, _, specs = _setup(module, strategy)
        opt = optax.adam(1e-4)
        p = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, spec_tree(params, specs))
        o = opt.init(p)
        steps = {sched: jax.jit(build_step(loss_fn, opt, mesh, AXES, specs, loop), compiler_options=opts)
                 for sched, opts in (("concurrency", None), ("memory", CPU_COMPILER_OPTIONS))}
        times = {k: [] for k in steps}
        for f in steps.values():
            jax.block_until_ready(f(p, o, batch))
        for _ in range(rounds):
            for k, f in steps.items():
                t = time.perf_counter()
                jax.block_until_ready(f(p, o, batch))
                times[k].append(time.perf_counter() - t)
        out[name] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    cases = [("gpt2-48l-1536", models.get("gpt2-48l-1536")[0], "memory-optimized (osdp-jax)", CPU_COMPILER_OPTIONS),
             ("gpt2-48l-1536", models.get("gpt2-48l-1536")[0], "XLA:CPU default", None),
             ("gpt2-48l-1536, vocab 30,522", GPT2(gpt2_config(n_layer=48, d_model=1536, n_head=48, vocab_size=30522)),
              "memory-optimized (osdp-jax)", CPU_COMPILER_OPTIONS),
             ("gpt2-48l-2048", models.get("gpt2-48l-2048")[0], "memory-optimized (osdp-jax)", CPU_COMPILER_OPTIONS),
             ("gpt2-48l-2048", models.get("gpt2-48l-2048")[0], "XLA:CPU default", None)]
    lines = ["# FSDP temp: gradient shards + activations + two layers' gathered weights", "",
             "Measured (XLA's `memory_analysis`, compile-only) by `python experiments/benchmarks/fsdp_temp.py`: "
             f"FSDP, {N} simulated CPU devices, sequence {SEQ}, Adam. temp(b) = W + A b from batch 8 and 16; "
             "bound: W <= gradient shards + 2 layers' gathered weights.", "",
             "| model | scheduler | temp b=8 | temp b=16 | A per sample | W | gradient shards | W - shards | 2 layers | bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, module, sched, opts in cases:
        d = decompose(module, opts)
        lines.append(f"| {name} | {sched} | {d['temp8']:.1f} MiB | {d['temp16']:.1f} MiB | {d['A']:.2f} MiB | "
                     f"{d['W']:.1f} MiB | {d['grads']:.1f} MiB | {d['over_grads']:.1f} MiB | {2 * d['layer']:.1f} MiB | "
                     f"{'holds' if d['holds'] else 'exceeded'} |")
        print(lines[-1], flush=True)
    t = time_schedulers(args.rounds)
    lines += ["", f"Step time of the memory-optimized scheduler on this CPU (4-layer GPT-2, d 256, batch 32 x {SEQ}, "
              f"median of {args.rounds} interleaved rounds, measured):", "",
              "| plan | default scheduler | memory-optimized | ratio |", "|---|---|---|---|"]
    for name, m in t.items():
        lines.append(f"| {name} | {m['concurrency'] * 1e3:.1f} ms | {m['memory'] * 1e3:.1f} ms | "
                     f"{m['memory'] / m['concurrency']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "fsdp_temp.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
