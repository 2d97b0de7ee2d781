"""The ``osdp-jax`` command line: ``train``, ``plan`` and ``compare`` an experiment config.

    osdp-jax train CONFIG [--steps N] [--budget B] [--devices N] [--out DIR] [--plan-file PLAN.json]
                   [--section.key=value ...]
    osdp-jax plan CONFIG [--out DIR] [...]
    osdp-jax compare CONFIG [--out DIR] [--budgets B1,B2,...] [...]
    osdp-jax profile [--out profile.json] [--devices N] [--mesh-shape 8] [--axes data]
    osdp-jax export RUN [--out params.npz] [--step N]
    osdp-jax launch --processes N CONFIG [train flags ...]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys


def _positive(text: str) -> int:
    """An argparse type: a positive integer (``--devices 0`` was ignored, ``profile --repeats 0``
    a traceback from statistics.median)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _parser():
    p = argparse.ArgumentParser(prog="osdp-jax", description="Optimal Sharded Data Parallel for JAX")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "plan, then train under the plan"),
                            ("plan", "plan only (works for paper-scale presets: nothing is allocated)"),
                            ("compare", "DDP vs FSDP vs OSDP under the same budget")):
        c = sub.add_parser(name, help=help_text,
                           epilog="Any config field can be overridden as --section.key=value, "
                                  "e.g. --plan.batch_sizes=32,64 --optim.learning_rate=3e-4")
        c.add_argument("config", help="experiment TOML file, e.g. experiments/gpt2_mini.toml")
        c.add_argument("--out", default=None, help="output directory (default runs/<config name>/<command>)")
        c.add_argument("--budget", default=None, help="per-device memory budget, e.g. 64MiB (plan.budget)")
        c.add_argument("--devices", type=_positive, default=None,
                       help="simulate this many CPU devices when the platform has one (default: the mesh size)")
        if name == "train":
            c.add_argument("--steps", type=int, default=None, help="training steps (train.steps)")
            c.add_argument("--checkpoint-every", type=int, default=None,
                           help="save a checkpoint every N steps, and at the end (train.checkpoint_every)")
            c.add_argument("--resume", action="store_true",
                           help="continue from the newest complete checkpoint in --out (any mesh or plan)")
            c.add_argument("--resume-from", type=int, default=None, metavar="STEP",
                           help="continue from checkpoint STEP (implies --resume); newer checkpoints are "
                                "moved to OUT/superseded")
            c.add_argument("--plan-file", default=None, metavar="PLAN.json",
                           help="train under this saved plan (the plan.json 'osdp-jax plan' or 'train' "
                                "writes) instead of planning; checked against the config's model and mesh")
            c.add_argument("--init-params", default=None,
                           help="start from parameters exported with 'osdp-jax export' (.npz)")
            c.add_argument("--coordinator", default=None,
                           help="HOST:PORT of process 0, for training across processes (jax.distributed)")
            c.add_argument("--num-processes", type=int, default=None, help="processes in the run")
            c.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1")
        if name == "compare":
            c.add_argument("--measure-steps", type=int, default=8,
                           help="real steps per method to measure samples/s (trainable models only)")
            c.add_argument("--budgets", default=None, metavar="B1,B2,...",
                           help="sweep these per-device budgets (plan only, nothing trained): writes "
                                "sweep.json, sweep.md and sweep.png")
    lau = sub.add_parser("launch", help="train with N local processes on loopback (jax.distributed)",
                         epilog="Any train flag may follow, e.g. --steps 20 --out runs/x --plan.batch_sizes=32")
    lau.add_argument("config", help="experiment TOML file")
    lau.add_argument("--processes", type=int, required=True, help="number of processes")
    exp = sub.add_parser("export", help="write a run's trained parameters to a plain .npz")
    exp.add_argument("run", help="a run directory written by 'osdp-jax train' (holds checkpoints/)")
    exp.add_argument("--out", default=None, help="the .npz to write (default RUN/params.npz)")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    prof = sub.add_parser("profile", help="measure this mesh's collectives and matmul throughput")
    prof.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    prof.add_argument("--devices", type=_positive, default=None, help="simulate this many CPU devices")
    prof.add_argument("--mesh-shape", default="8", help="comma-separated mesh shape, e.g. 8 or 2,4")
    prof.add_argument("--axes", default="data", help="comma-separated axis names, e.g. data or replica,data")
    prof.add_argument("--repeats", type=_positive, default=5, help="timed runs per measurement (median)")
    return p


