"""Sharded training under a mixed plan equals single-device training, for every params flavour."""
import jax
import optax
import pytest
import toy

import osdp_jax


def mixed_plan(params, mesh, loss_fn, batch, optimizer):
    """A budget halfway between the all-zero3 and all-replicate peaks forces a mix."""
    kwargs = dict(loss_fn=loss_fn, batch=batch, optimizer=optimizer)
    high = osdp_jax.plan(params, mesh, budget="100GB", strategies=("replicate",), **kwargs).xla_peak_bytes
    low = osdp_jax.plan(params, mesh, budget="100GB", strategies=("zero3",), **kwargs).xla_peak_bytes
    plan = osdp_jax.plan(params, mesh, budget=(low + high) // 2, **kwargs)
    return plan, low, high


@pytest.mark.parametrize("flavour", ["plain", pytest.param("linen", marks=pytest.mark.slow),
                                     pytest.param("linen-boxed", marks=pytest.mark.slow), "nnx"])
def test_sharded_training_matches_single_device(mesh, flavour, request):
    if flavour == "plain":
        request.getfixturevalue("default_emitters")  # its steps compiled as a user's are
        params, loss_fn = toy.plain_params(), toy.plain_loss
    elif flavour == "nnx":
        params, loss_fn = toy.nnx_setup()
    else:
        params, loss_fn = toy.linen_setup(boxed=flavour == "linen-boxed")
    optimizer = optax.adam(1e-2)
    batch = toy.tokens()
    plan, low, high = mixed_plan(params, mesh, loss_fn, batch, optimizer)
    assert abs(plan.predicted_peak_bytes - plan.xla_peak_bytes) <= 0.05 * plan.xla_peak_bytes
    counts = plan.counts()
    assert counts.get("zero3", 0) > 0 and counts.get("replicate", 0) > 0, counts
    assert low < high
    assert plan.xla_peak_bytes <= plan.budget_bytes

    assert type(osdp_jax.shard(params, mesh, plan)) is type(params)
    losses, sharded, _ = toy.sharded_run(params, loss_fn, optimizer, plan, mesh, batch, 4)
    assert jax.tree.structure(sharded) == jax.tree.structure(params)
    toy.assert_matches_single_device(losses, sharded, params, loss_fn, optimizer, batch, rtol=1e-4)
    assert losses[-1] < losses[0]
    # zero3 leaves really are stored 1/8 per device
    for pp, leaf in zip(plan.params, jax.tree.leaves(sharded)):
        shard_bytes = leaf.addressable_shards[0].data.nbytes
        assert shard_bytes == (pp.nbytes // 8 if pp.strategy == "zero3" else pp.nbytes)


def test_shard_does_not_delete_callers_arrays(mesh):
    params = toy.plain_params()
    plan = osdp_jax.plan(params, mesh, budget="1GB")
    optimizer = optax.sgd(0.1)
    sharded = osdp_jax.shard(params, mesh, plan)
    step = osdp_jax.make_train_step(toy.plain_loss, optimizer, plan, mesh)
    step(sharded, osdp_jax.init_opt_state(optimizer, sharded, plan, mesh), toy.tokens())
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
