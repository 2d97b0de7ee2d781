"""Checkpoints: exact resume after SIGKILL, a kill during a save, resharding on restore, export,
and the errors for a checkpoint of another model, an existing run and a non-finite loss."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import cli, config, runner
from experiments.checkpoint import Checkpoints, fingerprint

CONFIG = "experiments/gpt2_mini.toml"
ARGS = ["--steps", "6", "--checkpoint-every", "2", "--plan.batch_sizes=32", "--plan.splits=1"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_killed(out, kill_code: str):
    """Train CONFIG in a fresh process that SIGKILLs itself where ``kill_code`` says."""
    script = "\n".join([
        "import os, signal",
        'os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"',
        "import jax",
        'jax.config.update("jax_num_cpu_devices", 8)',
        "from experiments import cli, runner",
        "def die():",
        "    os.kill(os.getpid(), signal.SIGKILL)",
        textwrap.dedent(kill_code),
        f"cli.main(['train', {CONFIG!r}, '--out', {str(out)!r}, *{ARGS!r}])",
    ])
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]


def _export(run, tmp_path, name):
    path = tmp_path / f"{name}.npz"
    assert cli.main(["export", str(run), "--out", str(path)]) == 0
    with np.load(path) as f:
        return dict(f)


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "full"
    assert cli.main(["train", CONFIG, "--out", str(out), *ARGS]) == 0
    return out


def _same_run(run, reference, tmp_path):
    assert _losses(run) == pytest.approx(_losses(reference), rel=1e-6, abs=0)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(6))
    mine, theirs = _export(run, tmp_path, "mine"), _export(reference, tmp_path, "theirs")
    assert mine.keys() == theirs.keys()
    for k in mine:
        np.testing.assert_allclose(mine[k], theirs[k], rtol=1e-6, atol=0)


def test_sigkill_then_resume_equals_uninterrupted(tmp_path, uninterrupted):
    out = tmp_path / "killed"
    # killed after step index 2 ran (3 steps done): checkpoint 2 exists, and the metrics of step
    # index 2 were logged past it
    _run_killed(out, """
        original = runner.train
        def train(*a, **kw):
            return original(*a, **kw, on_step=lambda step: die() if step == 2 else None)
        runner.train = train
    """)
    assert Checkpoints(out / "checkpoints").steps() == [2]
    assert cli.main(["train", CONFIG, "--out", str(out), *ARGS, "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2
    _same_run(out, uninterrupted, tmp_path)


@pytest.mark.slow  # ~60 s; keeps the default suite near 10 minutes
def test_kill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, uninterrupted):
    out = tmp_path / "killed_in_save"
    # killed inside orbax's commit of checkpoint 4: its data are written, the rename is not done
    _run_killed(out, """
        from orbax.checkpoint._src.path import atomicity
        finalize = atomicity.AtomicRenameTemporaryPath.finalize
        async def dying_finalize(self, *a, **kw):
            if "4" in str(self._final_path).rsplit("/", 1)[-1]:
                die()
            return await finalize(self, *a, **kw)
        atomicity.AtomicRenameTemporaryPath.finalize = dying_finalize
    """)
    leftovers = [p.name for p in (out / "checkpoints").iterdir()]
    assert any("tmp" in name for name in leftovers), leftovers  # the half-written save is there...
    assert Checkpoints(out / "checkpoints").steps() == [2]  # ...and is not taken for a checkpoint
    assert cli.main(["train", CONFIG, "--out", str(out), *ARGS, "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 2
    _same_run(out, uninterrupted, tmp_path)


def test_restore_on_four_devices_under_another_plan(uninterrupted):
    cfg = config.load(CONFIG, {"plan.batch_sizes": "32"})
    s = runner.setup(cfg)
    abstract = s.abstract_params()
    ckpt = Checkpoints(uninterrupted / "checkpoints")
    step = ckpt.latest()

    def targets(mesh, spec_of):
        place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec_of(x)))  # noqa: E731
        return (jax.tree.map(place, abstract),
                jax.tree.map(place, jax.eval_shape(s.optimizer.init, abstract)))

    eight = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    four = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    saved, saved_opt, _ = ckpt.restore(step, *targets(eight, lambda x: P()), fingerprint(abstract))
    # on 4 devices, every parameter whose first dimension 4 divides sharded along it
    shard4 = lambda x: P("data") if x.shape and x.shape[0] % 4 == 0 else P()  # noqa: E731
    params, opt_state, meta = ckpt.restore(step, *targets(four, shard4), fingerprint(abstract))
    ckpt.close()
    assert meta["step"] == step == 6
    leaves = jax.tree.leaves(params)
    assert any(len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated for x in leaves)
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((saved, saved_opt))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checkpoint_of_another_model_is_refused(tmp_path, uninterrupted, capsys):
    code = cli.main(["train", "experiments/opt_mini.toml", "--out", str(uninterrupted), "--resume",
                     "--steps", "8", "--plan.batch_sizes=32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is of another model" in err and len(err.splitlines()) == 1
    assert Checkpoints(uninterrupted / "checkpoints").steps() == [4, 6]  # nothing lost


def test_existing_run_without_resume_is_refused(uninterrupted, capsys):
    before = (uninterrupted / "metrics.jsonl").read_text()
    assert cli.main(["train", CONFIG, "--out", str(uninterrupted), *ARGS]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert (uninterrupted / "metrics.jsonl").read_text() == before


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "nan"
    code = cli.main(["train", CONFIG, "--out", str(out), "--steps", "30", "--checkpoint-every", "1",
                     "--plan.batch_sizes=32", "--optim.name=sgd", "--optim.learning_rate=1e12"])
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("osdp-jax: error")]
    assert code == 2 and len(err) == 1
    err = err[0]
    assert "training diverged" in err and "last good checkpoint, step" in err
    ckpt = Checkpoints(out / "checkpoints")
    assert ckpt.steps(), "the checkpoints before the divergence are kept"
    cfg = config.load(CONFIG, {"plan.batch_sizes": "32", "optim.name": "sgd"})
    s = runner.setup(cfg)
    params = ckpt.restore_params(ckpt.latest(), s.abstract_params(), s.optimizer)
    ckpt.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


@pytest.mark.slow
def test_export_and_import_round_trip(tmp_path, uninterrupted):
    exported = _export(uninterrupted, tmp_path, "p")
    out = tmp_path / "from_npz"
    assert cli.main(["train", CONFIG, "--out", str(out), "--steps", "1", "--plan.batch_sizes=32",
                     "--init-params", str(tmp_path / "p.npz")]) == 0
    # the first loss from the imported parameters is the loss the finished run would see
    first = _losses(out)[0]
    assert first < _losses(uninterrupted)[0]
    assert sorted(exported) == sorted(p for p, *_ in fingerprint(
        runner.setup(config.load(CONFIG)).abstract_params()))
