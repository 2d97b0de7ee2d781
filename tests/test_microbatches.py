"""Gradient accumulation (issue 17, part 3, the step): a global batch run as m microbatches trains
as the whole batch does, with less activation memory."""
import re

import jax
import numpy as np
import optax
import pytest
import toy

import osdp_jax
from osdp_jax.core.strategies import spec_for


def _mixed(params, mesh):
    """Kernels zero3, embeddings zero2, the rest replicated."""
    infos = osdp_jax.describe(params)
    specs = {i.path: spec_for(i, "zero3", ("data",), 8) for i in infos if i.path.endswith("kernel")}
    zero2 = [i.path for i in infos if i.path.endswith("embedding") and spec_for(i, "zero3", ("data",), 8)]
    return osdp_jax.Layout.from_specs(params, mesh, {k: v for k, v in specs.items() if v is not None}, zero2=zero2)


def _summed_the_other_way(params, mesh):
    """:func:`_mixed`, with every sharded gradient summed whole across microbatches: the kernels
    kept gathered across them, the embedding's zero2 gradient reduce-scattered once."""
    layout = _mixed(params, mesh)
    flip = {pl.path: "whole" for pl in layout.params if pl.strategy != "replicate"}
    return osdp_jax.Layout.from_specs(params, mesh, layout.specs_by_path,
                                      zero2=[pl.path for pl in layout.params if pl.strategy == "zero2"],
                                      accumulate=flip)


def _run(params, loss_fn, layout, mesh, batch, m, steps=3, opt=None):
    opt = opt or optax.adam(1e-2)
    p = osdp_jax.shard(params, mesh, layout)
    o = osdp_jax.init_opt_state(opt, p, layout, mesh)
    step = osdp_jax.make_train_step(loss_fn, opt, layout, mesh, microbatches=m)
    losses = []
    for _ in range(steps):
        p, o, loss = step(p, o, batch)
        losses.append(float(loss))
    return losses, p


@pytest.mark.slow
def test_microbatches_train_like_the_whole_batch_with_less_memory(mesh):
    params, loss_fn = toy.linen_setup(boxed=False)
    batch = toy.tokens(64)
    layout = _mixed(params, mesh)
    assert {pl.strategy for pl in layout.params} == {"replicate", "zero3", "zero2"}
    # SGD: Adam turns the rounding of a gradient entry near 0 (the sums differ in their order) into a
    # step of up to its learning rate (toy.assert_matches_single_device)
    sgd = optax.sgd(0.5)
    whole, p1 = _run(params, loss_fn, layout, mesh, batch, 1, opt=sgd)
    accumulated, p4 = _run(params, loss_fn, layout, mesh, batch, 4, opt=sgd)
    other = _summed_the_other_way(params, mesh)
    assert {(pl.strategy, pl.accumulate) for pl in other.params} == {("replicate", ""), ("zero3", "whole"),
                                                                     ("zero2", "whole")}
    summed, p4b = _run(params, loss_fn, other, mesh, batch, 4, opt=sgd)
    np.testing.assert_allclose(accumulated, whole, rtol=1e-5)
    np.testing.assert_allclose(summed, whole, rtol=1e-5)
    assert whole[-1] < whole[0]  # it trains
    for a, b, c in zip(jax.tree.leaves(p4), jax.tree.leaves(p1), jax.tree.leaves(p4b)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(c), np.asarray(b), rtol=1e-5, atol=1e-6)
    opt = optax.adam(1e-2)
    peaks = {m: osdp_jax.profile_compiled(osdp_jax.compile_step(loss_fn, opt, params, batch, mesh, layout,
                                                                 microbatches=m)).temp_bytes for m in (1, 4)}
    assert peaks[4] < peaks[1], peaks