def _profile(args) -> int:
    shape = tuple(int(x) for x in args.mesh_shape.split(","))
    axes = tuple(args.axes.split(","))
    if len(shape) != len(axes):
        print(f"osdp-jax: error: --mesh-shape {args.mesh_shape} and --axes {args.axes} differ in length",
              file=sys.stderr)
        return 2
    _simulate_devices(args.devices or math.prod(shape))
    import jax

    from osdp_jax.hardware import profile, save
    if len(jax.devices()) < math.prod(shape):
        print(f"osdp-jax: error: mesh {shape} needs {math.prod(shape)} devices, {len(jax.devices())} "
              f"available; pass --devices", file=sys.stderr)
        return 2
    mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:math.prod(shape)])
    hw, raw = profile(mesh, repeats=args.repeats)
    save(hw, args.out, raw)
    print(f"measured {hw.name}: {hw.flops / 1e9:.1f} GFLOP/s per device, collective bandwidth "
          f"{hw.bandwidth / 1e9:.2f} GB/s, latency {hw.latency * 1e6:.0f} us")
    for axis, link in hw.links.items():
        print(f"  axis {axis!r}: {link['bandwidth'] / 1e9:.2f} GB/s, latency {link['latency'] * 1e6:.0f} us")
    print(f"wrote {args.out}; use it with --plan.hardware={args.out}")
    return 0


def _export(args) -> int:
    """Restore a run's checkpoint onto one device and write its parameters as .npz."""
    run = pathlib.Path(args.run)
    if not (run / "config.json").is_file() or not (run / "checkpoints").is_dir():
        print(f"osdp-jax: error: {run} is not a run directory (needs config.json and checkpoints/ "
              f"written by 'osdp-jax train')", file=sys.stderr)
        return 2
    from osdp_jax.cli import runner
    from osdp_jax.cli.checkpoint import Checkpoints, export_params
    from osdp_jax.cli.config import ConfigError, from_dict
    try:
        cfg = from_dict(json.loads((run / "config.json").read_text()))
        cfg = _one_device(cfg)
        s = runner.setup(cfg)
    except ConfigError as e:
        print(f"osdp-jax: {e}", file=sys.stderr)
        return 2
    from osdp_jax.cli.checkpoint import CheckpointError, DamagedCheckpoint
    ckpt = Checkpoints(run / "checkpoints", read_only=True)
    steps, step = [], args.step
    try:
        steps = ckpt.steps()
        step = args.step if args.step is not None else (steps[-1] if steps else None)
        stray = sorted(int(p.name) for p in (run / "checkpoints").iterdir()
                       if p.name.isdigit() and int(p.name) not in steps)
        if args.step is None and stray and (step is None or stray[-1] > step):
            raise DamagedCheckpoint(run.absolute() / "checkpoints" / str(stray[-1]), stray[-1],
                                    "it is not a complete checkpoint (orbax does not list it)")
        if step is None or step not in steps:
            print(f"osdp-jax: error: no complete checkpoint {'' if step is None else step} in "
                  f"{run / 'checkpoints'} (has {steps})", file=sys.stderr)
            return 2
        params = ckpt.restore_params(step, s.abstract_params(), s.optimizer)
    except CheckpointError as e:
        older = [x for x in steps if x < (e.step if isinstance(e, DamagedCheckpoint) else step)]
        hint = f"; export an earlier one with --step {older[-1]}" if older else ""
        print(f"osdp-jax: error: {e}{hint}", file=sys.stderr)
        return 2
    finally:
        ckpt.close()
    path = export_params(params, pathlib.Path(args.out or run / "params.npz"))
    print(f"wrote {path} (checkpoint step {step}); load it with numpy.load, or train from it with "
          f"--init-params {path}")
    return 0


