"""The probe store (``osdp_jax.planner.probe_store``): probe figures kept on disk, so that planning again
in a new process neither traces nor compiles a probe seen before, and never reads one of another
program."""
import json

import jax
import optax
import pytest
import toy

import osdp_jax
from osdp_jax.planner import probe_store as _probe_store
from osdp_jax.planning import clear_compiled, clear_probe_cache


def _fresh_process():
    """What a new process has: no probe, search or compiled step kept in memory."""
    clear_probe_cache()
    clear_compiled()


def _plan(mesh, budget):
    return osdp_jax.plan(toy.plain_params(), mesh, budget=budget, loss_fn=toy.plain_loss, batch=toy.tokens(32),
                         batch_sizes=(16, 32), optimizer=optax.adam(1e-3))


def _same(a, b):
    drop = ("planning_seconds", "compile_seconds", "search_seconds", "compiles", "probes_read")
    strip = lambda p: {k: v for k, v in json.loads(p.to_json()).items() if k not in drop}  # noqa: E731
    return strip(a) == strip(b)


@pytest.fixture
def store(tmp_path):
    _fresh_process()
    yield _probe_store.enable(tmp_path / "probes")
    _probe_store.disable()


@pytest.mark.slow
def test_a_new_process_reads_every_probe_and_plans_the_same(mesh, store):
    """A cold plan writes one file per probe; planned again with nothing in memory, the same plan
    comes back from the files, with the verification the only compile."""
    ddp = _plan(mesh, "64GB")  # DDP's peak: the budgets below are under it
    mid = int(0.7 * ddp.xla_peak_bytes)
    for f in store.glob("*.json"):
        f.unlink()
    _fresh_process()
    cold = _plan(mesh, mid)
    assert cold.probes_read == 0 and cold.compiles >= 3
    files = sorted(store.glob("*.json"))
    assert len(files) == cold.compiles - 1  # every probe, not the verification
    _fresh_process()
    again = _plan(mesh, mid)
    assert again.probes_read == len(files) and again.compiles == 1  # the chosen plan, verified
    assert _same(again, cold)
    assert f"{len(files)} probes read from the probe store" in again.summary()
    assert sorted(store.glob("*.json")) == files  # nothing written again


@pytest.mark.slow
def test_a_damaged_file_is_a_miss_and_is_written_again(mesh, store):
    mid = int(0.7 * _plan(mesh, "64GB").xla_peak_bytes)  # under DDP's peak: every probe compiled
    _fresh_process()
    cold = _plan(mesh, mid)
    files = sorted(store.glob("*.json"))
    assert len(files) >= 3
    files[0].write_text("{not json")
    files[1].write_text(json.dumps({"argument_bytes": 1}))  # another format
    _fresh_process()
    again = _plan(mesh, mid)
    assert again.probes_read == len(files) - 2 and _same(again, cold)
    for f in files[:2]:
        assert json.loads(f.read_text()).keys() >= {"temp_bytes", "flops", "collectives"}
    assert not list(store.glob(".tmp-*"))


@pytest.mark.slow
def test_another_mesh_or_another_osdp_jax_reads_nothing(mesh, store, monkeypatch):
    """The files are keyed by the devices and by osdp_jax's own source, as well as by the loss,
    the optimizer state, the parameters, the probe's layout and the batch."""
    _plan(mesh, "64GB")
    eight = set(store.glob("*.json"))
    _fresh_process()
    four = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    assert _plan(four, "64GB").probes_read == 0
    assert eight and set(store.glob("*.json")) > eight  # its probes written beside the others'
    _fresh_process()
    monkeypatch.setattr(_probe_store, "_source_digest", lambda: "another osdp_jax")
    assert _plan(mesh, "64GB").probes_read == 0


def test_timed_probes_and_losses_without_a_fingerprint_are_not_kept(store, mesh):
    layout = osdp_jax.Layout.ddp(toy.plain_params(), mesh)
    key = ("fingerprint", (), (), layout, (), mesh, False)
    assert _probe_store._file(key) is not None
    assert _probe_store._file(key[:-1] + (True,)) is None  # timed: this run's hardware
    assert _probe_store._file((toy.plain_loss,) + key[1:]) is None  # keyed by a function object
    _probe_store.disable()
    assert _probe_store._file(key) is None


def test_enable_compilation_cache_keeps_probes_beside_the_compiles(tmp_path):
    old = jax.config.jax_compilation_cache_dir
    try:
        path = osdp_jax.enable_compilation_cache(tmp_path / "xla")
        assert _probe_store.directory() == path / "probes" and (path / "probes").is_dir()
        osdp_jax.enable_compilation_cache(tmp_path / "xla", probes=False)
        assert _probe_store.directory() is None
    finally:
        osdp_jax.enable_compilation_cache(old, probes=False)