def test_kept_weights_are_gathered_once_and_others_in_every_microbatch(mesh):
    """In the compiled step, a kept weight's all-gather and reduce-scatter sit outside the
    microbatch loop, a re-gathered one's inside it (XLA:CPU would otherwise hoist that gather out
    of the loop), and a zero2 gradient is reduce-scattered inside it unless summed whole."""
    params, loss_fn = toy.linen_setup(boxed=False)
    opt = optax.adam(1e-2)

    def placed(layout):
        text = osdp_jax.compile_step(loss_fn, opt, params, toy.tokens(64), mesh, layout, microbatches=4).as_text()
        loop = set(re.findall(r" while\(.*body=%?([\w.\-]+)", text))
        where, comp = {}, None
        for line in text.splitlines():
            if line.endswith("{") and not line.startswith(" "):
                comp = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            for op in ("all-gather", "reduce-scatter"):
                if f" {op}(" in line or f" {op}-start(" in line:
                    key = (op, "loop" if comp in loop else "step")
                    where[key] = where.get(key, 0) + 1
        return where
    kernels = sum(pl.strategy == "zero3" for pl in _mixed(params, mesh).params)
    regathered, kept = placed(_mixed(params, mesh)), placed(_summed_the_other_way(params, mesh))
    assert regathered == {("all-gather", "loop"): kernels, ("reduce-scatter", "loop"): kernels + 1,
                          ("all-gather", "step"): 1}, regathered
    assert kept == {("all-gather", "step"): kernels + 1, ("reduce-scatter", "step"): kernels + 1}, kept


@pytest.mark.slow
@pytest.mark.parametrize("strategy,budget", [("zero2", 5_000_000), ("zero3", 4_700_000)])
def test_the_search_chooses_where_each_gradient_is_summed(mesh, strategy, budget):
    """Between the peaks of summing every gradient whole and in its shard (4 microbatches, an
    einsum LM written elsewhere), the search mixes the two, the plan fits by XLA, is predicted
    within 10%, and says so in its summary and its JSON."""
    import foreign
    params, loss_fn, batch = foreign.einsum_lm(layers=2, d=128, batch=64)
    plan = osdp_jax.plan(params, mesh, budget=budget, loss_fn=loss_fn, batch=batch, optimizer=optax.adam(1e-3),
                         batch_sizes=(64,), splits=(1,), units=(), microbatches=(4,), strategies=(strategy,))
    summed = {osdp_jax.strategies.accumulation(pp.strategy,
                                               pp.accumulate) for pp in plan.params if pp.strategy == strategy}
    assert summed == {"shard", "whole"}, plan.summary()
    assert plan.xla_peak_bytes <= budget
    assert abs(plan.predicted_peak_bytes - plan.xla_peak_bytes) <= 0.05 * plan.xla_peak_bytes, plan.summary()
    assert ("kept across microbatches" if strategy == "zero3" else "grad summed whole") in plan.summary()
    assert osdp_jax.Plan.from_json(plan.to_json()).layout == plan.layout


def test_bad_accumulate_is_one_clear_error(mesh):
    params, loss_fn = toy.linen_setup(boxed=False)
    layout = _mixed(params, mesh)
    kernel = next(pl.path for pl in layout.params if pl.strategy == "zero3")
    bias = next(pl.path for pl in layout.params if pl.strategy == "replicate")
    specs = layout.specs_by_path
    with pytest.raises(ValueError, match="accumulate must be 'shard' or 'whole'"):
        osdp_jax.Layout.from_specs(params, mesh, specs, accumulate={kernel: "both"})
    with pytest.raises(ValueError, match=f"{bias!r}: a replicated parameter's gradient is accumulated whole"):
        osdp_jax.Layout.from_specs(params, mesh, specs, accumulate={bias: "shard"})
    with pytest.raises(ValueError, match="split in 2, so it cannot be kept gathered"):
        osdp_jax.Layout.from_specs(params, mesh, specs, splits={kernel: 2}, accumulate={kernel: "whole"})
    with pytest.raises(KeyError, match="accumulate names parameters the params do not have"):
        osdp_jax.Layout.from_specs(params, mesh, specs, accumulate={"nope": "whole"})


def test_bad_microbatches_are_one_clear_error(mesh):
    params, loss_fn = toy.linen_setup(boxed=False)
    layout = osdp_jax.Layout.ddp(params, mesh)
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        osdp_jax.make_train_step(loss_fn, optax.sgd(0.1), layout, mesh, microbatches=0)
    with pytest.raises(ValueError, match="not with|not supported"):
        osdp_jax.make_train_step(loss_fn, optax.sgd(0.1), layout, mesh, microbatches=2, state=True)
    step = osdp_jax.make_train_step(loss_fn, optax.sgd(0.1), layout, mesh, microbatches=3)
    p = osdp_jax.shard(params, mesh, layout)
    with pytest.raises(ValueError, match="not divisible into 3 microbatches"):
        step(p, osdp_jax.init_opt_state(optax.sgd(0.1), p, layout, mesh), toy.tokens(32))
    from osdp_jax.cli import config
    assert config.load("experiments/gpt2_mini.toml", {"plan.microbatches": "1,2"}).plan.microbatches == (1, 2)
    with pytest.raises(config.ConfigError, match=r"plan.microbatches: microbatches must be positive integers"):
        config.load("experiments/gpt2_mini.toml", {"plan.microbatches": "0"})
    with pytest.raises(config.ConfigError,
                       match=r"plan.microbatches: no batch size of \[32\] splits into 8 devices x any of"):
        config.load("experiments/gpt2_mini.toml", {"plan.microbatches": "3", "plan.batch_sizes": "32"})