def _train(args, s, out) -> int:
    """Plan and train; on SIGTERM/SIGINT, checkpoint after the current step and say how to resume."""
    import osdp_jax
    from osdp_jax.cli import runner
    from osdp_jax.cli.preemption import Preempted, Preemption
    try:
        with Preemption() as preemption:
            # before planning: refuse early and write nothing (an existing run, nothing to resume, a
            # damaged or foreign checkpoint)
            plan = runner.load_plan(s, args.plan_file) if args.plan_file else None
            point = runner.check_run_dir(s, out, args.resume, args.resume_from)
            if plan is not None:
                print(f"training under the plan in {args.plan_file} (nothing planned)", flush=True)
                if osdp_jax.parse_bytes(s.cfg.plan.budget) != plan.budget_bytes:
                    print(f"note: that plan was made for a budget of {osdp_jax.format_bytes(plan.budget_bytes)}; "
                          f"the config's plan.budget ({s.cfg.plan.budget}) is not used", flush=True)
            elif (plan := runner.reusable_plan(s, point)) is not None:
                print(f"reusing the plan of checkpoint {point.step} (same config)", flush=True)
            else:
                plan = runner.make_plan(s, verify="full")  # trained at once: the executable it compiles
            print(plan.summary(), flush=True)
            summary = runner.train(s, out, plan=plan, resume=args.resume, resume_from=args.resume_from,
                                   point=point,
                                   init_params=pathlib.Path(args.init_params) if args.init_params else None,
                                   preemption=preemption)
    except Preempted as e:
        import signal
        name = signal.Signals(e.signum).name
        if e.step is None:
            print(f"\nosdp-jax: interrupted by {name} before training started; nothing was saved",
                  file=sys.stderr, flush=True)
        else:
            again = " ".join(["osdp-jax", "train", args.config, "--out", str(out), "--resume",
                              *_passed_overrides()])
            print(f"\nosdp-jax: interrupted by {name}: checkpoint of step {e.step} saved in "
                  f"{out / 'checkpoints' / str(e.step)}; resume with: {again}", file=sys.stderr, flush=True)
        return e.exit_code
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}/plan.json, metrics.jsonl, summary.json")
    return 0


_ARGV: list[str] = []  # this invocation's arguments, for the resume hint


def _passed_overrides() -> list[str]:
    """The ``--section.key=value`` and ``--steps``-like flags of this invocation, to repeat on resume."""
    keep, skip = [], {"--out", "--resume", "--resume-from", "--init-params"}
    i = 0
    argv = _ARGV[2:]  # after "train CONFIG"
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        takes_value = "=" not in a and name not in ("--resume",) and i + 1 < len(argv) \
            and not argv[i + 1].startswith("--")
        if name not in skip:
            keep.append(a)
            if takes_value:
                keep.append(argv[i + 1])
        i += 2 if takes_value else 1
    return keep


def _one_device(cfg):
    """A config for one device: export needs no mesh."""
    import dataclasses
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, shape=(1,) * len(cfg.mesh.shape)))


