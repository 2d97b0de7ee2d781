"""Units (osdp_jax.units): submodules of unmodified models gathered on entry and again in the
backward pass. The models (tests/foreign.py) make no osdp-jax call, except the plain-JAX one's
decorator and the nnx one's ``units.mark``."""
import foreign
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy

import osdp_jax
from osdp_jax.planner.unit_policy import choose

MODELS = {"linen-einsum-tied": foreign.einsum_lm, "linen-setup": foreign.setup_mlp, "nnx-vit": foreign.vit,
          "plain-jax": foreign.plain_mlp}
MIB = 2**20


def test_default_policy_layer_list_share_and_patterns():
    calls = [("linen", "embed", ("embed/t",)), ("linen", "block_0", ("block_0/a", "block_0/Dense_0/k")),
             ("linen", "block_0/Dense_0", ("block_0/Dense_0/k",)), ("linen", "block_1", ("block_1/a",)),
             ("linen", "head", ("head/k",)), ("linen", "head/Dense_0", ("head/k",))]
    sizes = {"embed/t": 40, "block_0/a": 10, "block_0/Dense_0/k": 10, "block_1/a": 20, "head/k": 1}
    # the layer list (outermost), then the 1/8 share rule (embed: 40 of 81 bytes; head: too small)
    assert choose(calls, sizes) == {"block_0/a": "block_0", "block_0/Dense_0/k": "block_0",
                                    "block_1/a": "block_1", "embed/t": "embed"}
    assert choose(calls, sizes, ["head"]) == {"head/k": "head"}
    assert choose(calls, sizes, []) == {}
    with pytest.raises(ValueError, match="matches no submodule.*block_0"):
        choose(calls, sizes, ["blocks/*"])


@pytest.mark.slow
def test_find_units_in_unmodified_models(mesh):
    params, loss_fn, batch = foreign.einsum_lm()
    units = osdp_jax.units.find(loss_fn, params, batch)
    assert sorted(set(units.values())) == [f"block_{i}" for i in range(4)]
    assert "embedding" not in units  # the tied table is used outside any block
    assert set(osdp_jax.units.find(loss_fn, params, batch, ["block_[02]"]).values()) == {"block_0", "block_2"}
    params, loss_fn, batch = foreign.vit()
    assert sorted(set(osdp_jax.units.find(loss_fn, params, batch).values())) == [f"blocks/{i}" for i in range(4)]
    with pytest.raises(TypeError, match="nnx Module"):
        osdp_jax.units.mark({"w": np.ones(3)})


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_units_train_like_one_device(mesh, name):
    params, loss_fn, batch = MODELS[name]()
    opt = optax.adam(1e-3)
    units = osdp_jax.units.find(loss_fn, params, batch)
    layout = osdp_jax.Layout.fsdp(params, mesh, units=units, unit_remat="dots" if name == "nnx-vit" else "full")
    assert len(set(units.values())) == 4 and layout.units
    one, _ = toy.single_device_run(params, loss_fn, opt, batch, 3)
    p = osdp_jax.shard(params, mesh, layout)
    o = osdp_jax.init_opt_state(opt, p, layout, mesh)
    step = osdp_jax.make_train_step(loss_fn, opt, layout, mesh)
    got = []
    for _ in range(3):
        p, o, loss = step(p, o, batch)
        got.append(float(loss))
    np.testing.assert_allclose(got, one, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linen-einsum-tied", "nnx-vit"])
def test_units_bound_the_gathered_weights(mesh, name):
    """With units, the FSDP peak is the parameter, gradient and optimizer shards, plus the
    activations, plus two units' gathered weights (one unit and its full-size gradient in the
    backward pass), plus the weights gathered per step outside any unit and their gradients; and
    doubling the depth adds only the new blocks' shards and saved inputs. Without units every
    block's gathered weights stay alive. (The depth claim is asserted on the LM, from 2 to 4
    blocks, whose compiles are the cheaper.)"""
    opt = optax.adam(1e-3)
    peaks = {}
    for depth in (2, 4) if name == "linen-einsum-tied" else (4,):
        params, loss_fn, batch = MODELS[name](depth) if name == "nnx-vit" else MODELS[name](layers=depth)
        units = osdp_jax.units.find(loss_fn, params, batch)
        infos = osdp_jax.describe(params)
        total = sum(i.nbytes for i in infos)
        unit = max(sum(i.nbytes for i in infos if units.get(i.path) == u) for u in set(units.values()))
        outside = sum(i.nbytes for i in infos if i.path not in units)
        ddp = osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, osdp_jax.Layout.ddp(params, mesh))
        fsdp = osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, osdp_jax.Layout.fsdp(params, mesh))
        with_units = osdp_jax.profile_step(loss_fn, opt, params, batch, mesh,
                                           osdp_jax.Layout.fsdp(params, mesh, units=units))
        x = jax.tree.leaves(batch)[0]
        saved_inputs = depth * (x.shape[0] // 8) * foreign_width(name, x) * 4  # each unit's input, f32
        activations = max(ddp.temp_bytes - 2 * total, saved_inputs)  # DDP's temp less gradients and all-reduce
        shards = with_units.argument_bytes + total / 8  # params + optimizer state, + gradient shards
        bound = shards + activations + 2 * unit + 2 * outside
        assert with_units.peak_bytes <= bound * 1.05, (with_units.peak_bytes / MIB, bound / MIB)
        assert fsdp.peak_bytes > with_units.peak_bytes + (depth - 2) * unit
        peaks[depth] = (with_units.peak_bytes, fsdp.peak_bytes, total)
    if name != "linen-einsum-tied":
        return
    (u2, f2, t2), (u4, f4, t4) = peaks[2], peaks[4]
    added = (t4 - t2) * 4 / 8  # the new blocks' params, gradients and Adam moments, sharded 8 ways
    assert u4 - u2 <= 1.25 * added, ((u4 - u2) / MIB, added / MIB)
    assert f4 - f2 > 2 * added


def peaks(params, loss_fn, batch, opt, mesh, *layouts) -> list[int]:
    """XLA's peak bytes per device of each layout's train step."""
    return [osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, layout).peak_bytes for layout in layouts]


