"""Group sharding on a (2 nodes x 4 devices) mesh: hsdp collectives run over the right device
groups, two-stage zero3 equals one ring, memory matches, and a slow inter-node link steers the
search to hsdp."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy
from jax.sharding import PartitionSpec as P

import osdp_jax
from osdp_jax import Layout, compile_step, profile_compiled
from osdp_jax.runtime.step import build_step

AXES = ("replica", "data")


@pytest.fixture(scope="module")
def mesh2d():
    return jax.make_mesh((2, 4), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _groups(hlo: str, op: str) -> set:
    """The replica groups of every ``op`` in compiled HLO, as frozensets of device ids."""
    found = set()
    for line in hlo.splitlines():
        if not re.search(rf"\s{op}(-start)?\(", line):
            continue
        m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
        if m:
            found |= {frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d,]+)\}", m.group(1))}
            continue
        m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
        if m:  # iota form: [groups, size] <= [dims] transposed by perm
            g, size = int(m.group(1)), int(m.group(2))
            dims = tuple(map(int, m.group(3).split(",")))
            ids = np.arange(np.prod(dims)).reshape(dims)
            if m.group(4):
                ids = ids.transpose(tuple(map(int, m.group(4).split(","))))
            found |= {frozenset(row) for row in ids.reshape(g, size).tolist()}
            continue
        m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
        if m:  # mesh form (jaxlib 0.12): the mesh's axes and sizes, then the axes each group spans
            axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
            spanned = re.findall(r"'(\w+)'", m.group(2))
            ids = np.arange(np.prod([size for _, size in axes])).reshape([size for _, size in axes])
            order = [i for i, (name, _) in enumerate(axes) if name not in spanned] + [
                i for i, (name, _) in enumerate(axes) if name in spanned]
            size = int(np.prod([s for name, s in axes if name in spanned]))
            found |= {frozenset(row) for row in ids.transpose(order).reshape(-1, size).tolist()}
    return found


def test_hsdp_collectives_run_over_the_node_groups(mesh2d):
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    loss_fn = lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2)  # noqa: E731
    specs = {"w": P("data"), "b": P()}  # hsdp: sharded inside a node, replicated across nodes
    compiled = compile_step(loss_fn, optax.sgd(0.1), params, jnp.ones((16, 64)), mesh2d,
                            Layout.from_specs(params, mesh2d, specs))
    hlo = compiled.as_text()
    ids = np.vectorize(lambda d: d.id)(mesh2d.devices)  # (2, 4): row = node
    nodes = {frozenset(row) for row in ids.tolist()}
    across = {frozenset(col) for col in ids.T.tolist()}
    assert _groups(hlo, "all-gather") == nodes
    assert _groups(hlo, "reduce-scatter") == nodes
    # the gradient shard is all-reduced across nodes; the replicated bias over all 8 devices
    assert across <= _groups(hlo, "all-reduce")
    # per-device memory: w is stored 1/4 per device (inside the node), not 1/8
    assert profile_compiled(compiled).argument_bytes < 64 * 32 * 4


@pytest.mark.parametrize("specs,two_stage", [({"w": P("data")}, ()),
                                             ({"w": P(("replica", "data"))}, ("w",)),
                                             ({"w": P(("replica", "data"))}, ())])
def test_hsdp_and_two_stage_train_like_one_device(mesh2d, specs, two_stage):
    params = toy.plain_params(layers=1)
    infos = osdp_jax.describe(params)
    all_specs = {i.path: P() for i in infos} | {f"block0/{k}": v for k, v in {"w1": specs["w"]}.items()}
    opt = optax.adam(1e-2)
    batch = toy.tokens(16)
    step = jax.jit(build_step(toy.plain_loss, opt, mesh2d, Layout.from_specs(
        params, mesh2d, all_specs, two_stage={f"block0/{p}1" for p in two_stage})))
    expected, _ = toy.single_device_run(params, toy.plain_loss, opt, batch, 3)
    state, p = opt.init(params), params
    losses = []
    for _ in range(3):
        p, state, loss = step(p, state, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    if two_stage:  # gathered one axis at a time: an all-gather per axis
        hlo = step.lower(params, opt.init(params), batch).compile().as_text()
        ids = np.vectorize(lambda d: d.id)(mesh2d.devices)
        assert {frozenset(r) for r in ids.tolist()} <= _groups(hlo, "all-gather")
        assert {frozenset(c) for c in ids.T.tolist()} <= _groups(hlo, "all-gather")


def _hardware(inter_node_bandwidth):
    base = osdp_jax.PRESETS["titan-rtx-pcie3"]
    links = {} if inter_node_bandwidth is None else {
        "replica": {"bandwidth": inter_node_bandwidth, "latency": 50e-6}}
    import dataclasses
    return dataclasses.replace(base, links=links)


def test_slow_inter_node_link_picks_hsdp(mesh2d):
    params = toy.plain_params()
    kw = dict(budget="8GB", loss_fn=toy.plain_loss, batch=toy.tokens(32), optimizer=optax.adam(1e-3))
    big = [i.path for i in osdp_jax.describe(params) if i.nbytes >= 64 * 256 * 4]
    fast = osdp_jax.plan(params, mesh2d, hardware=_hardware(None), **kw)
    slow = osdp_jax.plan(params, mesh2d, hardware=_hardware(1e8), **kw)
    by_path = lambda plan: {pp.path: pp.strategy for pp in plan.params}  # noqa: E731
    # one uniform fast network: all-reducing everything over 8 devices is cheapest
    assert {by_path(fast)[p] for p in big} == {"replicate"}
    # a 100 MB/s link between the nodes: shard inside the node, all-reduce 1/4 across nodes
    assert {by_path(slow)[p] for p in big} == {"hsdp"}
    assert slow.xla_peak_bytes <= slow.budget_bytes
    assert abs(slow.predicted_peak_bytes - slow.xla_peak_bytes) <= 0.05 * slow.xla_peak_bytes
    # FSDP on the slow link gathers its large weights in two stages, the node first (small
    # ones stay in one ring: two stages pay two latencies)
    fsdp = osdp_jax.plan(params, mesh2d, hardware=_hardware(1e8), strategies=("zero3",), **kw)
    assert all(pp.two_stage for pp in fsdp.params if pp.path in big)
    again = osdp_jax.Plan.from_json(fsdp.to_json())
    assert again.two_stage == fsdp.two_stage and fsdp.two_stage


def test_split_hsdp_kernel_equals_unsplit(mesh2d):
    """An hsdp kernel split in slices: each slice gathered inside the node, same gradients."""
    params = {"w": jax.random.normal(jax.random.key(0), (64, 128)) * 0.1, "b": jnp.zeros((128,))}

    def loss_fn(p, x):
        return jnp.mean(jax.nn.gelu(osdp_jax.split.dense(x, p["w"], p["b"])) ** 2)

    keep = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    specs = {"w": P("data"), "b": P()}
    grads = {}
    for k in (1, 4):
        step = jax.jit(build_step(loss_fn, keep, mesh2d, Layout.from_specs(params, mesh2d, specs, splits={"w": k},
                                                                              dense={"w"})))
        _, grads[k], _ = step(params, keep.init(params), x)
    np.testing.assert_allclose(np.asarray(grads[4]["w"]), np.asarray(grads[1]["w"]), rtol=1e-5, atol=1e-7)


def test_hsdp_alone_on_a_one_axis_mesh_is_one_clear_error(mesh):
    """hsdp needs an inner and an outer data-parallel axis: asked for alone on a 1-D mesh it would
    replicate everything, so plan says so; in a list with zero3 (as by default) it is left out."""
    params = toy.plain_params(layers=1)
    with pytest.raises(ValueError, match=r"strategy 'hsdp' needs two or more data-parallel mesh axes.*\['data'\]"):
        osdp_jax.plan(params, mesh, budget="1GB", strategies=("hsdp",))
    assert osdp_jax.plan(params, mesh, budget="1GB", strategies=("zero3", "hsdp")).batch_size is None