@pytest.mark.slow
def test_a_budget_no_plan_meets_at_the_largest_batch_is_met_by_accumulation(mesh):
    """At the one batch size asked for, no plan of replicate/zero3/hsdp fits the budget; with
    microbatches the planner runs it as m microbatches, which fits by XLA, is predicted within
    10%, and trains (the plan's microbatches reach the step)."""
    _, params, loss_fn, batch = toy.stack_setup(n_layer=2, batch=128)
    opt = optax.adam(1e-3)
    kw = dict(loss_fn=loss_fn, batch=batch, optimizer=opt, batch_sizes=(128,), splits=(1,), remat=("full",))
    fsdp = osdp_jax.plan(params, mesh, budget="4GB", strategies=("zero3",), **kw)
    budget = int(0.8 * fsdp.xla_peak_bytes)
    with pytest.raises(osdp_jax.InfeasibleBudgetError):
        osdp_jax.plan(params, mesh, budget=budget, **kw)
    plan = osdp_jax.plan(params, mesh, budget=budget, microbatches=(1, 4), verify="full", **kw)
    assert plan.batch_size == 128 and plan.microbatches > 1, plan.summary()
    assert plan.xla_peak_bytes <= budget
    assert abs(plan.predicted_peak_bytes - plan.xla_peak_bytes) <= 0.05 * plan.xla_peak_bytes, plan.summary()
    assert "microbatches" in plan.summary()
    again = osdp_jax.Plan.from_json(plan.to_json())
    assert again.microbatches == plan.microbatches
    _, real, _, real_batch = toy.stack_setup(n_layer=2, batch=128, abstract=False)
    p = osdp_jax.shard(real, mesh, plan)
    step = osdp_jax.make_train_step(loss_fn, opt, plan, mesh)
    _, _, loss = step(p, osdp_jax.init_opt_state(opt, p, plan, mesh),
                      jax.device_put(real_batch, osdp_jax.batch_sharding(mesh, plan)))
    assert np.isfinite(float(loss)) and step.reused  # the verified, accumulating step ran
    with pytest.raises(ValueError, match="microbatches must be positive integers"):
        osdp_jax.plan(params, mesh, budget=budget, microbatches=(0,), **kw)


@pytest.mark.slow
def test_a_stack_with_a_zero2_segment_accumulates_like_the_whole_batch(mesh):
    """A layer stack whose first layer is zero2 and second zero3: with microbatches, the zero2
    segment's gradient is summed whole and reduce-scattered once, the zero3 one's in each
    microbatch, and the run equals the whole batch's. SGD, whose update is linear in the gradient:
    Adam turns the rounding of a gradient entry near 0 (the sums differ in their order) into a
    step of up to its learning rate."""
    from jax.sharding import PartitionSpec as P

    from osdp_jax import Segment
    _, params, loss_fn, batch = toy.stack_setup(n_layer=2, batch=32, abstract=False)
    in_loop, _ = osdp_jax.discover(loss_fn, params, batch)
    segs = {}
    for i in osdp_jax.describe(params):
        z = spec_for(i, "zero3", ("data",), 8, True) if i.path in in_loop else None
        if z is not None:
            segs[i.path] = (Segment(0, 1, "zero2", 1, "full", P()), Segment(1, 2, "zero3", 1, "full", z))
    assert segs
    layout = osdp_jax.Layout.from_specs(params, mesh, {}, in_loop=in_loop, segments=segs)
    whole, p1 = _run(params, loss_fn, layout, mesh, batch, 1, opt=optax.sgd(0.5))
    accumulated, p2 = _run(params, loss_fn, layout, mesh, batch, 2, opt=optax.sgd(0.5))
    np.testing.assert_allclose(accumulated, whole, rtol=1e-5)
    assert whole[-1] < whole[0]  # it trains
    for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(p1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