def units_of(params, loss_fn, batch, unit):
    return [p for p, u in osdp_jax.units.find(loss_fn, params, batch).items() if u == unit]


def foreign_width(name, x) -> int:
    """Elements per example of a unit's input: tokens x width (lm), patches x width (vit)."""
    return x.shape[1] * 64 if name == "linen-einsum-tied" else (x.shape[1] // 4) * (x.shape[2] // 4) * 64


@pytest.mark.slow
def test_plan_uses_units_where_only_they_fit(mesh):
    """A budget under the FSDP peak without units: the plan gathers at units (each decided whole),
    fits by XLA and is predicted within 5% of XLA's peak by the probe-fitted terms; the JSON keeps
    the units."""
    params, loss_fn, batch = foreign.einsum_lm(layers=4)
    opt = optax.adam(1e-3)
    fsdp = osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, osdp_jax.Layout.fsdp(params, mesh))
    budget = int(0.75 * fsdp.peak_bytes)
    plan = osdp_jax.plan(params, mesh, budget=budget, loss_fn=loss_fn, batch=batch, optimizer=opt, splits=(1,))
    assert plan.units and plan.xla_peak_bytes <= budget
    assert abs(plan.predicted_peak_bytes - plan.xla_peak_bytes) <= 0.05 * plan.xla_peak_bytes, plan.summary()
    assert plan.unit_scale == 1.0  # the probe-fitted terms, not refitted on the compiled plan (+1.4%)
    assert all(len(paths) == len(units_of(params, loss_fn, batch, unit)) for unit, paths in plan.units.items())
    assert "units (gathered on each call" in plan.summary()
    again = osdp_jax.Plan.from_json(plan.to_json())
    assert again.units == plan.units and again.layout == plan.layout and again.unit_scale == plan.unit_scale
    with pytest.raises(osdp_jax.InfeasibleBudgetError):
        osdp_jax.plan(params, mesh, budget=budget, loss_fn=loss_fn, batch=batch, optimizer=opt, splits=(1,),
                      units=())


