"""The train step's contract: replicas stay bit-identical under every plan kind (with a
cross-parameter optimizer), and aux outputs, per-device rng, mutable collections and the eval step
equal a single-device reference."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import osdp_jax
from osdp_jax.core.describe import flat_params

N = 8


def hand_plan(params, mesh, choose, batch_size, axes=("data",)):
    """A plan whose per-parameter (strategy, spec, k) come from ``choose(path, shape)``."""
    base = osdp_jax.plan(params, mesh, budget="100GB", strategies=("replicate",), axis=axes)
    pps = []
    for pp in base.params:
        strategy, spec, k = choose(pp.path, pp.shape)
        pps.append(dataclasses.replace(pp, strategy=strategy, spec=spec, split=k))
    return dataclasses.replace(base, params=tuple(pps), batch_size=batch_size)


def _zero3(path, shape):
    return ("zero3", P("data"), 1) if shape and shape[0] % N == 0 else ("replicate", P(), 1)


def _mixed(path, shape):  # the kernels sharded, the rest replicated
    return _zero3(path, shape) if path.endswith("kernel") or path.endswith("embedding") else ("replicate", P(), 1)


def _split(path, shape):  # mixed, with the hidden kernels split in two
    strategy, spec, _ = _mixed(path, shape)
    k = 2 if strategy == "zero3" and path.endswith("kernel") and shape[0] % (2 * N) == 0 else 1
    return strategy, spec, k


def _zero2(path, shape):  # the kernels zero2 (stored whole, state sharded), the rest zero3 where they can
    if path.endswith("kernel") or path.endswith("embedding"):
        return ("zero2", P(), 1) if shape and shape[0] % N == 0 else ("replicate", P(), 1)
    return _zero3(path, shape)


KINDS = {"replicate": lambda path, shape: ("replicate", P(), 1), "zero3": _zero3, "mixed": _mixed, "zero2": _zero2,
         "split": _split, "hsdp": lambda path, shape: ("hsdp", P("data"), 1) if shape and shape[0] % 4 == 0
         else ("replicate", P(), 1)}

# clipping at a tiny norm is active every step: a per-device norm (of one device's shards) would
# clip each device differently
CLIPPED_ADAMW = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, weight_decay=0.1))


def _replicas_identical(tree):
    """Every copy of every piece of every leaf (shards with the same index) is bit-identical."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array):
            continue
        by_index = {}
        for shard in leaf.addressable_shards:
            key = tuple((s.start, s.stop) for s in shard.index)
            by_index.setdefault(key, []).append(np.asarray(shard.data))
        for copies in by_index.values():
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0], err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_replicas_bit_identical_and_clipping_exact(kind, mesh):
    params, loss_fn = toy.linen_setup(boxed=False)
    batch = toy.tokens(32)
    axes = ("data",)
    if kind == "hsdp":
        mesh = jax.make_mesh((2, 4), ("replica", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        axes = ("replica", "data")
    plan = hand_plan(params, mesh, KINDS[kind], 32, axes)
    if kind == "split":
        assert plan.splits_by_path, "the split plan splits kernels"
    if kind == "zero2":  # stored whole, optimizer state sharded, its gradient reduce-scattered
        assert plan.counts().get("zero2") and plan.counts().get("zero3")
        opt_state = osdp_jax.init_opt_state(CLIPPED_ADAMW, osdp_jax.shard(params, mesh, plan), plan, mesh)
        flat = flat_params(osdp_jax.shard(params, mesh, plan))
        mu = {k: v for k, v in flat_params(opt_state[1][0].mu).items()}
        zero2 = [pp.path for pp in plan.params if pp.strategy == "zero2"]
        for path in zero2:
            assert flat[path].sharding.spec == P() and mu[path].sharding.spec == P("data"), path
        hlo = osdp_jax.make_train_step(loss_fn, CLIPPED_ADAMW, plan, mesh).lower(
            osdp_jax.shard(params, mesh, plan), opt_state, batch).compile().as_text()
        assert "reduce-scatter" in hlo and "all-gather" in hlo
    losses, sharded, _ = toy.sharded_run(params, loss_fn, CLIPPED_ADAMW, plan, mesh, batch, 4,
                                         after_step=lambda *state: _replicas_identical(state))
    toy.assert_matches_single_device(losses, sharded, params, loss_fn, CLIPPED_ADAMW, batch, rtol=1e-5)


def _per_device_reference(fn, params, batch, n=N, **kwargs):
    """Outputs of ``fn`` on each of the n batch slices, stacked (the single-device reference)."""
    rows = batch.shape[0] // n
    outs = [fn(params, batch[d * rows:(d + 1) * rows], **{k: v(d) for k, v in kwargs.items()})
            for d in range(n)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _with_aux(model_loss):
    def loss_fn(params, tokens):
        loss = model_loss(params, tokens)
        return loss, {"loss_x2": 2 * loss, "count": jnp.sum(tokens >= 0), "first": tokens[:, 0]}
    return loss_fn


@pytest.mark.parametrize("aux", ["mean", "gather"])
def test_aux_is_reduced_as_documented(mesh, aux):
    params, model_loss = toy.linen_setup(boxed=False)
    batch = toy.tokens(32)
    loss_fn = _with_aux(model_loss)
    plan = hand_plan(params, mesh, _mixed, 32)
    sharded = osdp_jax.shard(params, mesh, plan)
    opt = optax.sgd(0.1)
    step = osdp_jax.make_train_step(loss_fn, opt, plan, mesh, has_aux=True, aux=aux)
    _, _, loss, out = step(sharded, osdp_jax.init_opt_state(opt, sharded, plan, mesh), batch)
    ref = _per_device_reference(lambda p, b: loss_fn(p, b)[1], params, batch)
    if aux == "mean":
        np.testing.assert_allclose(out["loss_x2"], 2 * float(loss), rtol=1e-6)
        np.testing.assert_allclose(out["loss_x2"], ref["loss_x2"].mean(), rtol=1e-5)
        assert int(out["count"]) == batch.size  # integers are summed
    else:
        np.testing.assert_allclose(out["loss_x2"], ref["loss_x2"], rtol=1e-5)  # one per device
        assert out["count"].tolist() == [batch.size // N] * N
        np.testing.assert_array_equal(out["first"], batch[:, 0])  # per example, in batch order


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool):
        h = nn.Embed(toy.VOCAB, 32)(tokens)
        h = nn.Dropout(0.5, deterministic=not train)(nn.Dense(64)(h))
        return nn.Dense(toy.VOCAB)(h)


def _xent(logits, tokens):
    targets = jnp.roll(tokens, -1, axis=1)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1))


def test_rng_is_folded_per_device_and_reproducible(mesh):
    model = DropoutMLP()
    batch = toy.tokens(32)
    params = model.init(jax.random.key(0), batch, train=False)["params"]

    def loss_fn(p, tokens, rng):
        return _xent(model.apply({"params": p}, tokens, train=True, rngs={"dropout": rng}), tokens)

    plan = hand_plan(params, mesh, _mixed, 32)
    opt = optax.sgd(0.0)  # parameters unchanged: the losses are comparable step by step
    step = osdp_jax.make_train_step(loss_fn, opt, plan, mesh, rng=True)
    key = jax.random.key(7)

    def run():
        p = osdp_jax.shard(params, mesh, plan)
        o = osdp_jax.init_opt_state(opt, p, plan, mesh)
        losses = []
        for i in range(2):
            p, o, loss = step(p, o, batch, jax.random.fold_in(key, i))
            losses.append(float(loss))
        return losses

    first, again = run(), run()
    assert first == again  # reproducible
    assert first[0] != first[1]  # a new mask each step
    for i, got in enumerate(first):
        ref = _per_device_reference(loss_fn, params, batch,
                                    rng=lambda d: jax.random.fold_in(jax.random.fold_in(key, i), d))
        np.testing.assert_allclose(got, float(ref.mean()), rtol=1e-5)


class BatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool):
        h = nn.Dense(64)(nn.Embed(toy.VOCAB, 32)(tokens))
        h = nn.BatchNorm(use_running_average=not train, momentum=0.5)(h)
        return nn.Dense(toy.VOCAB)(jax.nn.relu(h))


