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