@pytest.mark.slow
def test_pool_overlap_fitted_on_a_compiled_plan_predicts_the_next(mesh):
    """On a mixed plan of a model written elsewhere, XLA keeps the replicated gradients' all-reduce
    buffer and the weights gathered per step alive together (overlap 1, not the max of the two):
    fitted on the first compiled plan, it predicts the next budget's plan within 5%."""
    osdp_jax.planning.clear_probe_cache()
    params, loss_fn, batch = foreign.einsum_lm(layers=4, d=256, batch=32)
    opt = optax.adam(1e-3)
    ddp, fsdp = peaks(params, loss_fn, batch, opt, mesh, osdp_jax.Layout.ddp(params, mesh),
                      osdp_jax.Layout.fsdp(params, mesh))
    kw = dict(loss_fn=loss_fn, batch=batch, optimizer=opt, units=(), splits=(1,))
    first = osdp_jax.plan(params, mesh, budget=int(fsdp + 0.2 * (ddp - fsdp)), **kw)
    assert first.pool_overlap > 0.5 and first.xla_peak_bytes <= first.budget_bytes
    second = osdp_jax.plan(params, mesh, budget=int(fsdp + 0.6 * (ddp - fsdp)), **kw)
    assert second.pool_overlap == first.pool_overlap and second.xla_peak_bytes <= second.budget_bytes
    assert abs(second.predicted_peak_bytes - second.xla_peak_bytes) <= 0.05 * second.xla_peak_bytes


@pytest.mark.slow
def test_a_model_without_a_layer_stack_starts_from_the_overlap_of_one(mesh, monkeypatch):
    """A model with no layer stack gathers its per-step weights outside any loop, so its first
    plan is costed with the pool overlap at ``NO_LOOP_OVERLAP`` (1), not 0: the einsum LM's first
    mixed plan is then the one that starting from 0 reaches only after a refit and a second
    verification compile, and the overlap its compile shows is kept for the model's next plans."""
    from osdp_jax.planner import pipeline as _planner
    from osdp_jax.planner.calibration import OVERLAPS
    params, loss_fn, batch = foreign.einsum_lm(layers=4, d=256, batch=32)
    opt = optax.adam(1e-3)
    ddp, fsdp = peaks(params, loss_fn, batch, opt, mesh, osdp_jax.Layout.ddp(params, mesh),
                      osdp_jax.Layout.fsdp(params, mesh))  # the two probes, compiled here for both plans
    kw = dict(loss_fn=loss_fn, batch=batch, optimizer=opt, units=(), splits=(1,), budget=int(fsdp + 0.2 * (ddp - fsdp)))
    osdp_jax.planning.clear_probe_cache()
    assert _planner.NO_LOOP_OVERLAP == 1.0
    prior = osdp_jax.plan(params, mesh, **kw)
    assert prior.pool_overlap == 1.0 and prior.compiles == 1 and len(OVERLAPS) == 1
    assert abs(prior.predicted_peak_bytes - prior.xla_peak_bytes) <= 0.05 * prior.xla_peak_bytes
    osdp_jax.planning.clear_probe_cache()
    monkeypatch.setattr(_planner, "NO_LOOP_OVERLAP", None)  # from 0, as a model with a stack
    from_zero = osdp_jax.plan(params, mesh, **kw)
    assert from_zero.compiles == 2 and from_zero.pool_overlap > 0.5
    assert from_zero.layout == prior.layout and prior.xla_peak_bytes <= prior.budget_bytes


@pytest.mark.slow
def test_a_stored_pool_overlap_that_misses_a_plan_is_fitted_again(mesh):
    """The overlap fitted on a model's first mixed plan is kept for its later plans, but when a
    compiled plan's prediction with it misses XLA's peak by more than 5%, it is fitted again on
    that compile and the search rerun (a small nnx ViT without units, its stored overlap set to
    a wrong 0: the plan is predicted 13% low with it, then within 5%)."""
    from osdp_jax.planner.calibration import OVERLAPS
    osdp_jax.planning.clear_probe_cache()
    params, loss_fn, batch = foreign.vit(depth=2, d=64, batch=32)
    opt = optax.adam(1e-3)
    ddp, fsdp = peaks(params, loss_fn, batch, opt, mesh, osdp_jax.Layout.ddp(params, mesh),
                      osdp_jax.Layout.fsdp(params, mesh))
    kw = dict(loss_fn=loss_fn, batch=batch, optimizer=opt, units=(), splits=(1,))
    first = osdp_jax.plan(params, mesh, budget=int(fsdp + 0.9 * (ddp - fsdp)), **kw)
    assert first.pool_overlap == 1.0 and list(OVERLAPS.values()) == [1.0]
    OVERLAPS.update(dict.fromkeys(OVERLAPS, 0.0))
    plan = osdp_jax.plan(params, mesh, budget=int(fsdp + 0.7 * (ddp - fsdp)), **kw)
    assert plan.pool_overlap == 1.0 and list(OVERLAPS.values()) == [1.0]
    assert plan.xla_peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - plan.xla_peak_bytes) <= 0.05 * plan.xla_peak_bytes