def test_mutable_batch_stats_are_averaged_across_devices(mesh):
    model = BatchNormMLP()
    batch = toy.tokens(32)
    variables = model.init(jax.random.key(0), batch, train=False)
    params, stats = variables["params"], {"batch_stats": variables["batch_stats"]}

    def loss_fn(p, tokens, state):
        logits, new = model.apply({"params": p, **state}, tokens, train=True, mutable=["batch_stats"])
        return _xent(logits, tokens), (tokens.shape[0], new)

    plan = hand_plan(params, mesh, _zero3, 32)
    opt = optax.adam(1e-2)
    step = osdp_jax.make_train_step(loss_fn, opt, plan, mesh, has_aux=True, state=True)
    p = osdp_jax.shard(params, mesh, plan)
    o = osdp_jax.init_opt_state(opt, p, plan, mesh)
    p, o, loss, rows, new_stats = step(p, o, batch, stats)
    assert int(rows) == 32
    ref_loss, (_, ref_new) = _per_device_reference(loss_fn, params, batch, state=lambda d: stats)
    np.testing.assert_allclose(float(loss), float(ref_loss.mean()), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_stats), jax.tree.leaves(ref_new)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b).mean(0), rtol=1e-5, atol=1e-7)
    # the returned statistics feed the next step
    step(p, o, batch, new_stats)


