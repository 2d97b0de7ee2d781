"""osdp-jax profile: the ring-model fit, a real (small) measurement, and profiles as hardware."""
import numpy as np
import pytest

import osdp_jax
from osdp_jax.cli import main as cli
from osdp_jax.core.hardware import load, resolve_hardware, save
from osdp_jax.core.profile import fit_ring, profile


def test_fit_recovers_latency_and_bandwidth():
    hw = osdp_jax.Hardware("truth", 2**30, 1e12, bandwidth=3e9, latency=40e-6)
    times = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
    for v in (2**14, 2**18, 2**22, 2**26):
        times["all_gather"].append((v, hw.all_gather(v, 8)))
        times["reduce_scatter"].append((v, hw.reduce_scatter(v, 8)))
        times["all_reduce"].append((v, hw.all_reduce(v, 8)))
    latency, bandwidth = fit_ring(times, 8)
    assert latency == pytest.approx(40e-6, rel=1e-6)
    assert bandwidth == pytest.approx(3e9, rel=1e-6)


def test_profile_measures_and_round_trips(mesh, tmp_path):
    hw, raw = profile(mesh, sizes=(2**14, 2**18), repeats=1)
    assert hw.flops > 0 and hw.bandwidth > 0 and hw.latency >= 0
    assert set(raw["collectives"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert "measured by osdp-jax profile" in hw.sources["bandwidth"]
    path = tmp_path / "p.json"
    save(hw, path, raw)
    assert load(path) == hw
    assert resolve_hardware(str(path), mesh) == hw
    with pytest.raises(ValueError, match="unknown hardware preset"):
        resolve_hardware(str(tmp_path / "missing.json"), mesh)


def test_profile_cli(tmp_path, capsys):
    out = tmp_path / "prof.json"
    assert cli.main(["profile", "--out", str(out), "--repeats", "1"]) == 0
    hw = load(out)
    assert np.isfinite(hw.bandwidth) and hw.name == "measured-cpu"
    assert "GFLOP/s" in capsys.readouterr().out


def test_profile_measures_each_axis_of_a_2d_mesh(tmp_path):
    import jax
    mesh = jax.make_mesh((2, 4), ("replica", "data"))
    hw, raw = profile(mesh, sizes=(2**14, 2**18), repeats=1)
    assert set(hw.links) == {"replica", "data"} and set(raw["per_axis"]) == {"replica", "data"}
    assert all(link["bandwidth"] > 0 and link["latency"] >= 0 for link in hw.links.values())
    # a collective over both axes runs at the slower link
    assert hw.link(("replica", "data"))[0] == min(link["bandwidth"] for link in hw.links.values())
    save(hw, tmp_path / "p.json", raw)
    assert load(tmp_path / "p.json") == hw


def test_a_cpu_mesh_is_measured_once_and_read_back(mesh, tmp_path, monkeypatch):
    """``default_hardware`` of a CPU mesh is measured (``profile``) the first time, kept as a
    profile file, and read back after, in this process and in the next (the file)."""
    from osdp_jax.core import profile as prof
    from osdp_jax.core.hardware import default_hardware
    monkeypatch.setenv(prof.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv("OSDP_JAX_CPU_PROFILE")  # the suite's fixed constants (conftest)
    monkeypatch.setattr(prof, "_MEASURED", {})
    calls = []
    measure = prof.profile
    monkeypatch.setattr(prof, "profile", lambda m: calls.append(m) or measure(m, sizes=(2**14, 2**18), repeats=1))
    hw = default_hardware(mesh)
    assert calls == [mesh] and hw.name == "measured-cpu" and "measured by osdp-jax profile" in hw.sources["flops"]
    assert [p.name for p in tmp_path.iterdir()] == [prof.cpu_profile_path(mesh).name]
    assert default_hardware(mesh) == hw and len(calls) == 1  # in-process
    monkeypatch.setattr(prof, "_MEASURED", {})
    assert default_hardware(mesh) == hw and len(calls) == 1  # from the file
    assert default_hardware(mesh, measure=False).name == "cpu"  # the nominal constants
    monkeypatch.setenv("OSDP_JAX_CPU_PROFILE", "nominal")
    assert default_hardware(mesh).name == "cpu"
    save(hw, tmp_path / "fixed.json")
    monkeypatch.setenv("OSDP_JAX_CPU_PROFILE", str(tmp_path / "fixed.json"))
    assert default_hardware(mesh) == hw and len(calls) == 1
    monkeypatch.setenv("OSDP_JAX_CPU_PROFILE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="OSDP_JAX_CPU_PROFILE=.*neither 'nominal' nor a readable profile"):
        default_hardware(mesh)


def test_overlap_is_measured_bounded_and_hides_collectives_behind_compute(mesh):
    """The overlap is measured in [0, 1]; a step's seconds are F + max(0, C - overlap F), by hand."""
    from osdp_jax.core.profile import measure_overlap
    from osdp_jax.planner.cost import items_within, step_seconds
    overlap, times = measure_overlap(mesh, ("data",), n=128, repeats=1)
    assert 0.0 <= overlap <= 1.0 and times["compute_s"] > 0 and times["both_s"] > 0
    with pytest.raises(ValueError, match="overlap must be between 0 and 1"):
        osdp_jax.Hardware("x", 2**30, 1e12, 1e9, 1e-5, overlap=1.5)
    assert step_seconds(10.0, 4.0, 0.0) == 14.0
    assert step_seconds(10.0, 4.0, 0.3) == 11.0  # 3 s of the 4 run behind the compute
    assert step_seconds(10.0, 4.0, 0.5) == 10.0  # all of them
    assert items_within(11.0, 10.0, 0.3) == 4.0 and items_within(9.0, 10.0, 0.3) == -1.0
