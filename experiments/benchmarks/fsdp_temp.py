"""The FSDP step's transient memory, decomposed: XLA temp = gradient shards + activations + the rest.

For the GPT-2 presets under FSDP (every parameter zero3, the layer stack gathered per layer inside
its scanned, rematerialised loop), 8 simulated devices, sequence 128, compile-only: XLA's temp at
two batch sizes gives ``temp(b) = W + A b`` (A: activations per sample, the part that grows with
the batch). ZeRO-3's bound is ``W <= gradient shards + two layers' gathered weights``: the
gradient shards (1/N of every parameter, ZeRO-3 model state) sit in XLA's temp because the
optimizer update reads them after the backward pass; at most two layers' gathered weights (one
layer's weights and its full-size gradient) may be alive besides.

Rows: osdp-jax's step as it runs (XLA:CPU's default, concurrency-optimized scheduler, which
starts every all-gather and every gradient buffer's zero fill as early as it can), the same step
compiled with XLA:CPU's memory-optimized scheduler (compile-only), and gpt2-48l-1536 with BERT's
unpadded 30,522-token vocabulary (the embedding is then sharded along its feature dimension).
Then whether a step compiled with the memory-optimized scheduler runs: gpt2-mini, FSDP, trained
for 3 steps in a child process (measured: its exit status).

Run: python experiments/benchmarks/fsdp_temp.py
Writes experiments/results/fsdp_temp.md (and prints it).
"""
import argparse
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import models  # noqa: E402
import osdp_jax  # noqa: E402
from models.gpt2 import GPT2, gpt2_config  # noqa: E402
from osdp_jax._gather import discover  # noqa: E402
from osdp_jax._strategies import spec_for  # noqa: E402
from osdp_jax._train import abstract_args, build_step  # noqa: E402
from osdp_jax._xla import profile_compiled  # noqa: E402

AXES, N, SEQ = ("data",), 8, 128
MIB = 2**20
MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


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


RUN_WITH_MEMORY_SCHEDULER = """
import tempfile
import jax
import osdp_jax._train as T, osdp_jax._xla as X
from experiments import config, runner
jit = lambda step: jax.jit(step, donate_argnums=(0, 1), compiler_options=%r)
T.jit_step = X.jit_step = jit
cfg = config.load("experiments/gpt2_mini.toml", {"train.steps": "3"})
s = runner.setup(cfg)
plan = runner.make_plan(s, strategies=("zero3",))
runner.train(s, tempfile.mkdtemp(), plan=plan, progress=False, write=False)
print("trained")
"""


def run_memory_scheduled() -> tuple[int, str]:
    """Exit status and last stderr line of gpt2-mini FSDP trained with the memory-optimized scheduler."""
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", RUN_WITH_MEMORY_SCHEDULER % (MEMORY_SCHEDULER,)],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in done.stderr.splitlines() if "Check failed" in ln] or done.stderr.splitlines()[-1:]
    return done.returncode, (lines[0] if lines else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    cases = [("gpt2-48l-1536", models.get("gpt2-48l-1536")[0], "default (osdp-jax runs this)", None),
             ("gpt2-48l-1536", models.get("gpt2-48l-1536")[0], "memory-optimized, compile-only", MEMORY_SCHEDULER),
             ("gpt2-48l-1536, vocab 30,522", GPT2(gpt2_config(n_layer=48, d_model=1536, n_head=48, vocab_size=30522)),
              "default (osdp-jax runs this)", None),
             ("gpt2-48l-2048", models.get("gpt2-48l-2048")[0], "default (osdp-jax runs this)", None),
             ("gpt2-48l-2048", models.get("gpt2-48l-2048")[0], "memory-optimized, compile-only", MEMORY_SCHEDULER)]
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
    rc, why = run_memory_scheduled()
    lines += ["", "A step compiled with the memory-optimized scheduler, run (gpt2-mini, FSDP, 3 steps, child "
              f"process): exit status {rc}" + (f", `{why.strip()[:300]}`" if rc else ", trained") + ".",
              "So osdp-jax compiles with XLA:CPU's default scheduler, and the bound is not met on CPU."
              if rc else "The memory-optimized scheduler ran here."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "fsdp_temp.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
