"""Training across processes with jax.distributed on loopback: 2 processes x 4 CPU devices stop
together on SIGTERM, resume and equal one process with 8; a killed or missing peer stops the run
with a clear error; a second signal exits at once."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import osdp_jax
from osdp_jax.cli import config, runner
from osdp_jax.cli import main as cli

CONFIG = "experiments/gpt2_mini.toml"
# what these tests are about needs no searched remat
FLAGS = ["--plan.batch_sizes=32", "--plan.splits=1", "--plan.remat=full"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~50 s; keeps the default suite near 10 minutes
def test_a_killed_peer_stops_the_run_with_a_clear_error(tmp_path):
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "osdp_jax.cli.main", "launch", "--processes", "2", CONFIG, "--steps", "100000",
         "--out", str(out), *FLAGS], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids, lines = {}, []
    deadline = time.monotonic() + 300
    while len(pids) < 2:
        line = launcher.stderr.readline()
        lines.append(line)
        if line.startswith("osdp-jax launch: process"):
            *_, i, _, pid = line.split()
            pids[int(i)] = int(pid)
        assert time.monotonic() < deadline and line, lines
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):  # training has started
        assert launcher.poll() is None and time.monotonic() < deadline, "the run never started"
        time.sleep(0.5)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        err = launcher.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:
        launcher.kill()
        pytest.fail("the launcher did not stop within 60 s of a peer's death")
    assert time.monotonic() - killed_at <= 60
    assert launcher.returncode == 1
    assert "process 1 of 2 died (killed by signal 9)" in err and "stopped the others" in err
    with pytest.raises(ProcessLookupError):  # the surviving peer is gone too
        os.kill(pids[0], 0)


def test_flags_go_together(capsys):
    assert cli.main(["train", CONFIG, "--coordinator", "127.0.0.1:1234"]) == 2
    assert "go together" in capsys.readouterr().err


def test_launch_checks_a_plan_file_before_starting_processes(tmp_path, capsys):
    """A --plan-file that cannot be read, is not a plan, or is for another device count: one line,
    exit 2, no process started and nothing written."""
    (tmp_path / "broken.json").write_text("{")
    s = runner.setup(config.load(CONFIG))  # a plan for 8 devices, by the model alone (nothing compiled)
    (tmp_path / "plan.json").write_text(osdp_jax.plan(s.abstract_params(), s.mesh, budget="1GB").to_json())
    out = tmp_path / "run"
    for path, extra, says in ((tmp_path / "none.json", [], "cannot read it"),
                              (tmp_path / "broken.json", [], "not an osdp-jax plan"),
                              (tmp_path / "plan.json", ["--mesh.shape=4"], "made for 8 devices on axes ['data'], but")):
        assert cli.main(["launch", "--processes", "2", CONFIG, "--out", str(out), "--plan-file", str(path),
                         *extra]) == 2
        captured = capsys.readouterr()
        assert says in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
        assert "osdp-jax launch: process" not in captured.err + captured.out and not out.exists()


@pytest.mark.slow
def test_a_peer_that_never_shows_up_stops_the_process():
    """Process 0 of 2 alone: it says what it waits for, and stops after its join timeout (2 s
    here; 60 s by default) instead of waiting forever. jax's coordination client aborts the
    process (DEADLINE_EXCEEDED) rather than raising, so the status is a signal, not an exception."""
    code = ("from osdp_jax.cli import distributed as d\n"
            "d.initialize(f'127.0.0.1:{d.free_port()}', 2, 0, timeout_s=2)\n"
            "print('joined')\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert done.returncode != 0 and "joined" not in done.stdout
    assert "osdp-jax: process 0 of 2 joining the coordinator at 127.0.0.1:" in done.stderr
    assert "within 2 s" in done.stderr and "same --coordinator and --num-processes" in done.stderr
    assert "DEADLINE_EXCEEDED" in done.stderr
    assert took < 60, took


def _start_and_wait_for_steps(cmd, out, steps=2, timeout=300):
    """Start ``cmd`` (stderr piped) and return it once ``out/metrics.jsonl`` has ``steps`` lines."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= steps):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never started: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    return proc