@pytest.mark.slow
def test_units_savings_scaled_to_a_compiled_plan_that_misses(mesh):
    """Units' savings do not add, so a plan with units that
    its compile shows more than 5% off scales them to that compile (kept per model, like the
    pool overlap) and plans again: the einsum LM with its stored scale set to a wrong 2 (units
    saving twice what they do) plans within 5% and within budget, the scale refitted to 1."""
    from osdp_jax.planner.calibration import UNIT_SCALES
    from osdp_jax.planner.pipeline import _overlap_key
    from osdp_jax.planning import XlaCalibrator, build_problem
    osdp_jax.planning.clear_probe_cache()
    params, loss_fn, batch = foreign.einsum_lm(layers=3, d=64, batch=32)
    opt = optax.adam(1e-3)
    units = osdp_jax.units.find(loss_fn, params, batch)
    low, high = peaks(params, loss_fn, batch, opt, mesh, osdp_jax.Layout.fsdp(params, mesh, units=units),
                      osdp_jax.Layout.fsdp(params, mesh))
    budget, kw = int(low + (high - low) / 3), dict(loss_fn=loss_fn, batch=batch, optimizer=opt, splits=(1,))
    first = osdp_jax.plan(params, mesh, budget=budget, **kw)
    assert first.units and not UNIT_SCALES  # predicted within 5%: nothing refitted
    problem = build_problem(params, mesh, ("data",), ("replicate", "zero3"), (1,), loss_fn, batch)
    key = _overlap_key(XlaCalibrator(loss_fn, opt, params, mesh, 2**40), problem, {32: batch})
    UNIT_SCALES[key] = 2.0
    plan = osdp_jax.plan(params, mesh, budget=budget, **kw)
    assert plan.units and plan.xla_peak_bytes <= budget
    assert UNIT_SCALES[key] == pytest.approx(1.0, abs=0.05)
    assert abs(plan.predicted_peak_bytes - plan.xla_peak_bytes) <= 0.05 * plan.xla_peak_bytes


@pytest.mark.slow
def test_the_unit_called_last_is_probed_on_its_own(mesh):
    """The einsum LM of the foreign-models benchmark (4 blocks), between the FSDP peaks with and
    without units: the plan shards 3 of the 4 units, keeps the last one replicated, fits by XLA
    and is predicted within 1%. The unit the forward pass calls last runs its backward pass first,
    at the activation peak: sharding it saves what its gradient costs at the next unit's backward
    pass, not what the others save. One more probe (every unit but the last sharded) measures it
    (``Calibration.last_saving``). On the 8-block LM, when this probe was added, the plan that
    shards 7 of 8 was predicted 14.7% high charged as the others, and 5.5% low charged nothing."""
    from osdp_jax.core.hardware import default_hardware
    from osdp_jax.planning import ProbeKind, XlaCalibrator, build_problem, calibrate
    params, loss_fn, batch = foreign.einsum_lm(layers=4, d=128, batch=32)
    opt = optax.adam(1e-3)
    units = osdp_jax.units.find(loss_fn, params, batch)
    problem = build_problem(params, mesh, ("data",), ("replicate", "zero3"), (1,), loss_fn, batch)
    assert problem.last_unit == "block_3" and set(problem.units.values()) == set(units.values())
    got = calibrate(problem, XlaCalibrator(loss_fn, opt, params, mesh, 2**40), {32: batch}, default_hardware(mesh))
    assert (ProbeKind.LAST, 32) in got.probes
    cal = got.calibrations[32]
    assert 0 < cal.last_saving < cal.kappa  # bytes of temp per byte sharded: the last unit saves less
    low, high = peaks(params, loss_fn, batch, opt, mesh, osdp_jax.Layout.fsdp(params, mesh, units=units),
                      osdp_jax.Layout.fsdp(params, mesh))
    plan = osdp_jax.plan(params, mesh, budget=int(low + (high - low) / 3), loss_fn=loss_fn, batch=batch, optimizer=opt)
    assert len(plan.units) == 3 and "block_3" not in plan.units and plan.xla_peak_bytes <= plan.budget_bytes
    assert abs(plan.predicted_peak_bytes - plan.xla_peak_bytes) <= 0.01 * plan.xla_peak_bytes, plan.summary()


