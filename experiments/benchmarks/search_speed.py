"""Search speed on an abstract GPT-3-175B-shaped parameter tree (96 layers), 8 batch sizes.

Two layouts of the same 175B parameters:
  stacked:   each block weight stacked over the 96 layers (one array per kind), planned with a
             loss_fn, so the step is compiled per batch size (compile time reported separately);
  per-layer: a dict of 96 blocks (1158 leaves), searched on the uncalibrated cost model (no
             compile), timing the same search the planner runs, once per batch size.

Run: python experiments/benchmarks/search_speed.py [--skip-compile]
Prints measured wall-clock seconds on this machine.
"""
import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import osdp_jax  # noqa: E402

L, D, H, V, T = 96, 12288, 96, 50257, 2048
BATCH_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
f32 = jnp.float32


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, f32)


def block(prefix=()):
    return {"ln1": sds(*prefix, D), "qkv": sds(*prefix, D, 3 * D), "qkv_b": sds(*prefix, 3 * D),
            "proj": sds(*prefix, D, D), "proj_b": sds(*prefix, D), "ln2": sds(*prefix, D),
            "fc": sds(*prefix, D, 4 * D), "fc_b": sds(*prefix, 4 * D), "out": sds(*prefix, 4 * D, D),
            "out_b": sds(*prefix, D)}


def stacked_params():
    return {"wte": sds(V, D), "wpe": sds(T, D), "blocks": block((L,)), "ln_f": sds(D)}


def per_layer_params():
    return {"wte": sds(V, D), "wpe": sds(T, D), "ln_f": sds(D), **{f"h{i}": block() for i in range(L)}}


def loss_fn(p, tokens):
    """A GPT block stack run with lax.scan (weights tied to the embedding for the head)."""
    def norm(x, g):
        return g * (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def layer(h, w):
        b, t, _ = h.shape
        q, k, v = jnp.split(norm(h, w["ln1"]) @ w["qkv"] + w["qkv_b"], 3, axis=-1)
        q, k, v = (x.reshape(b, t, H, D // H) for x in (q, k, v))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, D)
        h = h + a @ w["proj"] + w["proj_b"]
        h = h + jax.nn.gelu(norm(h, w["ln2"]) @ w["fc"] + w["fc_b"]) @ w["out"] + w["out_b"]
        return h, None

    h = p["wte"][tokens] + p["wpe"][: tokens.shape[1]]
    h, _ = jax.lax.scan(jax.checkpoint(layer), h, p["blocks"])
    logits = norm(h, p["ln_f"]) @ p["wte"].T
    return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-compile", action="store_true", help="skip the compiled (stacked) run")
    args = ap.parse_args()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    opt = optax.adam(1e-4)
    hw = osdp_jax.PRESETS["a100-40gb"]
    n_params = sum(x.size for x in jax.tree.leaves(stacked_params()))
    print(f"GPT-3 shape: {L} layers, hidden {D}, {n_params / 1e9:.1f}B parameters, 8 devices, "
          f"{len(BATCH_SIZES)} batch sizes")

    # per-layer tree, uncalibrated model (no loss function: nothing compiled): the cost tables and
    # the search alone, as plan() times them (Plan.search_seconds)
    params = per_layer_params()
    infos = osdp_jax.describe(params)
    times = [osdp_jax.plan(params, mesh, budget=2 * 10**12, batch=jax.ShapeDtypeStruct((8, T), jnp.int32),
                           batch_sizes=BATCH_SIZES, optimizer=opt, hardware=hw, strategies=("replicate", "zero3"),
                           splits=(1,)).search_seconds for _ in range(3)]
    print(f"per-layer tree ({len(infos)} leaves): search over {len(BATCH_SIZES)} batch sizes "
          f"{np.median(times):.3f} s (median of 3, measured)")

    if args.skip_compile:
        return
    params = stacked_params()
    batch = jax.ShapeDtypeStruct((8, T), jnp.int32)
    t0 = time.perf_counter()
    plan = osdp_jax.plan(params, mesh, budget=2 * 10**12, loss_fn=loss_fn, batch=batch,
                         batch_sizes=BATCH_SIZES, optimizer=opt, hardware=hw, verify=False)
    total = time.perf_counter() - t0
    print(f"stacked tree ({len(osdp_jax.describe(params))} leaves): search over "
          f"{len(BATCH_SIZES)} batch sizes {plan.search_seconds:.3f} s; XLA probe compiles and the "
          f"rest {total - plan.search_seconds:.1f} s (measured)")
    print(plan.summary())


if __name__ == "__main__":
    main()
