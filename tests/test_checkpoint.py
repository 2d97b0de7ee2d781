"""Checkpoints: exact resume after SIGKILL, a kill during a save, resharding on restore, export,
and the errors for a checkpoint of another model, an existing run and a non-finite loss."""
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import osdp_jax
from osdp_jax.cli import config, runner
from osdp_jax.cli import main as cli
from osdp_jax.cli.checkpoint import Checkpoints, fingerprint

CONFIG = "experiments/gpt2_mini.toml"
ARGS = ["--steps", "12", "--checkpoint-every", "3", "--plan.batch_sizes=32", "--budget", "1.35MiB"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLIT = ("blocks/layers/fc1/kernel", "blocks/layers/fc2/kernel")
# one worker runs this module (--dist loadgroup in pyproject.toml): its module fixtures (the
# uninterrupted run, 5 to 6 s) are then computed once, not once per worker
pytestmark = pytest.mark.xdist_group("checkpoint")


def _setup(args=ARGS):
    overrides = {"train.steps": args[1], "train.checkpoint_every": args[3]}
    overrides.update(a[2:].split("=", 1) for a in args if a.startswith("--plan."))
    if "--budget" in args:
        overrides["plan.budget"] = args[args.index("--budget") + 1]
    return runner.setup(config.load(CONFIG, overrides))


# session-scoped: a pytest-xdist worker may run other modules' tests between this module's, which
# would tear a module-scoped fixture down and train the run again
@pytest.fixture(scope="session")
def split_plan(tmp_path_factory):
    """A mixed plan with split kernels and layer segments, written by hand on the planner's
    parameter table (nothing compiled): the layer stack cut in two segments, layer 0 replicated
    with no remat, layer 1 with its FFN kernels zero3 gathered per layer in 2 slices and the
    matmul outputs saved (remat "dots"); the LM head zero3 gathered at its layer, the token
    embedding zero3 (looked up by the step's lookup), the rest replicated."""
    s = _setup()
    abstract, batch = s.abstract_params(), s.abstract_batch(32)
    base = osdp_jax.plan(abstract, s.mesh, budget="1GB", batch=batch, optimizer=s.optimizer,
                         strategies=("replicate",))
    in_loop, dense = osdp_jax.discover(s.loss_fn, abstract, batch)
    zero3 = {**{p: (P(None, "data"), 2) for p in SPLIT}, "lm_head/kernel": (P("data"), 1),
             "wte/embedding": (P("data"), 1)}
    pps = tuple(dataclasses.replace(pp, in_loop=pp.path in in_loop, dense=pp.path in dense - in_loop,
                                    **({"strategy": "zero3", "spec": zero3[pp.path][0], "split": zero3[pp.path][1]}
                                       if pp.path in zero3 else {}))
                for pp in base.params)
    pps = tuple(dataclasses.replace(pp, segments=(
        osdp_jax.Segment(0, 1, "replicate", 1, "none", P()),
        osdp_jax.Segment(1, 2, pp.strategy, pp.split, "dots", pp.spec))) if pp.in_loop else pp for pp in pps)
    plan = dataclasses.replace(base, params=pps)
    assert plan.segments["blocks/layers/fc1/kernel"] == [(0, 1, "replicate", 1, "none"), (1, 2, "zero3", 2, "dots")]
    assert plan.batch_size == 32 and plan.counts()["replicate"] and plan.counts()["zero3"] == 4
    assert len(plan.splits_by_path) == 2 and plan.layout.dense == {"lm_head/kernel"}
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(plan.to_json())
    return path


def _run_killed(out, kill_code: str, plan_file=None, args=ARGS, setup_code=""):
    """Train in a fresh process that SIGKILLs itself where ``kill_code`` says: through the CLI, or
    under the plan in ``plan_file`` with ``runner.train``."""
    run = (f"cli.main(['train', {CONFIG!r}, '--out', {str(out)!r}, *{args!r}])" if plan_file is None else
           f"runner.train(_setup({args!r}), pathlib.Path({str(out)!r}), "
           f"plan=osdp_jax.Plan.from_json(open({str(plan_file)!r}).read()), progress=False)")
    script = "\n".join([
        "import os, pathlib, signal, sys",
        # the test run's flags (conftest): a run compiled otherwise rounds otherwise
        'os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"',
        "import jax",
        'jax.config.update("jax_num_cpu_devices", 8)',
        f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})",
        "import osdp_jax",
        "from osdp_jax.cli import main as cli, runner",
        "from test_checkpoint import _setup",
        "def die():",
        "    os.kill(os.getpid(), signal.SIGKILL)",
        textwrap.dedent(kill_code),
        run,
    ])
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr[-2000:]


