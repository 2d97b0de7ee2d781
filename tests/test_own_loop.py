"""A training step of the user's own: ``osdp_jax.value_and_grad`` inside their ``jax.jit``, the
plan's shardings as values (``jax.jit``, orbax), and ``osdp_jax.check_budget``."""
import functools

import foreign
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import toy
from jax.sharding import PartitionSpec as P

import osdp_jax

MODELS = {
    "linen": lambda: foreign.residual_mlp(depth=6, width=256, batch=64),
    "nnx": lambda: foreign.nnx_residual_mlp(depth=6, width=256, batch=64),
    "equinox": lambda: foreign.equinox_transformer(depth=4, d=128, batch=16),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_users_own_step_on_the_drop_in_fits_the_budget_and_trains_like_one_device(mesh, family):
    """At a budget halfway between the DDP and FSDP peaks, the user's own jitted step built on
    ``osdp_jax.value_and_grad`` fits by XLA's figure for that step, is predicted within 5% of it,
    and its 5 losses equal one device's; the same step on ``jax.value_and_grad`` is caught by
    ``check_budget`` when it goes over."""
    params, loss_fn, batch = MODELS[family]()
    opt = optax.adam(1e-3)
    ddp, fsdp = foreign.ddp_fsdp_peaks(params, loss_fn, batch, opt, mesh)
    plan = osdp_jax.plan(params, mesh, budget=(ddp + fsdp) // 2, loss_fn=loss_fn, batch=batch, optimizer=opt)
    s = osdp_jax.shardings(params, plan, mesh, opt, batch)
    sharded = osdp_jax.shard(params, mesh, plan)
    state = osdp_jax.init_opt_state(opt, sharded, plan, mesh)
    placed = jax.device_put(batch, s.batch)

    step = osdp_jax.check_budget(toy.own_step(osdp_jax.value_and_grad(loss_fn, plan, mesh), opt, s), plan,
                                 sharded, state, placed)
    peak = osdp_jax.profile_compiled(step).peak_bytes
    assert peak <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - peak) <= 0.05 * peak
    losses = []
    for _ in range(5):
        sharded, state, loss = step(sharded, state, placed)
        losses.append(float(loss))
    expected, _ = toy.single_device_run(params, loss_fn, opt, batch, 5)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)

    plain = toy.own_step(jax.value_and_grad(loss_fn), opt, s)
    abstract = osdp_jax.abstract_state(params, plan, mesh, opt)
    plain_peak = osdp_jax.profile_compiled(plain.lower(*abstract, placed).compile()).peak_bytes
    if plain_peak > plan.budget_bytes:
        with pytest.raises(osdp_jax.BudgetExceededError, match="osdp_jax.value_and_grad") as e:
            osdp_jax.check_budget(plain, plan, *abstract, placed)
        assert e.value.peak_bytes == plain_peak and e.value.budget_bytes == plan.budget_bytes
    if family == "linen":  # parameter-heavy: XLA gathers the ZeRO-3 weights at once and keeps them
        assert plain_peak > plan.budget_bytes