def test_saved_bytes_are_the_backward_passes_residuals_other_than_inputs():
    """What a unit under full remat does not keep: for (x @ w1) @ w2 the hidden activation only
    (x, w1 and w2 are inputs; the output is not saved)."""
    from osdp_jax.runtime.units import saved_bytes
    p = {"w1": jax.ShapeDtypeStruct((64, 128), np.float32), "w2": jax.ShapeDtypeStruct((128, 64), np.float32)}
    x = jax.ShapeDtypeStruct((16, 64), np.float32)
    seen = []  # saved_bytes runs while the step is traced (discovery traces abstractly)
    jax.eval_shape(lambda p, x: seen.append(saved_bytes(lambda q, y: (y @ q["w1"]) @ q["w2"], p, (x,), {})) or 0, p, x)
    assert seen == [16 * 128 * 4]


@pytest.mark.slow
def test_units_share_the_measured_saving_by_their_activations(mesh):
    """A ResNet's blocks save activations 4:4:2:2:1:1 (the resolution halves while the width
    doubles) while their parameters grow the other way: the per-layer memory term counts each
    unit's share by its saved activations (``Problem.saving_bytes``), the unit called last none,
    and the shares sum to the saving units' bytes (so the all-units probe fits the same kappa)."""
    from osdp_jax.planning import build_problem
    params, loss_fn, batch = foreign.resnet((2, 2, 2), width=8, batch=8)
    problem = build_problem(params, mesh, ("data",), ("replicate", "zero3"), (1,), loss_fn, batch)
    saved = [problem.unit_saved[f"ResBlock_{i}"] for i in range(6)]
    assert saved[0] == saved[1] > saved[2] == saved[3] > saved[4] == saved[5] > 0
    assert problem.last_unit == "ResBlock_5"
    w = problem.saving_bytes()
    p = np.array([i.nbytes for i in problem.infos], dtype=float)
    unit = {f"ResBlock_{i}": np.array([problem.units.get(i_.path) == f"ResBlock_{i}" for i_ in problem.infos])
            for i in range(6)}
    share = {u: w[m].sum() / p[m].sum() for u, m in unit.items()}
    assert share["ResBlock_0"] > share["ResBlock_2"] > share["ResBlock_4"]
    saving = np.logical_or.reduce([m for u, m in unit.items() if u != "ResBlock_5"])
    np.testing.assert_allclose(w[saving].sum(), p[saving].sum())
    np.testing.assert_array_equal(w[~saving], p[~saving])  # the last unit and the parameters outside units


def test_a_unit_without_an_activation_figure_is_counted_by_bytes(mesh):
    """A unit call jax.vjp cannot trace (here a host callback, which has no derivative) gets no
    activation figure; the units' shares of the saving then fall back to their bytes."""
    from osdp_jax.planner.discover import find
    from osdp_jax.planning import build_problem

    @osdp_jax.units.unit
    def block(p, x):
        h = x @ p["w"]
        return x + jax.pure_callback(np.tanh, jax.ShapeDtypeStruct(h.shape, h.dtype), h)

    params = {f"l{i}": {"w": jax.ShapeDtypeStruct((64, 64), np.float32)} for i in range(3)}
    batch = {"x": jax.ShapeDtypeStruct((16, 64), np.float32)}

    def loss_fn(p, b):
        x = b["x"]
        for i in range(3):
            x = block(p[f"l{i}"], x)
        return x.mean()

    assert find(loss_fn, params, batch).saved == {"l0": None, "l1": None, "l2": None}
    problem = build_problem(params, mesh, ("data",), ("replicate", "zero3"), (1,), loss_fn, batch)
    assert len(set(problem.units.values())) == 3
    np.testing.assert_array_equal(problem.saving_bytes(), [64 * 64 * 4] * 3)


def _ddp_and_units(params, state, loss_fn, batch, units, opt, steps, mesh):
    """``{"ddp" | "units": (losses, final state)}``: ``steps`` steps of a stateful loss
    (``make_train_step(state=True)``) under DDP and under FSDP with ``units``."""
    runs = {}
    for name, layout in (("ddp", osdp_jax.Layout.ddp(params, mesh)),
                         ("units", osdp_jax.Layout.fsdp(params, mesh, units=units))):
        p = osdp_jax.shard(params, mesh, layout)
        o = osdp_jax.init_opt_state(opt, p, layout, mesh)
        step = osdp_jax.make_train_step(loss_fn, opt, layout, mesh, state=True)
        s, losses = state, []
        for _ in range(steps):
            p, o, loss, s = step(p, o, batch, s)
            losses.append(float(loss))
        runs[name] = losses, s
    return runs


