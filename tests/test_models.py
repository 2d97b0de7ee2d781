"""The models: a block against plain JAX, and sharded training (per-layer gathering) against one device."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import osdp_jax
from osdp_jax import Layout, discover, models, profile_step
from osdp_jax.core.strategies import spec_for
from osdp_jax.models.common import Block, TransformerConfig
from osdp_jax.runtime.step import build_step


def reference_block(p, x, cfg):
    """One pre-LN transformer layer written out in plain jax.numpy."""
    def ln(h, q):
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        return (h - mu) / jnp.sqrt(var + 1e-6) * q["scale"] + q["bias"]

    b, t, d = x.shape
    hd = d // cfg.n_head
    h = ln(x, p["ln1"])
    qkv = h @ p["qkv_kernel"] + p["qkv_bias"]
    q, k, v = (qkv[..., i * d:(i + 1) * d].reshape(b, t, cfg.n_head, hd).transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    s = jnp.where(np.tril(np.ones((t, t), bool)), s, -1e30)
    a = (jax.nn.softmax(s, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + a @ p["out_kernel"] + p["out_bias"]
    h = ln(x, p["ln2"])
    return x + jax.nn.gelu(h @ p["fc1"]["kernel"] + p["fc1"]["bias"]) @ p["fc2"]["kernel"] + p["fc2"]["bias"]


def test_block_matches_plain_jax():
    cfg = TransformerConfig(vocab_size=10, max_len=8, n_layer=1, n_head=4, d_model=32, d_ff=64)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    params = Block(cfg).init(jax.random.key(1), x)["params"]
    params = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape), params)
    out = Block(cfg).apply({"params": params}, x)
    np.testing.assert_allclose(out, reference_block(params, x, cfg), rtol=1e-5, atol=1e-5)


# sharded training of the three models with per-layer gathering, split kernels and segments:
# tests/test_layers.py::test_segments_with_different_strategies_splits_and_remat_train_like_one_device


@pytest.mark.slow
def test_stacked_kernels_gathered_once_per_step_match_one_device(mesh):
    """Every parameter zero3 but the stacked layer weights gathered before the loss, not per
    layer (in_loop empty, as gather_memory.py compares): the stacked dense kernels are not
    handed to their layers unsplit (they are scanned over), and the step equals one device. Without
    ``stacks_per_step`` such a layout is refused with one clear error, never run silently."""
    module, cfg, _ = models.get("gpt2-mini")
    params = models.init_params(module, 16, seed=0)
    loss_fn = models.make_loss(module)
    batch = toy.lm_batch(cfg.vocab_size, 16, 16)
    specs = {i.path: spec_for(i, "zero3", ("data",), 8) or jax.sharding.PartitionSpec()
             for i in osdp_jax.describe(params)}
    assert specs["blocks/layers/fc1/kernel"] != jax.sharding.PartitionSpec()  # sharded, gathered per step
    opt = optax.sgd(0.1)
    with pytest.raises(ValueError, match="gathers it whole before the loss, once per step: mark the stack"):
        jax.jit(build_step(loss_fn, opt, mesh, Layout.from_specs(params, mesh, specs)))(
            params, opt.init(params), batch)
    step = jax.jit(build_step(loss_fn, opt, mesh, Layout.from_specs(params, mesh, specs, stacks_per_step=True)))
    _, _, loss = step(params, opt.init(params), batch)
    assert float(loss) == pytest.approx(float(loss_fn(params, batch)), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpt2-48l-1536", "gpt2-48l-2048"])
def test_fsdp_temp_is_activations_plus_two_layers(preset):
    """XLA's per-device temp of the FSDP step (every weight zero3, layers gathered per layer) is
    at most the activations plus two layers' gathered weights (compile-only), on top of the
    gradient shards. The activations are the part of temp that grows with the batch: temp at
    batch b is W + A b, measured at two batch sizes; the bound is W <= gradient shards + two
    layers' gathered weights. The gradient shards (1/N of every parameter) are ZeRO-3 model
    state like the parameter and optimizer shards, but XLA counts them in temp: the optimizer
    update reads them after the backward pass."""
    module, cfg, _ = models.get(preset)
    seq, n = 128, 8
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = models.abstract_params(module, seq)

    def batch(b):
        return toy.lm_batch(cfg.vocab_size, b, seq, abstract=True)
    loss_fn, opt = models.make_loss(module), optax.adam(1e-4)
    in_loop, dense = discover(loss_fn, params, batch(8))
    infos = osdp_jax.describe(params)
    fsdp = Layout.fsdp(params, mesh, in_loop=in_loop, dense=dense - in_loop)
    assert all(pl.strategy == "zero3" for pl in fsdp.params), "every parameter is sharded"
    temp = {b: profile_step(loss_fn, opt, params, batch(b), mesh, fsdp).temp_bytes for b in (8, 16)}
    per_sample = (temp[16] - temp[8]) / 8
    weights_part = temp[8] - 8 * per_sample
    layer = sum(i.nbytes / i.shape[0] for i in infos if i.path in in_loop)
    grad_shards = sum(i.nbytes for i in infos) / n
    assert per_sample > 0
    assert weights_part <= grad_shards + 2 * layer, (weights_part, grad_shards, layer)
