"""The FSDP step's transient memory, decomposed: XLA temp = gradient shards + activations + the rest.

For the GPT-2 presets under FSDP (every parameter zero3, the layer stack gathered per layer inside
its scanned, rematerialised loop), 8 simulated devices, sequence 128, compile-only: XLA's temp at
two batch sizes gives ``temp(b) = W + A b`` (A: activations per sample, the part that grows with
the batch). ZeRO-3's bound is ``W <= gradient shards + two layers' gathered weights``: the
gradient shards (1/N of every parameter, ZeRO-3 model state) sit in XLA's temp because the
optimizer update reads them after the backward pass; at most two layers' gathered weights (one
layer's weights and its full-size gradient) may be alive besides.

Rows: osdp-jax's step; the same without deferring the embedding's gradient buffer
(``osdp_jax.runtime.kernels.lookup``: the lookup's table-sized zeros are otherwise filled at the start of the
step); the same also gathering the per-step dense kernels (the LM head) before the loss instead of
at their layer (the step before these two changes).

Run: python experiments/benchmarks/fsdp_temp.py
Writes experiments/results/fsdp_temp.md (and prints it).
"""
import argparse
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import models  # noqa: E402
import osdp_jax  # noqa: E402

AXES, N, SEQ = ("data",), 8, 128
MIB = 2**20


def _batch(b, seq=SEQ):
    return {"inputs": jax.ShapeDtypeStruct((b, seq), jnp.int32), "targets": jax.ShapeDtypeStruct((b, seq), jnp.int32),
            "weights": jax.ShapeDtypeStruct((b, seq), jnp.float32)}


def _setup(module):
    params = models.abstract_params(module, SEQ)
    loss_fn = models.make_loss(module)
    loop, dense = osdp_jax.discover(loss_fn, params, _batch(8))
    return params, loss_fn, loop, dense, osdp_jax.describe(params)


def decompose(module, embed=True, at_layer=True) -> dict:
    """W, A and the bound's terms (MiB) for the FSDP step; ``embed=False`` compiles it with Flax's
    own Embed lookup, ``at_layer=False`` with the per-step dense kernels gathered before the loss."""
    params, loss_fn, loop, dense, infos = _setup(module)
    mesh = jax.make_mesh((N,), AXES, axis_types=(jax.sharding.AxisType.Auto,))
    layout = osdp_jax.Layout.fsdp(params, mesh, in_loop=loop, dense=(dense - loop) if at_layer else ())
    opt = optax.adam(1e-4)
    temp = {}
    for b in (8, 16):
        compiled = osdp_jax.compile_step(loss_fn, opt, params, _batch(b), mesh, layout, embed_lookup=embed)
        temp[b] = osdp_jax.profile_compiled(compiled).temp_bytes / MIB
    per_sample = (temp[16] - temp[8]) / 8
    grads = sum(i.nbytes for i in infos) / N / MIB
    layer = sum(i.nbytes / i.shape[0] for i in infos if i.path in loop) / MIB
    w = temp[8] - 8 * per_sample
    return {"temp8": temp[8], "temp16": temp[16], "A": per_sample, "W": w, "grads": grads, "layer": layer,
            "over_grads": w - grads, "holds": w <= grads + 2 * layer}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    gpt2_1536, gpt2_2048 = models.get("gpt2-48l-1536")[0], models.get("gpt2-48l-2048")[0]
    cases = [("gpt2-48l-1536", "osdp-jax", gpt2_1536, True, True),
             ("gpt2-48l-1536", "embedding gradient via jnp.take", gpt2_1536, False, True),
             ("gpt2-48l-1536", "also LM head gathered before the loss (before)", gpt2_1536, False, False),
             ("gpt2-48l-2048", "osdp-jax", gpt2_2048, True, True),
             ("gpt2-48l-2048", "also LM head gathered before the loss (before)", gpt2_2048, False, False)]
    lines = ["# FSDP temp: gradient shards + activations + two layers' gathered weights", "",
             "Measured (XLA's `memory_analysis`, compile-only) by `python experiments/benchmarks/fsdp_temp.py`: "
             f"FSDP, {N} simulated CPU devices, sequence {SEQ}, Adam. temp(b) = W + A b from batch 8 and 16; "
             "bound: W <= gradient shards + 2 layers' gathered weights.", "",
             "| model | step | temp b=8 | temp b=16 | A per sample | W | gradient shards | W - shards | 2 layers | bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, step, module, embed, at_layer in cases:
        d = decompose(module, embed, at_layer)
        lines.append(f"| {name} | {step} | {d['temp8']:.1f} MiB | {d['temp16']:.1f} MiB | {d['A']:.2f} MiB | "
                     f"{d['W']:.1f} MiB | {d['grads']:.1f} MiB | {d['over_grads']:.1f} MiB | {2 * d['layer']:.1f} MiB | "
                     f"{'holds' if d['holds'] else 'exceeded'} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "fsdp_temp.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