@pytest.mark.parametrize("kind", ["mixed", "split"])
def test_eval_step_equals_one_device(mesh, kind):
    params, model_loss = toy.linen_setup(boxed=False)
    batch = toy.tokens(32)
    plan = hand_plan(params, mesh, KINDS[kind], 32)
    sharded = osdp_jax.shard(params, mesh, plan)
    evaluate = osdp_jax.make_eval_step(lambda p, b: {"loss": model_loss(p, b)}, plan, mesh)
    np.testing.assert_allclose(float(evaluate(sharded, batch)["loss"]), float(model_loss(params, batch)),
                               rtol=1e-5)
    # any batch size the devices divide; params are not donated
    np.testing.assert_allclose(float(evaluate(sharded, batch[:16])["loss"]),
                               float(model_loss(params, batch[:16])), rtol=1e-5)
    assert not any(x.is_deleted() for x in jax.tree.leaves(sharded))


def test_other_batch_size_is_refused_unless_allowed(mesh):
    params, loss_fn = toy.plain_params(layers=1), toy.plain_loss
    plan = hand_plan(params, mesh, _zero3, 32)
    opt = optax.sgd(0.1)
    p = osdp_jax.shard(params, mesh, plan)
    o = osdp_jax.init_opt_state(opt, p, plan, mesh)
    with pytest.raises(ValueError, match="made for global batch size 32, got a batch of 16"):
        osdp_jax.make_train_step(loss_fn, opt, plan, mesh)(p, o, toy.tokens(16))
    _, _, loss = osdp_jax.make_train_step(loss_fn, opt, plan, mesh, any_batch_size=True)(p, o, toy.tokens(16))
    assert np.isfinite(float(loss))


def test_a_batch_committed_to_other_devices_is_one_clear_error(mesh):
    """A batch put on one device (or on the same devices in another order) cannot enter a step
    on the plan's mesh: one error naming the leaf and jax.device_put(batch,
    osdp_jax.batch_sharding(mesh, plan)), which then runs; host arrays run as they are."""
    params, loss_fn = toy.plain_params(layers=1), toy.plain_loss
    plan = hand_plan(params, mesh, _zero3, 32)
    opt = optax.sgd(0.1)
    p = osdp_jax.shard(params, mesh, plan)
    o = osdp_jax.init_opt_state(opt, p, plan, mesh)
    step = osdp_jax.make_train_step(loss_fn, opt, plan, mesh)
    evaluate = osdp_jax.make_eval_step(loss_fn, plan, mesh)
    tokens = toy.tokens(32)
    reversed_mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]), ("data",))
    for placed, ids in ((jax.device_put(tokens, jax.devices()[0]), "[0]"),
                        (jax.device_put(tokens, NamedSharding(reversed_mesh, P("data"))), "[7, 6, 5, 4, 3, 2, 1, 0]")):
        for run, what in ((lambda b: step(p, o, b), "train step"), (lambda b: evaluate(p, b), "eval step")):
            with pytest.raises(ValueError, match=rf"batch leaf '<root>' is committed to devices {re.escape(ids)}, "
                                                 rf"not to the {what}'s mesh .*osdp_jax.batch_sharding\(mesh, plan\)"):
                run(placed)
    assert np.isfinite(float(evaluate(p, np.asarray(tokens))))
    _, _, loss = step(p, o, jax.device_put(tokens, osdp_jax.batch_sharding(mesh, plan)))
    assert np.isfinite(float(loss))