@pytest.mark.slow
def test_units_with_batch_statistics_train_like_ddp_and_plan(mesh):
    """A linen ResNet with BatchNorm (``foreign.resnet_bn``): its blocks are units, their new
    statistics leaving each unit as outputs and going back into the model's scope. Training with
    units equals DDP on the same mesh, losses and statistics (each device normalises its own
    slice of the batch either way); the eval step, with the statistics immutable, equals one
    device; a plan under FSDP's peak without units takes units and fits by XLA."""
    params, stats, loss_fn, batch = foreign.resnet_bn((1, 1))
    plain = lambda p, b: loss_fn(p, b, stats)[0]  # noqa: E731 - the planner's loss: statistics fixed
    units = osdp_jax.units.find(plain, params, batch)
    assert sorted(set(units.values())) == [f"ResBlock_{i}" for i in range(2)]
    opt = optax.adam(1e-3)
    runs = _ddp_and_units(params, stats, loss_fn, batch, units, opt, 2, mesh)
    np.testing.assert_allclose(runs["units"][0], runs["ddp"][0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(runs["units"][1]), jax.tree.leaves(runs["ddp"][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    model = foreign.ResNet((1, 1), 16, norm="batch")
    layout = osdp_jax.Layout.fsdp(params, mesh, units=units)

    def xent(p, b, state):
        logits = model.apply({"params": p, **state}, b["x"], train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()
    evaluate = osdp_jax.make_eval_step(xent, layout, mesh, state=True)
    got = evaluate(osdp_jax.shard(params, mesh, layout), jax.device_put(batch, osdp_jax.batch_sharding(mesh, layout)),
                   stats)
    np.testing.assert_allclose(float(got), float(xent(params, batch, stats)), rtol=1e-5)
    peaks = [osdp_jax.profile_step(plain, opt, params, batch, mesh, layout).peak_bytes
             for layout in (osdp_jax.Layout.fsdp(params, mesh), layout)]
    assert peaks[1] < peaks[0]
    # planned with the train step's own loss (state=; that it plans as its closure does is
    # test_plan_takes_the_train_steps_loss_with_aux_rng_and_state's)
    plan = osdp_jax.plan(params, mesh, budget=sum(peaks) // 2, loss_fn=loss_fn, state=stats, batch=batch,
                         optimizer=opt)
    assert plan.units and plan.xla_peak_bytes <= plan.budget_bytes
    # again, with the state as shapes: every probe is found in the process's cache
    again = osdp_jax.plan(params, mesh, budget=sum(peaks) // 2, loss_fn=loss_fn, batch=batch, optimizer=opt,
                          state=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), stats))
    assert again.layout == plan.layout and again.compiles == 0


def test_plan_takes_the_train_steps_loss_with_aux_rng_and_state(mesh):
    """``plan(has_aux=, rng=, state=)``: a loss written for ``make_train_step`` with those flags is
    planned as it is (``PlainLoss``); a tuple returned without them is one clear error."""
    import toy
    params, loss_fn = toy.plain_params(layers=1), toy.plain_loss
    batch = toy.tokens(32)

    def with_all(p, b, rng, state):
        return loss_fn(p, b) + 0 * jax.random.uniform(rng) + 0 * state["n"], ({"rows": b.shape[0]}, state)
    kw = dict(batch=batch, optimizer=optax.adam(1e-3), units=(), splits=(1,), verify=False)
    # a budget between the all-zero3 and all-replicated peaks, so that the plan compared is mixed
    peaks = [osdp_jax.plan(params, mesh, budget="64GB", loss_fn=loss_fn, strategies=(s,), **kw).predicted_peak_bytes
             for s in ("zero3", "replicate")]
    kw["budget"] = int(sum(peaks) / 2)
    plan = osdp_jax.plan(params, mesh, loss_fn=with_all, has_aux=True, rng=True, state={"n": np.float32(1)}, **kw)
    assert {"zero3", "replicate"} <= set(jax.tree.leaves(plan.strategies)), plan.summary()
    assert plan.layout == osdp_jax.plan(params, mesh, loss_fn=loss_fn, **kw).layout
    with pytest.raises(TypeError, match="must return a scalar loss"):
        osdp_jax.plan(params, mesh, loss_fn=lambda p, b: (loss_fn(p, b), {}), **kw)


@pytest.mark.slow
def test_nnx_units_with_batch_statistics_and_dropout_train_like_ddp(mesh):
    """An nnx model whose marked blocks hold BatchNorm statistics and dropout rng state
    (``foreign.nnx_bn_mlp``): each unit's other state leaves it as an output and is written back
    (``nnx.update``). Training with units equals DDP on the same mesh, losses and new state; the
    rng counts advance as on one device (integer state is kept, not summed over devices)."""
    params, state, loss_fn, batch = foreign.nnx_bn_mlp()
    plain = lambda p, b: loss_fn(p, b, state)[0]  # noqa: E731
    units = osdp_jax.units.find(plain, params, batch)
    assert sorted(set(units.values())) == [f"blocks/{i}" for i in range(4)]
    # plan() takes the same loss with its state, rng keys and all
    plan = osdp_jax.plan(params, mesh, budget="64GB", loss_fn=loss_fn, state=state, batch=batch,
                         optimizer=optax.sgd(0.01), verify=False, units=())
    assert plan.batch_size == 32 and plan.predicted_peak_bytes > 0
    opt = optax.sgd(0.01)
    runs = _ddp_and_units(params, state, loss_fn, batch, units, opt, 3, mesh)
    np.testing.assert_allclose(runs["units"][0], runs["ddp"][0], rtol=1e-5)
    one = state
    for _ in range(3):
        one = loss_fn(params, batch, one)[1]
    for got, ddp, ref in zip(*(jax.tree.leaves(runs[k][1]) for k in ("units", "ddp")), jax.tree.leaves(one)):
        if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
            got, ddp, ref = (jax.random.key_data(x) for x in (got, ddp, ref))
        if np.issubdtype(np.asarray(got).dtype, np.floating):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ddp), rtol=1e-5, atol=1e-6)
        else:  # rng keys and counts: as one device's after three steps
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
            np.testing.assert_array_equal(np.asarray(ddp), np.asarray(ref))


def _counted_plain_mlp(calls, layers=3, d=16, batch=8):
    """A plain-JAX MLP of ``@osdp_jax.units.unit`` blocks whose Python counts its runs in ``calls``."""
    @osdp_jax.units.unit
    def block(p, x):
        calls.append(1)
        return x + jnp.tanh(x @ p["w1"]) @ p["w2"]
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    params = {f"layer{i}": {"w1": 0.1 * jax.random.normal(keys[2 * i], (d, 2 * d)),
                            "w2": 0.1 * jax.random.normal(keys[2 * i + 1], (2 * d, d))} for i in range(layers)}

    def loss_fn(p, b):
        x = b
        for i in range(layers):
            x = block(p[f"layer{i}"], x)
        return (x ** 2).mean()
    return params, loss_fn, jnp.ones((batch, d))


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", [("nnx", "ddp"), ("nnx", "units"), ("plain", "units")])
def test_identical_units_are_traced_once_per_step_and_compile_the_same(mesh, monkeypatch, model, layout):
    """The Python of an nnx unit, or of a ``@osdp_jax.units.unit`` function, runs once per step
    trace for all its calls (``runtime.units.shared``: the later calls reuse the first one's
    trace, and JAX its derivatives), and, under the default unit remat ("full"), XLA's figures
    of the step are those of the step traced call by call."""
    calls = []
    if model == "nnx":
        block_call = foreign.VitBlock.__call__
        monkeypatch.setattr(foreign.VitBlock, "__call__", lambda self, x: calls.append(1) or block_call(self, x))
        params, loss_fn, batch = foreign.vit(depth=3, d=16, batch=8)
    else:
        params, loss_fn, batch = _counted_plain_mlp(calls)
    opt = optax.adam(1e-3)
    lay = (osdp_jax.Layout.ddp(params, mesh) if layout == "ddp" else
           osdp_jax.Layout.fsdp(params, mesh, units=osdp_jax.units.find(loss_fn, params, batch)))
    assert layout == "ddp" or len(set(lay.units.values())) == 3  # every block a unit

    def traced():
        osdp_jax.planning.clear_compiled()
        jax.clear_caches()
        calls.clear()
        prof = osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, lay, figures_only="probe")
        return len(calls), (prof.peak_bytes, prof.temp_bytes, prof.flops)
    shared, figures = traced()
    monkeypatch.setattr(osdp_jax.runtime.units, "shared", lambda key, fn: fn)
    each, figures_each = traced()
    assert shared >= 1 and each == 3 * shared, (shared, each)
    assert figures == figures_each


