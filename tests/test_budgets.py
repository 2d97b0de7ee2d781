"""Planning at several budgets (``osdp_jax.plan_budgets``, ``planning.compile_ahead``) and the
in-process records that make planning again cheap (``_discover.find``, ``profile_compiled``)."""
import jax
import optax
import pytest
import toy

import osdp_jax
from osdp_jax.planning import clear_compiled, clear_probe_cache, compile_ahead
from osdp_jax.runtime.step import compile_count


def _fresh():
    clear_probe_cache()
    clear_compiled()


def _setup(mesh):
    _, params, loss_fn, batch = toy.stack_setup(n_layer=2, d_model=32, batch=32)
    opt = optax.adam(1e-3)
    in_loop = osdp_jax.discover(loss_fn, params, batch)[0]
    fsdp, ddp = [osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, make(params, mesh, in_loop=in_loop),
                                       figures_only="probe").peak_bytes
                 for make in (osdp_jax.Layout.fsdp, osdp_jax.Layout.ddp)]
    # two budgets between the FSDP and DDP peaks (mixed, per-layer plans), one above DDP's, one
    # below FSDP's that nothing meets
    budgets = [fsdp + (ddp - fsdp) // 3, fsdp + 2 * (ddp - fsdp) // 3, 2 * ddp, fsdp // 3]
    # few probe kinds (no units, splits or remat policies): the per-layer strategies remain
    return params, dict(loss_fn=loss_fn, batch=batch, optimizer=opt, units=(), splits=(1,), remat=("full",)), budgets


def _tried(params, mesh, **kw):
    try:
        return osdp_jax.plan(params, mesh, **kw)
    except osdp_jax.InfeasibleBudgetError as e:
        return e


@pytest.mark.slow
def test_plan_budgets_gives_plan_at_each_budget_with_the_later_compiles_done_ahead(mesh, monkeypatch):
    """``plan_budgets`` returns, per budget, the plan (or the error) ``plan()`` gives at that
    budget when planned one after the other, from the same empty caches, with the same number
    of compiles in all: the later budgets' drafts are compiled ahead, and a later plan that is its
    draft compiles nothing itself. ``compile_ahead`` compiles each layout once, and none that is
    kept; ``plan()`` then finds it."""
    from osdp_jax.planner import budgets as _budgets
    params, kw, budgets = _setup(mesh)
    ahead = []
    monkeypatch.setattr(_budgets, "compile_ahead", lambda *a, **k: ahead.append(compile_ahead(*a, **k)))
    _fresh()
    n0 = compile_count()
    alone = [_tried(params, mesh, budget=b, **kw) for b in budgets]
    n_alone = compile_count() - n0
    _fresh()
    n0 = compile_count()
    together = osdp_jax.plan_budgets(params, mesh, budgets, **kw)
    assert compile_count() - n0 == n_alone
    assert isinstance(alone[-1], osdp_jax.InfeasibleBudgetError)
    assert isinstance(together[-1], osdp_jax.InfeasibleBudgetError)
    assert together[-1].min_bytes == alone[-1].min_bytes
    for a, t in zip(alone[:-1], together[:-1]):
        assert (t.layout, t.batch_size, t.xla_peak_bytes) == (a.layout, a.batch_size, a.xla_peak_bytes)
    assert len({t.layout for t in together[:-1]}) == 3  # three different plans
    assert together[0].compiles == alone[0].compiles > 0  # the probes, planned alone
    drafts = [osdp_jax.plan(params, mesh, budget=b, verify=False, **kw) for b in budgets[1:3]]
    assert ahead == [1]  # the second budget's draft (the third's is DDP's layout, a probe's)
    assert together[1].layout == drafts[0].layout and together[1].compiles == 0 < alone[1].compiles
    assert together[2].compiles == alone[2].compiles == 0

    # compile_ahead alone: each layout once, what is kept not again, nothing without a loss function
    assert compile_ahead(params, mesh, drafts + drafts, **kw) == 0  # kept by plan_budgets
    clear_compiled()
    assert compile_ahead(params, mesh, drafts + drafts, **kw) == 2  # each once (the probes' steps forgotten too)
    assert compile_ahead(params, mesh, drafts) == 0
    assert compile_ahead(params, mesh, drafts, **{**kw, "batch_sizes": (8,)}) == 0  # each plan at its own size
    from osdp_jax.core import xla as _xla
    reads, read = [], _xla._profile
    monkeypatch.setattr(_xla, "_profile", lambda *a: reads.append(a) or read(*a))
    assert osdp_jax.plan(params, mesh, budget=budgets[1], **kw).compiles == 0
    assert reads == []  # its step's figures were read by compile_ahead, as its workers compiled


def test_plan_budgets_bad_input_is_one_error_before_any_compile(mesh):
    params, kw, _ = _setup(mesh)
    n0 = compile_count()
    with pytest.raises(TypeError, match="budgets="):
        osdp_jax.plan_budgets(params, mesh, ["1GB"], budget="1GB", **kw)
    with pytest.raises(ValueError):
        osdp_jax.plan_budgets(params, mesh, ["1GB", "lots"], **kw)
    with pytest.raises(TypeError, match="a list of budgets"):
        osdp_jax.plan_budgets(params, mesh, "8GB", **kw)
    assert compile_count() == n0
    assert osdp_jax.plan_budgets(params, mesh, [], **kw) == []


def test_a_bad_budget_is_the_only_thing_said(mesh, caplog):
    """A bad budget raises before the options are read: no warning about them comes first
    (here the default optimizer's, which plan() gives with optimizer=None)."""
    params, kw, _ = _setup(mesh)
    with caplog.at_level("WARNING", logger="osdp_jax"), pytest.raises(ValueError, match="lots"):
        osdp_jax.plan_budgets(params, mesh, ["1GB", "lots"], **{**kw, "optimizer": None})
    assert caplog.records == []


def test_a_loss_is_traced_once_per_shapes_for_discovery():
    """``_discover.find`` keeps what tracing a loss found, per function object and argument
    shapes; other shapes trace again, ``clear_probe_cache`` forgets it, and a batch leaf without
    a dtype is traced each time rather than failing."""
    from osdp_jax.planner.discover import find
    params, tokens = toy.plain_params(), toy.tokens(32)
    traced = []

    def loss(p, t):
        traced.append(1)  # runs once per trace
        return toy.plain_loss(p, t)

    first = find(loss, params, tokens)
    assert find(loss, params, tokens) is first and len(traced) == 1
    find(loss, params, toy.tokens(16))
    assert len(traced) == 2
    clear_probe_cache()
    assert find(loss, params, tokens).fingerprint == first.fingerprint and len(traced) == 3

    def scaled(p, b):  # a Python float in the batch: no dtype to key by, so traced every time
        traced.append(1)
        return b["scale"] * toy.plain_loss(p, b["tokens"])

    batch = {"tokens": tokens, "scale": 2.0}
    assert find(scaled, params, batch).fingerprint == find(scaled, params, batch).fingerprint
    assert len(traced) == 5


def test_a_compiled_steps_figures_are_read_once():
    """``profile_compiled`` keeps a step's figures with the executable (the same object again),
    read afresh for other missing FLOPs."""
    import jax.numpy as jnp
    compiled = jax.jit(lambda x: x @ x).lower(jnp.ones((8, 8))).compile()
    first = osdp_jax.profile_compiled(compiled)
    assert osdp_jax.profile_compiled(compiled) is first
    more = osdp_jax.profile_compiled(compiled, 10.0)
    assert more.flops == first.flops + 10.0 and more.peak_bytes == first.peak_bytes
