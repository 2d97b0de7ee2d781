"""The prepared one-GPU script (experiments/benchmarks/gpu.py) runs end to end in its smoke mode."""
import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_gpu_script_smoke(tmp_path):
    """gpt2-mini through every variant on this machine's device: the report and JSON are written,
    the forced split really splits, and each row has measured figures."""
    done = subprocess.run([sys.executable, "experiments/benchmarks/gpu.py", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu.json").read_text())
    assert [r["variant"] for r in rows] == ["plan", "split off", "split k=4"]
    by = {r["variant"]: r for r in rows}
    assert by["split k=4"]["split_kernels"] > 0 and by["split off"]["split_kernels"] == 0
    assert all(r["step_s"] > 0 and r["xla_peak"] > 0 for r in rows)
    assert by["plan"]["predicted_peak"] > 0
    assert "| gpt2-mini | split k=4" in (tmp_path / "gpu.md").read_text()