def test_reusing_donated_params_is_a_clear_error(mesh):
    params = toy.plain_params(layers=1)
    plan = hand_plan(params, mesh, _zero3, 32)
    opt = optax.sgd(0.1)
    p = osdp_jax.shard(params, mesh, plan)
    o = osdp_jax.init_opt_state(opt, p, plan, mesh)
    step = osdp_jax.make_train_step(toy.plain_loss, opt, plan, mesh)
    step(p, o, toy.tokens(32))
    with pytest.raises(ValueError, match="donated to an earlier call.*use the params that call returned"):
        step(p, o, toy.tokens(32))


def test_a_tuple_returning_loss_without_has_aux_is_a_clear_error(mesh):
    params = toy.plain_params(layers=1)
    plan = hand_plan(params, mesh, _zero3, 32)
    opt = optax.sgd(0.1)
    p = osdp_jax.shard(params, mesh, plan)
    step = osdp_jax.make_train_step(lambda q, b: (toy.plain_loss(q, b), 1.0), opt, plan, mesh)
    with pytest.raises(TypeError, match="pass has_aux=True"):
        step(p, osdp_jax.init_opt_state(opt, p, plan, mesh), toy.tokens(32))


def test_optimizer_none_plans_for_adam_and_says_so(mesh, caplog):
    params = toy.plain_params(layers=1)
    with caplog.at_level("WARNING", logger="osdp_jax"):
        default = osdp_jax.plan(params, mesh, budget="1GB")
    assert "optimizer=None, so the plan counts optax.adam's state" in caplog.text
    adam = osdp_jax.plan(params, mesh, budget="1GB", optimizer=optax.adam(1e-3))
    assert default.predicted_peak_bytes == adam.predicted_peak_bytes


def test_abstract_state_is_what_orbax_restores_onto(mesh, tmp_path):
    import orbax.checkpoint as ocp
    params = toy.plain_params(layers=1)
    opt = optax.adam(1e-2)
    plan = hand_plan(params, mesh, _zero3, 32)
    p = osdp_jax.shard(params, mesh, plan)
    o = osdp_jax.init_opt_state(opt, p, plan, mesh)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "c", {"params": p, "opt_state": o})
    ckpt.wait_until_finished()
    # restore under another plan: all replicated
    other = hand_plan(params, mesh, KINDS["replicate"], 32)
    t_params, t_opt = osdp_jax.abstract_state(params, other, mesh, opt)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((t_params, t_opt)))
    back = ckpt.restore(tmp_path / "c", {"params": t_params, "opt_state": t_opt})
    for a, b in zip(jax.tree.leaves((back["params"], back["opt_state"])), jax.tree.leaves((p, o))):
        assert a.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_optimizers_that_mask_parameters_or_factor_their_state_plan_and_train_like_one_device(mesh):
    """optax.multi_transform with a frozen parameter (``set_to_zero``: its state is an
    optax.MaskedNode), adamw's masked weight decay, optax.MultiSteps, and optax.adafactor (a row
    and a column vector per matrix where the state of a parameter sits, replicated): the planner counts no state for the
    frozen parameter, every parameter sharded trains like one device, and the frozen one stays
    as it was (the masked state's MaskedNode failed a tree_map against the parameters' specs,
    and adafactor's vectors were given their matrices' specs)."""
    from osdp_jax.planner.cost import optimizer_bytes
    params, loss_fn, batch = toy.plain_params(layers=1), toy.plain_loss, toy.tokens(32)
    labels = {k: jax.tree.map(lambda _: "frozen" if k == "emb" else "train", v) for k, v in params.items()}
    freeze = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    decay = optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    per_leaf, _ = optimizer_bytes(freeze, params)
    assert per_leaf[names.index("['emb']")] == 0 and per_leaf[names.index("['head']")] > 0
    plan = osdp_jax.plan(params, mesh, budget="1GB", loss_fn=loss_fn, batch=batch, optimizer=freeze)
    assert plan.xla_peak_bytes <= plan.budget_bytes
    layout = osdp_jax.Layout.fsdp(params, mesh)  # the probes' and plans' step, every parameter sharded
    for optimizer in (freeze, decay, optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), optax.adafactor(1e-2)):
        losses, sharded, _ = toy.sharded_run(params, loss_fn, optimizer, layout, mesh, batch, 3)
        toy.assert_matches_single_device(losses, sharded, params, loss_fn, optimizer, batch, rtol=1e-5)
    losses, sharded, _ = toy.sharded_run(params, loss_fn, freeze, layout, mesh, batch, 2)
    np.testing.assert_array_equal(np.asarray(sharded["emb"]), np.asarray(params["emb"]))