def test_make_train_step_is_the_drop_in_with_the_optimizer_applied(mesh):
    """``make_train_step`` and a user's step on ``value_and_grad`` (same optimizer, same layout)
    give the same losses and parameters, bit for bit: one gradient path."""
    params, loss_fn, batch = toy.plain_params(layers=2), toy.plain_loss, toy.tokens(32)
    layout = osdp_jax.Layout.fsdp(params, mesh)
    opt = optax.adam(1e-2)
    s = osdp_jax.shardings(params, layout, mesh, opt, batch)
    runs = []
    for step in (osdp_jax.make_train_step(loss_fn, opt, layout, mesh),
                 toy.own_step(osdp_jax.value_and_grad(loss_fn, layout, mesh), opt, s)):
        p = osdp_jax.shard(params, mesh, layout)
        o = osdp_jax.init_opt_state(opt, p, layout, mesh)
        losses = []
        for _ in range(3):
            p, o, loss = step(p, o, batch)
            losses.append(float(loss))
        runs.append((losses, p))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_drop_in_returns_what_loss_fn_returns_in_the_losss_place(mesh):
    """``has_aux``/``state``/``rng``: the value mirrors what ``loss_fn`` returns, combined over
    the devices; the gradients are laid out as the optimizer state (a zero3 one as its shard)."""
    params = {"w": jnp.arange(64.0).reshape(8, 8) / 64, "b": jnp.ones((8,))}
    layout = osdp_jax.Layout.from_specs(params, mesh, {"w": P("data")})
    batch = {"x": jnp.ones((16, 8))}

    def loss_fn(p, b, rng, state):
        y = b["x"] @ p["w"] + p["b"] + 0 * jax.random.normal(rng, ())
        return jnp.mean(y ** 2), ({"n": jnp.array(1, jnp.int32)}, {"count": state["count"] + 1.0})

    grad_fn = osdp_jax.value_and_grad(loss_fn, layout, mesh, has_aux=True, state=True, rng=True)
    placed = osdp_jax.shard(params, mesh, layout)
    (loss, (aux, new_state)), grads = jax.jit(grad_fn)(placed, batch, {"count": jnp.zeros(())}, jax.random.key(0))
    expected_loss, expected_grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] + p["b"]) ** 2))(params)
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    assert int(aux["n"]) == 8 and float(new_state["count"]) == 1.0  # integers summed, floats averaged
    assert grads["w"].sharding.spec == P("data") and grads["b"].sharding.spec == P()
    np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(expected_grads["w"]), rtol=1e-6)
    with pytest.raises(TypeError, match=r"takes \(params, batch, state, rng\); got 1 more"):
        grad_fn(placed, batch, {"count": jnp.zeros(())}, jax.random.key(0), 1)


def _bits(tree) -> list:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("onto", ["same plan", "another plan"])
def test_orbax_round_trip_through_the_plans_shardings_is_bit_identical(mesh, tmp_path, onto):
    """Params and Adam state saved by orbax from one layout restore, bit for bit, onto the targets
    ``osdp_jax.abstract_state`` gives for that layout or for another (orbax reshards)."""
    params, loss_fn, batch = toy.plain_params(layers=2), toy.plain_loss, toy.tokens(32)
    opt = optax.adam(1e-2)
    first = osdp_jax.Layout.fsdp(params, mesh)
    p = osdp_jax.shard(params, mesh, first)
    o = osdp_jax.init_opt_state(opt, p, first, mesh)
    p, o, _ = osdp_jax.make_train_step(loss_fn, opt, first, mesh)(p, o, batch)
    saved = (_bits(p), _bits(o))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": p, "opt_state": o})
    second = first if onto == "same plan" else osdp_jax.Layout.ddp(params, mesh)
    p_target, o_target = osdp_jax.abstract_state(params, second, mesh, opt)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", {"params": p_target, "opt_state": o_target})
    assert (_bits(restored["params"]), _bits(restored["opt_state"])) == saved
    assert ([x.sharding for x in jax.tree.leaves(restored["params"])]
            == [x.sharding for x in jax.tree.leaves(p_target)])


@pytest.mark.slow
def test_equinox_units_are_the_blocks_and_train_like_one_device(mesh):
    """``osdp_jax.units.mark`` on an unmodified Equinox model: its list of blocks are the units
    (paths unchanged), and FSDP at those units trains like one device through ``make_train_step``
    and holds less than FSDP without them."""
    params, loss_fn, batch = foreign.equinox_transformer(depth=3, d=64, batch=16)
    units = osdp_jax.units.find(loss_fn, params, batch)
    assert set(units.values()) == {"blocks/0", "blocks/1", "blocks/2"}
    assert units["blocks/1/attn/query_proj/weight"] == "blocks/1"
    opt = optax.adam(1e-3)
    layout = osdp_jax.Layout.fsdp(params, mesh, units=units)
    with_units, without = (osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, x).peak_bytes
                           for x in (layout, osdp_jax.Layout.fsdp(params, mesh)))
    assert with_units < without
    losses, _, _ = toy.sharded_run(params, loss_fn, opt, layout, mesh, batch, 3)
    expected, _ = toy.single_device_run(params, loss_fn, opt, batch, 3)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_units_mark_names_what_it_takes():
    with pytest.raises(TypeError, match="nnx Module or an Equinox Module"):
        osdp_jax.units.mark(functools.partial(print))
