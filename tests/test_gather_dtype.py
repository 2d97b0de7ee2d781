"""Low-precision gathers (issue 17, part 2): with a compute dtype, a sharded parameter's shard is
cast before the all-gather and its gradient reduce-scattered in that dtype, while the stored
shard, its update and its optimizer state stay in the parameter's own dtype (fp32 masters)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import osdp_jax
from osdp_jax.cli import config
from osdp_jax.core.describe import path_name


def _bf16_reference(params, loss_fn, opt, batch, sharded_paths, steps):
    """One device, the sharded parameters rounded to bfloat16 (and back to float32) where the
    model uses them; the gradient flows back through the rounding to the fp32 masters."""
    def rounded(p):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x.astype(jnp.bfloat16).astype(x.dtype) if path_name(path) in sharded_paths else x, p)

    losses, p, o = [], params, opt.init(params)
    for _ in range(steps):
        loss, g = jax.value_and_grad(lambda q: loss_fn(rounded(q), batch))(p)
        u, o = opt.update(g, o, p)
        p = optax.apply_updates(p, u)
        losses.append(float(loss))
    return losses, p


def test_bf16_gathers_keep_fp32_masters_and_train_like_one_device_in_bf16(mesh):
    params, loss_fn = toy.linen_setup(boxed=False)
    batch = toy.tokens(32)
    opt = optax.sgd(0.1)  # linear in the gradient: bfloat16 rounding of it stays small (Adam's sign would not)
    layout = osdp_jax.Layout.fsdp(params, mesh, gather_dtype="bfloat16")
    sharded_paths = {pl.path for pl in layout.params if pl.strategy == "zero3"}
    assert sharded_paths and all(pl.gather_dtype == "bfloat16" for pl in layout.params if pl.path in sharded_paths)
    p = osdp_jax.shard(params, mesh, layout)
    o = osdp_jax.init_opt_state(opt, p, layout, mesh)
    step = osdp_jax.make_train_step(loss_fn, opt, layout, mesh)
    # the step asks for bfloat16 collectives (XLA:CPU then runs them in float32 after rounding: its
    # compiled all-gathers are f32, so on this machine the bytes do not halve; GPUs gather bf16)
    text = step.lower(p, o, batch).as_text()
    gathers = [line for line in text.splitlines() if "stablehlo.all_gather" in line]
    assert gathers and all("xbf16>) -> tensor<" in line for line in gathers), gathers[:2]
    assert "stablehlo.reduce_scatter" in text
    losses = []
    for _ in range(3):
        p, o, loss = step(p, o, batch)
        losses.append(float(loss))
    # the masters (and the optimizer state) stay float32, and equal fp32 masters updated on one device
    assert {x.dtype for x in jax.tree.leaves((p, o)) if x.ndim} == {jnp.dtype("float32")}
    ref_losses, ref = _bf16_reference(params, loss_fn, opt, batch, sharded_paths, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)):
        # the gradients are reduced in bfloat16 (each device's part rounded, 2^-9 relative): over 3
        # steps of lr 0.1 that moves a parameter by a few 1e-6
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=2e-5)


@pytest.mark.slow
def test_compute_dtype_plan_predicted_within_10_percent_and_gathers_half_the_bytes(mesh):
    _, params, loss_fn, batch = toy.stack_setup(n_layer=4)
    # a bandwidth-bound link (no latency): the modelled collective seconds halve exactly
    link = {"name": "test", "memory_bytes": 2 ** 34, "flops": 1e12, "bandwidth": 1e9, "latency": 0.0}
    kw = dict(loss_fn=loss_fn, batch=batch, optimizer=optax.adam(1e-3), batch_sizes=(64,), splits=(1,),
              remat=("full",), strategies=("zero3",), hardware=link)
    half = osdp_jax.plan(params, mesh, budget="4GB", compute_dtype="bfloat16", **kw)
    assert {pp.gather_dtype for pp in half.params if pp.strategy == "zero3"} == {"bfloat16"}
    assert abs(half.predicted_peak_bytes - half.xla_peak_bytes) <= 0.05 * half.xla_peak_bytes, half.summary()
    full = osdp_jax.plan(params, mesh, budget="4GB", **kw)
    assert half.predicted_collective_seconds == pytest.approx(0.5 * full.predicted_collective_seconds, rel=1e-6)
    assert osdp_jax.Plan.from_json(half.to_json()).layout == half.layout
    assert "in bfloat16" in half.summary()


def test_bad_compute_dtype_is_one_clear_error(mesh):
    params, _ = toy.linen_setup(boxed=False)
    with pytest.raises(ValueError, match="compute_dtype must be a floating dtype such as 'bfloat16'"):
        osdp_jax.plan(params, mesh, budget="1GB", compute_dtype="int8")
    with pytest.raises(ValueError, match="gather_dtype must be a floating dtype"):
        osdp_jax.Layout.fsdp(params, mesh, gather_dtype="bf17")
    with pytest.raises(ValueError, match="compute_dtype"):
        config.load("experiments/gpt2_mini.toml", {"plan.compute_dtype": "int8"})
    assert config.load("experiments/gpt2_mini.toml",
                       {"plan.compute_dtype": "bfloat16"}).plan.compute_dtype == "bfloat16"


def test_models_compute_in_bfloat16_on_float32_masters(monkeypatch):
    """``model.compute_dtype = "bfloat16"`` (the models' mixed-precision setting): float32
    parameters, bfloat16 matmuls, a float32 loss close to float32 compute's; the plan gathers in
    bfloat16 too."""
    import dataclasses

    from osdp_jax import models
    from osdp_jax.cli import runner
    module, cfg, _ = models.get("gpt2-mini")
    params = models.init_params(module, 16, seed=0)
    batch = toy.lm_batch(cfg.vocab_size, 8, 16)
    half = type(module)(dataclasses.replace(cfg, compute_dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(models.init_params(half, 16, seed=0))} == {jnp.dtype("float32")}
    text = jax.jit(models.make_loss(half)).lower(params, batch).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots and all(line.rstrip().endswith("bf16>") for line in dots), dots[:2]
    full, mixed = models.make_loss(module)(params, batch), models.make_loss(half)(params, batch)
    assert mixed.dtype == jnp.float32 and abs(float(mixed) - float(full)) <= 2e-2 * abs(float(full))
    s = runner.setup(config.load("experiments/gpt2_mini.toml", {"model.compute_dtype": "bfloat16"}))
    assert s.module.config.compute_dtype == "bfloat16"
    seen = {}
    monkeypatch.setattr(osdp_jax, "plan", lambda *a, **kw: seen.update(kw))
    runner.make_plan(s)
    assert seen["compute_dtype"] == "bfloat16"
    with pytest.raises(config.ConfigError, match="model.compute_dtype"):
        config.load("experiments/gpt2_mini.toml", {"model.compute_dtype": "int4"})