@pytest.mark.slow
def test_an_optimizer_that_is_not_elementwise_plans_and_trains_on_an_explicit_mesh(mesh):
    """optax.contrib.muon orthogonalises each gradient matrix (products of it with its transpose).
    On a ZeRO-3 shard an Explicit mesh's sharding rules refused that: jax.make_mesh's default
    mesh gave a ShardingTypeError from inside optax, in the planner's first probe. The optimizer's
    init and update now run with the mesh's Explicit axes as Auto ones (``runtime.place.as_auto``),
    where XLA gathers what they need inside the step (so XLA's peak, which verifies the plan,
    counts it): planned, verified and trained like one device on an Explicit mesh and on an Auto
    one."""
    params, loss_fn, batch = toy.plain_params(layers=1), toy.plain_loss, toy.tokens(32)
    muon = optax.contrib.muon(1e-2)
    explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    plan = osdp_jax.plan(params, explicit, budget="1GB", loss_fn=loss_fn, batch=batch, optimizer=muon,
                         strategies=("zero3",))
    assert plan.counts()["zero3"] >= 3 and plan.xla_peak_bytes <= plan.budget_bytes
    for m in (explicit, mesh):
        losses, sharded, _ = toy.sharded_run(params, loss_fn, muon, plan, m, batch, 3)
        toy.assert_matches_single_device(losses, sharded, params, loss_fn, muon, batch, rtol=1e-5)


def test_shardings_are_those_of_the_placed_arrays_and_serve_a_users_own_jit(mesh):
    """``osdp_jax.shardings``: the NamedSharding trees of the params, the optimizer state and the
    batch are those ``shard``/``init_opt_state`` give, and a user's own ``jax.jit`` step takes
    them as ``in_shardings``/``out_shardings``."""
    params = {"w1": jnp.ones((64, 32)), "w2": jnp.ones((32, 64)), "b": jnp.ones((64,))}
    batch = {"x": jnp.ones((16, 64))}
    layout = osdp_jax.Layout.from_specs(params, mesh, {"w1": P("data"), "w2": P(None, "data"), "b": P()})
    opt = optax.adam(1e-3)
    s = osdp_jax.shardings(params, layout, mesh, opt, batch)
    placed = osdp_jax.shard(params, mesh, layout)
    state = osdp_jax.init_opt_state(opt, placed, layout, mesh)
    assert jax.tree.leaves(s.params) == [x.sharding for x in jax.tree.leaves(placed)]
    assert jax.tree.leaves(s.opt_state) == [x.sharding for x in jax.tree.leaves(state)]
    assert s.params["w1"].spec == P("data") and s.batch["x"].spec == P("data")

    def own_step(p, o, b):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((b["x"] @ p["w1"] @ p["w2"] + p["b"]) ** 2))(p)
        updates, o = opt.update(g, o, p)
        return optax.apply_updates(p, updates), o, loss

    step = jax.jit(own_step, in_shardings=(s.params, s.opt_state, s.batch), out_shardings=(s.params, s.opt_state, None))
    new_params, _, loss = step(placed, state, jax.device_put(batch, s.batch))
    assert np.isfinite(float(loss)) and new_params["w1"].sharding == s.params["w1"]