def test_nnx_units_with_other_state_are_traced_once_per_step(mesh, monkeypatch):
    """The calls of nnx units that hold batch statistics and dropout rng state (``foreign.nnx_bn_mlp``)
    share one trace per step too; ``test_nnx_units_with_batch_statistics_and_dropout_train_like_ddp``
    checks that their training, rng counts and all, is unchanged."""
    calls = []
    block_call = foreign.BnBlock.__call__
    monkeypatch.setattr(foreign.BnBlock, "__call__", lambda self, x: calls.append(1) or block_call(self, x))
    params, state, loss_fn, batch = foreign.nnx_bn_mlp(depth=3, d=32, batch=16)
    units = osdp_jax.units.find(lambda p, b: loss_fn(p, b, state)[0], params, batch)
    layout, opt = osdp_jax.Layout.fsdp(params, mesh, units=units), optax.sgd(0.01)
    p = osdp_jax.shard(params, mesh, layout)
    o = osdp_jax.init_opt_state(opt, p, layout, mesh)

    def traced():
        calls.clear()
        osdp_jax.make_train_step(loss_fn, opt, layout, mesh, state=True).lower(p, o, batch, state)
        return len(calls)
    shared = traced()
    monkeypatch.setattr(osdp_jax.runtime.units, "shared", lambda key, fn: fn)
    assert shared >= 1 and traced() == 3 * shared


