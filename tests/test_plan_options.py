"""Every combination of documented ``plan()`` options ends in a plan that fits, an
``InfeasibleBudgetError`` naming the least budget that fits, or one ``ValueError`` naming the
option: never an internal exception. Drawn with ``hypothesis`` over small models (a linen stack
of uneven widths with LayerNorm, and a plain layer stack), on 1-D and 2-D meshes."""
import foreign
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import osdp_jax


def _uneven(batch):
    """An unrolled linen MLP of uneven widths with LayerNorm (kernels that split differently)."""
    from flax import linen as nn

    class Uneven(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (96, 16, 128):
                h = nn.Dense(width, use_bias=False)(nn.LayerNorm()(x))
                x = x + nn.Dense(x.shape[-1], use_bias=False)(jax.nn.gelu(h))
            return x

    model = Uneven()
    rng = np.random.default_rng(0)
    data = {"x": jnp.asarray(rng.normal(size=(batch, 32)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(batch, 32)), jnp.float32)}
    params = model.init(jax.random.key(0), data["x"])["params"]
    return params, lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2), data


MODELS = {"uneven linen": _uneven, "layer stack": lambda batch: foreign.lax_scanned(d=32, depth=4, batch=batch,
                                                                                     stack=True)}

OPTIONS = st.fixed_dictionaries({
    "model": st.sampled_from(sorted(MODELS)),
    "mesh": st.sampled_from([(8,), (2, 4)]),
    "strategies": st.lists(st.sampled_from(["replicate", "zero3", "zero2", "hsdp"]), min_size=1, max_size=3,
                           unique=True),
    "splits": st.lists(st.sampled_from([1, 2, 4, 8, 3]), min_size=1, max_size=3, unique=True),
    "microbatches": st.sampled_from([(1,), (1, 2), (2,), (3,)]),
    "units": st.sampled_from([None, ()]),
    "batch_sizes": st.sampled_from([None, (16,), (8, 16), (12,)]),
    "remat": st.sampled_from([("full",), ("full", "dots", "none"), ("none",)]),
    "compute_dtype": st.sampled_from([None, "bfloat16"]),
    "budget": st.sampled_from(["least", "1KiB", "400KiB", "4MiB", "1GB"]),
})


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(OPTIONS)
def test_any_documented_options_end_in_a_plan_an_infeasible_budget_or_a_clear_error(options):
    options = dict(options)
    model, shape = options.pop("model"), options.pop("mesh")
    names = ("data",) if len(shape) == 1 else ("node", "data")
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    params, loss_fn, batch = MODELS[model](16)
    try:
        plan = osdp_jax.plan(params, mesh, loss_fn=loss_fn, batch=batch, optimizer=optax.sgd(0.1), **options)
    except osdp_jax.InfeasibleBudgetError as e:
        assert isinstance(e.min_bytes, int) and e.min_bytes > osdp_jax.parse_bytes(options["budget"])
        assert "smallest budget that fits" in str(e)
        return
    except ValueError as e:
        # one clear error names the option it is about
        assert any(word in str(e) for word in ("strateg", "split", "microbatch", "batch size", "hsdp", "mesh")), e
        return
    assert plan.xla_peak_bytes is not None and plan.xla_peak_bytes <= plan.budget_bytes
    assert set(plan.counts()) <= set(options["strategies"]) | {"replicate"}
    assert plan.batch_size in (options["batch_sizes"] or (16,))
    for pp in plan.params:
        assert pp.split == 1 or pp.split in options["splits"]


@pytest.mark.parametrize("splits", [(8,), pytest.param((3,), marks=pytest.mark.slow)])
def test_a_split_count_a_parameter_cannot_take_leaves_it_unsplit(mesh, splits):
    """``splits=(8,)`` on a model whose LayerNorm vectors cannot split 8 ways (the regression of
    ``ValueError: item 0 has no available choice``), and ``(3,)``, which only some kernels can
    take: planned, with only the kernels that can take the count split."""
    params, loss_fn, batch = _uneven(16)
    plan = osdp_jax.plan(params, mesh, budget="1GB", loss_fn=loss_fn, batch=batch, optimizer=optax.sgd(0.1),
                         strategies=("zero3",), splits=splits)
    assert plan.xla_peak_bytes <= plan.budget_bytes
    split = [pp for pp in plan.params if pp.split > 1]
    assert split and all(pp.split in (1, *splits) for pp in plan.params)
    for pp in split:  # a kernel takes k only if k times the devices divides its sharded dimension
        dim = next(i for i, e in enumerate(pp.spec) if e is not None)
        assert pp.shape[dim] % (8 * pp.split) == 0 and "LayerNorm" not in pp.path


TENSOR_OPTIONS = st.fixed_dictionaries({
    "model": st.sampled_from(sorted(MODELS)),
    "tensor": st.sampled_from(["auto", {}]),
    "model_sizes": st.sampled_from([None, (2,), (1, 4), "auto"]),
    "strategies": st.lists(st.sampled_from(["replicate", "zero3", "zero2", "hsdp"]), min_size=1, max_size=3,
                           unique=True),
    "splits": st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=2, unique=True),
    "microbatches": st.sampled_from([(1,), (1, 2)]),
    "units": st.sampled_from([None, ()]),
    "batch_sizes": st.sampled_from([None, (4,), (4, 8)]),
    "compute_dtype": st.sampled_from([None, "bfloat16"]),
    "budget": st.sampled_from(["least", "1KiB", "4MiB", "1GB"]),
})


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(TENSOR_OPTIONS)
def test_any_tensor_parallel_options_end_in_a_plan_an_infeasible_budget_or_a_clear_error(options):
    """The same on a 2 (data) x 4 (model) mesh with ``tensor=`` and ``model_sizes=``: a plan that
    fits on the mesh it names (``Plan.make_mesh``), or one of the two errors."""
    options = dict(options)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params, loss_fn, batch = MODELS[options.pop("model")](8)
    try:
        plan = osdp_jax.plan(params, mesh, loss_fn=loss_fn, batch=batch, optimizer=optax.sgd(0.1), **options)
    except osdp_jax.InfeasibleBudgetError as e:
        assert isinstance(e.min_bytes, int) and e.min_bytes > osdp_jax.parse_bytes(options["budget"])
        return
    except ValueError as e:
        assert any(word in str(e) for word in ("strateg", "split", "microbatch", "batch size", "hsdp", "mesh",
                                               "model")), e
        return
    assert plan.xla_peak_bytes is not None and plan.xla_peak_bytes <= plan.budget_bytes
    assert set(plan.counts()) <= set(options["strategies"]) | {"replicate"}
    assert plan.batch_size in (options["batch_sizes"] or (8,))
    shape = dict(plan.mesh_shape)
    assert shape["data"] * shape["model"] == 8 and plan.make_mesh().shape == shape
    if plan.model_axis:
        assert all(pp.strategy in ("replicate", "zero3") and pp.split == 1 for pp in plan.params if pp.tensor)