def _split_overrides(argv):
    """Pull ``--section.key=value`` (or ``--section.key value``) out of argv."""
    rest, overrides = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    print(f"osdp-jax: error: --{key} needs a value, e.g. --{key}=VALUE", file=sys.stderr)
                    raise SystemExit(2)  # bad input, as argparse's own usage errors
                value = argv[i + 1]
                i += 1
            overrides[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _simulate_devices(n: int):
    """Ask for n CPU devices, their collectives in order (``core.simulated``), before JAX starts
    (only matters where the platform has one device)."""
    from jax._src import xla_bridge

    from osdp_jax.core.simulated import simulate_cpu_devices
    if not xla_bridge.backends_are_initialized():
        simulate_cpu_devices(n)
    import jax
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backend already initialised (e.g. in tests): keep what is there
        pass


def _threads_ok() -> bool:
    """Whether ``$OSDP_JAX_COMPILE_THREADS`` is unset or a thread count; if not, it says so in one
    line, before any work."""
    from osdp_jax.planning import compile_threads
    try:
        compile_threads()
    except ValueError as e:
        print(f"osdp-jax: error: {e}", file=sys.stderr)
        return False
    return True


def _launch(argv) -> int:
    args, extra = _parser().parse_known_args(argv)
    if args.processes < 1:
        print("osdp-jax: error: --processes must be >= 1", file=sys.stderr)
        return 2
    from osdp_jax.cli.config import ConfigError, load
    rest, overrides = _split_overrides(extra)
    try:
        cfg = load(args.config, overrides)
    except ConfigError as e:
        print(f"osdp-jax: {e}", file=sys.stderr)
        return 2
    if not _threads_ok():
        return 2
    n = math.prod(cfg.mesh.shape)
    if n % args.processes:
        print(f"osdp-jax: error: the mesh's {n} devices do not divide into {args.processes} processes; "
              f"change --processes or mesh.shape", file=sys.stderr)
        return 2
    path = _parser().parse_known_args(["train", args.config, *rest])[0].plan_file  # train's own flag
    if path is not None:  # what can be checked before any process starts: a plan, for this mesh
        from osdp_jax.cli import runner
        try:
            runner.check_plan_devices(runner.read_plan(path), path, dict(zip(cfg.mesh.axes, cfg.mesh.shape)))
        except ConfigError as e:
            print(f"osdp-jax: {e}", file=sys.stderr)
            return 2
    from osdp_jax.cli.distributed import launch
    return launch(args.config, args.processes, n // args.processes, extra)


def main(argv=None):
    """The command line; exit code 0, 2 for bad input, 128 + signal when interrupted."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C outside training (plan, compare, export, profile)
        print("\nosdp-jax: interrupted (SIGINT)", file=sys.stderr, flush=True)
        return 130


def _main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    _ARGV[:] = argv
    if argv[:1] == ["launch"]:
        return _launch(argv)
    args_list, overrides = _split_overrides(argv)
    args = _parser().parse_args(args_list)
    if args.command == "profile":
        return _profile(args)
    if args.command == "export":
        return _export(args)
    if args.budget is not None:
        overrides["plan.budget"] = args.budget
    if getattr(args, "steps", None) is not None:
        overrides["train.steps"] = str(args.steps)
    if getattr(args, "checkpoint_every", None) is not None:
        overrides["train.checkpoint_every"] = str(args.checkpoint_every)

    from osdp_jax.cli.config import ConfigError, load
    try:
        cfg = load(args.config, overrides)
    except ConfigError as e:
        print(f"osdp-jax: {e}", file=sys.stderr)
        return 2
    processes = getattr(args, "num_processes", None)
    if (args.command == "train") and ((args.coordinator is None) != (processes is None)
                                      or (processes is None) != (args.process_id is None)):
        print("osdp-jax: error: --coordinator, --num-processes and --process-id go together",
              file=sys.stderr)
        return 2
    _simulate_devices(args.devices or math.prod(cfg.mesh.shape) // (processes or 1))
    if not _threads_ok():
        return 2
    if cfg.plan.compilation_cache and not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        import osdp_jax
        # one folder per process: concurrent writers are not supported
        sub = f"process-{args.process_id}" if processes else ""
        osdp_jax.enable_compilation_cache(os.path.join(os.path.expanduser(cfg.plan.compilation_cache), sub),
                                          probes=cfg.plan.probe_store)
    if processes:
        from osdp_jax.cli.distributed import DistributedError, initialize
        try:
            initialize(args.coordinator, processes, args.process_id)
        except DistributedError as e:
            print(f"osdp-jax: error: {e}", file=sys.stderr)
            return 2

    import osdp_jax
    from osdp_jax.cli import runner
    from osdp_jax.cli.checkpoint import CheckpointError
    out = pathlib.Path(args.out or pathlib.Path("runs") / pathlib.Path(args.config).stem / args.command)
    blocked = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:  # before anything is planned: the run would fail at its first write
        print(f"osdp-jax: error: --out {out}: {blocked} is a file, not a directory; choose another --out",
              file=sys.stderr)
        return 2
    try:
        s = runner.setup(cfg)
        if args.command == "plan":
            plan = runner.make_plan(s)
            out.mkdir(parents=True, exist_ok=True)
            (out / "plan.json").write_text(plan.to_json())
            print(plan.summary())
            print(f"\nwrote {out / 'plan.json'}")
        elif args.command == "train":
            return _train(args, s, out)
        elif args.budgets is not None:
            from osdp_jax.cli.sweep import parse_budgets, sweep
            try:
                budgets = parse_budgets(args.budgets)
            except ValueError as e:
                raise ConfigError(f"config error: --budgets: {e}") from None
            sweep(s, out, budgets)
            print((out / "sweep.md").read_text())
            print(f"wrote {out}/sweep.json, sweep.md, sweep.png")
        else:
            runner.compare(s, out, measure_steps=args.measure_steps)
            print((out / "comparison.md").read_text())
            print(f"wrote {out}/comparison.json, comparison.md, comparison.png")
    except (ConfigError, CheckpointError, osdp_jax.InfeasibleBudgetError, FloatingPointError) as e:
        print(f"osdp-jax: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