def test_a_shared_call_whose_key_cannot_be_hashed_is_a_plain_call():
    """``runtime.units.shared`` with a key that cannot be hashed (a graph definition holding an
    array) runs the call plainly, each time, and gives the same result."""
    from osdp_jax.runtime import units as runtime_units
    from osdp_jax.runtime.context import StepContext, active
    calls, ctx = [], StepContext()
    with active(ctx):
        f = runtime_units.shared(({"unhashable": 1},), lambda t, x: calls.append(1) or t * x)
        out = jax.jit(lambda t, x: f(t, x) + f(t, x))(jnp.full(2, 2.0), jnp.full(2, 3.0))
    np.testing.assert_array_equal(np.asarray(out), [12.0, 12.0])
    assert len(calls) == 2 and ctx.shared == {}


def test_submodules_under_the_models_own_nn_remat_are_named_in_one_warning(caplog):
    """Under nn.remat a block's parameters are the transform's values, not the params: it cannot
    be a unit, and discovery says so once, naming the outermost blocks and the fix (drop the
    nn.remat: a unit runs under jax.checkpoint already). So under jax.checkpoint around the whole
    apply, where the warning named a Flax lifted transform the model did not use. Without either
    the blocks are unit call sites and nothing is said."""
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + nn.Dense(16)(jnp.tanh(nn.Dense(32)(x)))

    def model(remat):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                for i in range(3):
                    x = (nn.remat(Block) if remat else Block)(name=f"block_{i}")(x)
                return x.mean()
        return Net()

    x = jnp.ones((16, 16))
    for remat in (True, False, "jax.checkpoint"):
        net = model(remat is True)
        params = net.init(jax.random.key(0), x)["params"]
        caplog.clear()
        apply = lambda p, b: net.apply({"params": p}, b)  # noqa: E731
        with caplog.at_level("WARNING", logger="osdp_jax"):
            found = osdp_jax.planner.discover.find(jax.checkpoint(apply) if remat else apply, params, x)
        said = [r.getMessage() for r in caplog.records if "through a transform" in r.getMessage()]
        sites = {name for _, name, _ in found.units}
        if remat:  # nn.remat around each block, or jax.checkpoint around the whole apply
            assert len(said) == 1 and "3 submodule(s)" in said[0] and "e.g. block_0, block_1, block_2" in said[0]
            assert "drop the transform" in said[0] and not sites & {"block_0", "block_1", "block_2"}
        else:
            assert not said and {"block_0", "block_1", "block_2"} <= sites