@pytest.mark.slow
def test_two_processes_stop_together_on_sigterm_resume_and_equal_one(tmp_path):
    """Under launch (2 processes x 4 devices): SIGTERM to the launcher stops every process after
    the same step, with one checkpoint written together; the run resumes from it, and its losses
    equal one process with 8 devices under the same plan."""
    out, one = tmp_path / "two", tmp_path / "one"
    launcher = _start_and_wait_for_steps(
        [sys.executable, "-m", "osdp_jax.cli.main", "launch", "--processes", "2", CONFIG, "--steps", "100000",
         "--out", str(out), *FLAGS], out)
    launcher.send_signal(signal.SIGTERM)
    err = launcher.communicate(timeout=120)[1]
    assert launcher.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "all 2 processes stopped (exit codes [143, 143])" in err, err[-2000:]
    steps = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1, steps
    assert f"checkpoint of step {steps[0]} saved" in err
    assert (out / "metrics.jsonl").read_text().count("\n") == steps[0]  # process 0 logged exactly those
    total = steps[0] + 2
    assert cli.main(["launch", "--processes", "2", CONFIG, "--steps", str(total), "--out", str(out),
                     *FLAGS, "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 8
    assert summary["resumed_from_step"] == steps[0] and summary["steps"] == total
    # one process with 8 devices under the plan the launch wrote (planning it again is test_cli's)
    s = runner.setup(config.load(CONFIG, {**cli._split_overrides(FLAGS)[1], "train.steps": str(total)}))
    runner.train(s, one, plan=osdp_jax.Plan.from_json((out / "plan.json").read_text()), progress=False)
    assert _losses(out) == pytest.approx(_losses(one), rel=1e-5, abs=0)


def test_a_second_signal_while_a_step_finishes_exits_at_once(monkeypatch, capsys):
    """In the training loop (deferred), the first SIGTERM only marks the run to stop after its
    step; a second one exits at once with 128 + the signal, saying so."""
    from osdp_jax.cli import preemption

    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)
    monkeypatch.setattr(preemption.os, "_exit", fake_exit)
    with preemption.Preemption() as p:
        p.deferred = True
        signal.raise_signal(signal.SIGTERM)
        assert p.signum == signal.SIGTERM and p.agreed() == signal.SIGTERM  # the step goes on
        with pytest.raises(Exited) as e:
            signal.raise_signal(signal.SIGTERM)
    assert e.value.args == (128 + signal.SIGTERM,)
    assert "second SIGTERM: exiting at once" in capsys.readouterr().err


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_keeps_the_checkpoints(tmp_path):
    out = tmp_path / "run"
    proc = _start_and_wait_for_steps(
        [sys.executable, "-m", "osdp_jax.cli.main", "train", CONFIG, "--steps", "100000", "--checkpoint-every", "1",
         "--out", str(out), *FLAGS], out, steps=3)
    # step 3's metrics come before its checkpoint is final (orbax renames it to "3" when it is):
    # a second signal may cut short the one being written, never one already written
    deadline = time.monotonic() + 120
    while not any(p.name.isdigit() and int(p.name) >= 3 for p in (out / "checkpoints").glob("*")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint of step 3 was written"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    # two signals sent back to back may reach the process as one (POSIX does not queue them), so
    # this run stops either at once or after its step; the second signal's own path is
    # test_a_second_signal_while_a_step_finishes_exits_at_once's. Whatever was cut short, the
    # newest complete checkpoint resumes
    from osdp_jax.cli.checkpoint import Checkpoints
    latest = Checkpoints(out / "checkpoints").latest()
    assert latest >= 3
    assert cli.main(["train", CONFIG, "--steps", str(latest + 2), "--out", str(out), *FLAGS, "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == latest