def _kill_after(step: int) -> str:
    return f"""
        original = runner.train
        def train(*a, **kw):
            return original(*a, **kw, on_step=lambda s: die() if s == {step} else None)
        runner.train = train
    """


def _export(run, tmp_path, name, step=None):
    path = tmp_path / f"{name}.npz"
    assert cli.main(["export", str(run), "--out", str(path), *(["--step", str(step)] if step else [])]) == 0
    with np.load(path) as f:
        return dict(f)


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, split_plan):
    out = tmp_path_factory.mktemp("ckpt") / "full"
    runner.train(_setup(), out, plan=osdp_jax.Plan.from_json(split_plan.read_text()), progress=False)
    return out


def _same_run(run, reference, tmp_path, steps=12):
    """Bit-identical: every logged loss, and every exported parameter."""
    assert _losses(run) == _losses(reference)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(steps))
    mine, theirs = _export(run, tmp_path, "mine"), _export(reference, tmp_path, "theirs")
    assert mine.keys() == theirs.keys()
    for k in mine:
        np.testing.assert_array_equal(mine[k], theirs[k], err_msg=k)


def _kill_step(low: int, high: int) -> int:
    """A kill step drawn from a seeded generator: the seed is printed (pytest shows it with a
    failure), and ``OSDP_JAX_KILL_SEED`` replays a run."""
    seed = int(os.environ.get("OSDP_JAX_KILL_SEED", random.randrange(2**32)))
    step = random.Random(seed).randrange(low, high)
    print(f"kill step {step} (OSDP_JAX_KILL_SEED={seed})")
    return step


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_is_bit_identical(tmp_path, uninterrupted, split_plan):
    # a mixed plan with split kernels, killed after an arbitrary step: the checkpoint before it
    # exists, and the steps after the checkpoint were logged past it
    step = _kill_step(3, 11)
    out = tmp_path / "killed"
    _run_killed(out, _kill_after(step), plan_file=split_plan)
    assert Checkpoints(out / "checkpoints").latest() == (step + 1) // 3 * 3, step
    assert cli.main(["train", CONFIG, "--out", str(out), *ARGS, "--resume"]) == 0  # reuses the plan
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == (step + 1) // 3 * 3 and summary["splits"], step
    _same_run(out, uninterrupted, tmp_path)


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_and_resumes_bit_identical(tmp_path, uninterrupted, split_plan,
                                                                 monkeypatch, capsys):
    out = tmp_path / "preempted"
    monkeypatch.setattr(runner, "make_plan", lambda s, **_: osdp_jax.Plan.from_json(split_plan.read_text()))
    original = runner.train

    def train(*a, **kw):  # SIGTERM, as a scheduler sends it, during step 4
        return original(*a, **kw, on_step=lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == 4 else None)
    monkeypatch.setattr(runner, "train", train)
    assert cli.main(["train", CONFIG, "--out", str(out), *ARGS]) == 128 + signal.SIGTERM
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if line.startswith("osdp-jax")]
    assert len(err) == 1 and "interrupted by SIGTERM: checkpoint of step 5 saved" in err[0], err
    assert f"--out {out} --resume" in err[0]
    assert Checkpoints(out / "checkpoints").steps() == [3, 5]  # step 5 is not a multiple of 3
    monkeypatch.setattr(runner, "train", original)
    monkeypatch.setattr(runner, "make_plan", lambda s, **_: pytest.fail("the resumed run re-planned"))
    assert cli.main(["train", CONFIG, "--out", str(out), *ARGS, "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 5
    _same_run(out, uninterrupted, tmp_path)


@pytest.mark.slow  # ~50 s (the main job's planning at three batch sizes); the mixed split-plan kill
# test above asserts the same behaviour (mixed plan, the same config's clipped AdamW) in the default run
def test_main_job_config_as_shipped_resumes_bit_identical(tmp_path):
    """The README's main job (its mixed plan at batch 256, AdamW with clipping), killed at a random
    step and resumed, ends bit-identical to an uninterrupted run of the same length."""
    args = ["--steps", "16", "--checkpoint-every", "4"]
    full = tmp_path / "full"
    assert cli.main(["train", CONFIG, "--out", str(full), *args]) == 0
    counts = json.loads((full / "summary.json").read_text())["strategies"]
    assert counts.get("replicate") and counts.get("zero3"), counts  # a mixed plan
    step = _kill_step(4, 15)
    out = tmp_path / "killed"
    _run_killed(out, _kill_after(step), args=args)
    assert cli.main(["train", CONFIG, "--out", str(out), *args, "--resume"]) == 0
    assert _losses(out) == _losses(full), step
    mine, theirs = _export(out, tmp_path, "mine"), _export(full, tmp_path, "theirs")
    for k in mine:
        np.testing.assert_array_equal(mine[k], theirs[k], err_msg=f"{k} (killed after step {step})")


@pytest.mark.slow  # ~60 s; keeps the default suite near 10 minutes
def test_kill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, uninterrupted, split_plan):
    out = tmp_path / "killed_in_save"
    # killed inside orbax's commit of checkpoint 6: its data are written, the rename is not done
    _run_killed(out, """
        from orbax.checkpoint._src.path import atomicity
        finalize = atomicity.AtomicRenameTemporaryPath.finalize
        async def dying_finalize(self, *a, **kw):
            if "6" in str(self._final_path).rsplit("/", 1)[-1]:
                die()
            return await finalize(self, *a, **kw)
        atomicity.AtomicRenameTemporaryPath.finalize = dying_finalize
    """, plan_file=split_plan)
    leftovers = [p.name for p in (out / "checkpoints").iterdir()]
    assert any("tmp" in name for name in leftovers), leftovers  # the half-written save is there...
    assert Checkpoints(out / "checkpoints").steps() == [3]  # ...and is not taken for a checkpoint
    assert cli.main(["train", CONFIG, "--out", str(out), *ARGS, "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 3
    _same_run(out, uninterrupted, tmp_path)


@pytest.mark.slow
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
    assert meta["step"] == step == 12
    leaves = jax.tree.leaves(params)
    assert any(len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated for x in leaves)
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((saved, saved_opt))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_restore_under_another_segmentation_and_device_count(uninterrupted, split_plan):
    """The run was written under split_plan's segments (layer 0 replicated, layer 1 zero3): it
    restores, with identical values, under the reverse segmentation on 4 devices (layer 0 zero3,
    layer 1 zero2: whole parameters, sharded optimizer state), whose segments come back as
    Segmented parts laid out as that plan says."""
    s = runner.setup(config.load(CONFIG, {"plan.batch_sizes": "32"}))
    abstract = s.abstract_params()
    written = osdp_jax.Plan.from_json(split_plan.read_text())
    assert written.segments["blocks/layers/fc2/kernel"][1][2] == "zero3"
    four = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    reverse = {}
    for pp in written.params:
        if pp.in_loop:
            spec = P(None, "data") if pp.shape[1] % 4 == 0 else P()
            reverse[pp.path] = (osdp_jax.Segment(0, 1, "zero3" if spec != P() else "replicate", 1, "dots", spec),
                                osdp_jax.Segment(1, 2, "zero2" if spec != P() else "replicate", 1, "full", P()))
    other = osdp_jax.Layout.from_specs(abstract, four, {}, segments=reverse)
    ckpt = Checkpoints(uninterrupted / "checkpoints")
    step = ckpt.latest()
    eight = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    saved = ckpt.restore(step, *osdp_jax.abstract_state(abstract, written, eight, s.optimizer), fingerprint(abstract))
    params, opt_state, _ = ckpt.restore(step, *osdp_jax.abstract_state(abstract, other, four, s.optimizer),
                                        fingerprint(abstract))
    ckpt.close()
    kernel = params["blocks"]["layers"]["fc1"]["kernel"]
    assert isinstance(kernel, osdp_jax.Segmented) and kernel.bounds == ((0, 1), (1, 2))
    assert kernel.parts[0].sharding.spec == P(None, "data") and len(kernel.parts[0].sharding.device_set) == 4
    assert kernel.parts[1].sharding.is_fully_replicated
    moments = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda v: isinstance(v, osdp_jax.Segmented))
               if isinstance(x, osdp_jax.Segmented) and x.shape == kernel.shape]
    assert moments and all(m.parts[1].sharding.spec == P(None, "data") for m in moments)  # zero2: state sharded
    assert isinstance(saved[0]["blocks"]["layers"]["fc1"]["kernel"], osdp_jax.Segmented)
    ours, theirs = osdp_jax.merge_segments((params, opt_state)), osdp_jax.merge_segments(saved[:2])
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_checkpoint_of_another_model_is_refused(tmp_path, uninterrupted, capsys):
    code = cli.main(["train", "experiments/opt_mini.toml", "--out", str(uninterrupted), "--resume",
                     "--steps", "8", "--plan.batch_sizes=32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is of another model" in err and len(err.splitlines()) == 1
    assert Checkpoints(uninterrupted / "checkpoints").steps() == [9, 12]  # nothing lost


def test_existing_run_without_resume_is_refused(uninterrupted, capsys):
    before = (uninterrupted / "metrics.jsonl").read_text()
    assert cli.main(["train", CONFIG, "--out", str(uninterrupted), *ARGS]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert (uninterrupted / "metrics.jsonl").read_text() == before


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "nan"
    # what is tested is the divergence check, not planning: an all-replicated plan, nothing compiled
    monkeypatch.setattr(runner, "make_plan", lambda s, **_: osdp_jax.plan(
        s.abstract_params(), s.mesh, budget="1GB", batch=s.abstract_batch(32), optimizer=s.optimizer))
    code = cli.main(["train", CONFIG, "--out", str(out), "--steps", "30", "--checkpoint-every", "1",
                     "--plan.batch_sizes=32", "--optim.name=sgd", "--optim.learning_rate=1e12"])
    err = [line for line in capsys.readouterr().err.replace("\r",
                                                            "\n").splitlines() if line.startswith("osdp-jax: error")]
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


# --- damaged and missing checkpoints: one line, exit code 2, nothing changed on disk -------------

def _snapshot(directory):
    """Every file and folder under ``directory``, with each file's bytes hashed."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            found[os.path.relpath(os.path.join(root, d), directory)] = "dir"
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                found[os.path.relpath(path, directory)] = hashlib.sha256(fh.read()).hexdigest()
    return found


def _truncate_arrays(step_dir):
    for root, _, files in os.walk(step_dir / "state"):
        for f in files:
            if "/d" in root.replace(str(step_dir), ""):  # the array data files
                path = os.path.join(root, f)
                with open(path, "r+b") as fh:
                    fh.truncate(os.path.getsize(path) // 2)


DAMAGE = {
    "meta deleted": lambda d: shutil.rmtree(d / "meta"),
    "meta not json": lambda d: (d / "meta" / "metadata").write_text("{not json"),
    "state deleted": lambda d: shutil.rmtree(d / "state"),
    "state metadata deleted": lambda d: (d / "state" / "_METADATA").unlink(),
    "array data truncated": _truncate_arrays,
    "manifest deleted": lambda d: [p.unlink() for p in (d / "state").rglob("manifest.ocdbt")],
    "manifest garbage": lambda d: [p.write_bytes(os.urandom(64)) for p in (d / "state").rglob("manifest.ocdbt")],
    "array data deleted": lambda d: [shutil.rmtree(p) for p in (d / "state").rglob("d") if p.is_dir()],
    "step folder emptied": lambda d: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in list(d.iterdir())],
    "step folder replaced by a file": lambda d: (shutil.rmtree(d), d.write_text("x")),
}


def _one_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines()
           if line.strip() and "it/s]" not in line and "s/it]" not in line]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_is_one_line_and_changes_nothing(tmp_path, uninterrupted, damage, capsys,
                                                                   monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    DAMAGE[damage](run / "checkpoints" / "12")
    before = _snapshot(run)
    capsys.readouterr()
    assert cli.main(["train", CONFIG, "--out", str(run), *ARGS, "--resume"]) == 2
    err = _one_error(capsys)
    assert f"checkpoint {run / 'checkpoints' / '12'} is damaged" in err, err
    assert "--resume-from 9" in err and "nothing was changed" in err, err
    assert _snapshot(run) == before
    assert cli.main(["export", str(run)]) == 2
    err = _one_error(capsys)
    assert "is damaged" in err and "--step 9" in err, err
    assert _snapshot(run) == before


@pytest.mark.slow
def test_resume_from_the_previous_checkpoint_moves_the_damaged_one_aside(tmp_path, uninterrupted, monkeypatch,
                                                                         capsys):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() + '{"step": 12, "lo')  # cut short
    _truncate_arrays(run / "checkpoints" / "12")
    monkeypatch.setattr(runner, "make_plan", lambda s, **_: pytest.fail("the resumed run re-planned"))
    assert cli.main(["train", CONFIG, "--out", str(run), *ARGS, "--resume-from", "9"]) == 0
    assert "moved the checkpoints after step 9 ([12])" in capsys.readouterr().out
    assert [p.name.split("-")[0] for p in (run / "superseded").iterdir()] == ["12"]  # kept, not deleted
    _same_run(run, uninterrupted, tmp_path)


@pytest.mark.parametrize("case", ["no checkpoints folder", "empty checkpoints folder", "only a killed save"])
def test_resume_with_nothing_to_resume_is_refused_before_planning(tmp_path, case, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    if case != "no checkpoints folder":
        (run / "checkpoints").mkdir()
    if case == "only a killed save":
        (run / "checkpoints" / "3.orbax-checkpoint-tmp-1234").mkdir()
    before = _snapshot(run)
    monkeypatch.setattr(runner, "make_plan", lambda s, **_: pytest.fail("planned before refusing"))
    assert cli.main(["train", CONFIG, "--out", str(run), *ARGS, "--resume"]) == 2
    assert "nothing to resume" in _one_error(capsys)
    assert _snapshot(run) == before
    assert cli.main(["train", CONFIG, "--out", str(run), *ARGS, "--resume-from", "3"]) == 2
    assert "drop --resume-from 3 to start a new run" in _one_error(capsys)  # the flag given, named
    assert _snapshot(run) == before


def test_resume_from_a_step_that_is_not_there(tmp_path, uninterrupted, capsys):
    before = _snapshot(uninterrupted)
    assert cli.main(["train", CONFIG, "--out", str(uninterrupted), *ARGS, "--resume-from", "7"]) == 2
    assert "no complete checkpoint of that step (it has steps [9, 12])" in _one_error(capsys)
    assert _snapshot(uninterrupted) == before
