"""One GPU, measured against predicted: step time and peak memory of the GPT-2 presets that fit.

For each preset (default ``gpt2-48l-1536`` and ``gpt2-48l-2048``; each runs in its own process so
every device peak starts from zero):

- ``plan``: ``osdp_jax.plan`` on a one-device mesh with the device's memory as the budget and the
  hardware preset for the device (H200, H100, A100, TITAN RTX; ``default_hardware``): its
  predicted peak and step time against XLA's peak (``memory_analysis``), the device's measured
  peak (``memory_stats()["peak_bytes_in_use"]``) and the median measured step time. On one device
  every parameter is replicated (there is nobody to shard with), so the plan never splits.
- ``split off`` / ``split k=4``: operator splitting itself, forced on one device: every parameter
  stored as a "shard" over the one-device axis (the gathers are no-ops) and every splittable
  kernel run in 1 or 4 slices. Same model, same batch: the k=4 / k=1 time ratio is the GPU cost
  of the sliced matmuls and their loop; the memory shows what slicing does without sharding.
  The planner makes no prediction for these (it does not consider sharding on one device).

Run on a machine with one GPU (a few minutes; the default presets need about 60 GB)::

    python experiments/benchmarks/gpu.py [--presets gpt2-48l-1536,gpt2-48l-2048] [--batch 8]
        [--seq 512] [--steps 5]

Writes experiments/results/gpu.md and gpu.json. ``--smoke`` runs ``gpt2-mini`` on whatever
device there is (a CPU too), to check the script itself; it writes nothing unless ``--out`` is
given.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
VARIANTS = ("plan", "split off", "split k=4")


def run_one(preset: str, variant: str, batch_size: int, seq: int, steps: int) -> dict:
    """Plan or build the step, run it, and return its figures (bytes and seconds)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import osdp_jax
    from osdp_jax import models
    from osdp_jax.hardware import default_hardware

    module, cfg, _ = models.get(preset)
    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("data",), devices=[device], axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch_size, seq + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
             "weights": jnp.ones((batch_size, seq), jnp.float32)}
    loss_fn, opt = models.make_loss(module), optax.adam(1e-4)
    abstract = models.abstract_params(module, seq)
    out = {"preset": preset, "variant": variant, "batch": batch_size, "seq": seq,
           "device": device.device_kind, "platform": device.platform}

    t0 = time.perf_counter()
    if variant == "plan":
        hw = default_hardware(mesh)
        plan = osdp_jax.plan(abstract, mesh, loss_fn=loss_fn, batch=batch, optimizer=opt, hardware=hw)
        out.update(predicted_peak=plan.predicted_peak_bytes, predicted_step_s=plan.predicted_step_seconds,
                   budget=plan.budget_bytes, hardware=hw.name, strategies=plan.counts(),
                   split_kernels=len(plan.splits_by_path))
        layout = plan.layout
    else:
        in_loop, splittable = osdp_jax.discover(loss_fn, abstract, batch)
        # every parameter "sharded" over the one-device axis: the same code path as zero3
        lead = {i.path: 1 if i.path in in_loop else 0 for i in osdp_jax.describe(abstract)}  # layer axis
        specs = {i.path: P(*([None] * lead[i.path]), "data") if len(i.shape) > lead[i.path] else P()
                 for i in osdp_jax.describe(abstract)}
        k = 1 if variant == "split off" else 4
        splits = {p: k for p in splittable if k > 1}
        out.update(split_kernels=len(splits))
        layout = osdp_jax.Layout.from_specs(abstract, mesh, specs, in_loop=in_loop, splits=splits,
                                            dense=splittable - in_loop)
    compiled = osdp_jax.compile_step(loss_fn, opt, abstract, batch, mesh, layout)
    out["xla_peak"] = osdp_jax.profile_compiled(compiled).peak_bytes
    out["plan_and_compile_s"] = time.perf_counter() - t0

    params = osdp_jax.shard(models.init_params(module, seq, 0), mesh, layout)
    state = osdp_jax.init_opt_state(opt, params, layout, mesh)
    batch = jax.device_put(batch, osdp_jax.batch_sharding(mesh, layout))
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        params, state, loss = compiled(params, state, batch)
        loss = float(loss)  # waits for the step
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t)
    stats = device.memory_stats() or {}
    out.update(step_s=statistics.median(times), loss=loss, device_peak=stats.get("peak_bytes_in_use"),
               device_limit=stats.get("bytes_limit"))
    return out


def report(rows: list[dict]) -> str:
    from osdp_jax import format_bytes

    gib = lambda b: "-" if b is None else format_bytes(b)  # noqa: E731
    ms = lambda s: "-" if s is None else f"{s * 1e3:.1f} ms"  # noqa: E731
    first = rows[0]
    lines = ["# One GPU: predicted vs measured", "",
             f"Measured by `python experiments/benchmarks/gpu.py` on one {first['device']} "
             f"({first['platform']}), batch {first['batch']} x {first['seq']} tokens, Adam, float32. "
             "Predicted = the planner's cost model (hardware preset, not calibrated on this device); "
             "XLA peak = `argument + output - alias + temp` of the compiled step; device peak = "
             "`memory_stats()['peak_bytes_in_use']` after the run (includes the initial parameters "
             "and buffers outside the step); step time = median of the timed steps.", "",
             "| preset | variant | predicted peak | XLA peak | device peak | predicted step | measured step "
             "| k=4 / k=1 time |",
             "|---|---|---|---|---|---|---|---|"]
    by = {(r["preset"], r["variant"]): r for r in rows}
    for r in rows:
        ratio = "-"
        off = by.get((r["preset"], "split off"))
        if r["variant"] == "split k=4" and off:
            ratio = f"{r['step_s'] / off['step_s']:.3f}"
        variant = r["variant"] + (f" ({r['split_kernels']} kernels)" if r["variant"] == "split k=4" else "")
        lines.append(f"| {r['preset']} | {variant} | {gib(r.get('predicted_peak'))} | {gib(r['xla_peak'])} | "
                     f"{gib(r['device_peak'])} | {ms(r.get('predicted_step_s'))} | {ms(r['step_s'])} | {ratio} |")
    lines += ["", "Variants: `plan` = what `osdp_jax.plan` chose on a one-device mesh (everything replicated); "
              "`split off` / `split k=4` = every parameter on the ZeRO-3 code path over the one-device axis "
              "(no-op gathers) with the splittable kernels run in 1 or 4 slices (no prediction: the planner "
              "does not shard on one device)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="gpt2-48l-1536,gpt2-48l-2048")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (after two warm-up steps)")
    ap.add_argument("--smoke", action="store_true", help="gpt2-mini on any device, to check the script")
    ap.add_argument("--out", help="directory for gpu.md and gpu.json (default experiments/results; "
                                  "with --smoke, nothing is written unless given)")
    ap.add_argument("--one", nargs=2, metavar=("PRESET", "VARIANT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], args.batch, args.seq, args.steps)))
        return
    if args.smoke:
        presets, args.batch, args.seq, args.steps = ["gpt2-mini"], 8, 16, 2
    else:
        import jax
        if jax.devices()[0].platform != "gpu":
            sys.exit(f"gpu.py measures a GPU, but JAX's first device is {jax.devices()[0].platform}; "
                     f"run it on a GPU machine, or pass --smoke to check the script")
        presets = args.presets.split(",")
    rows = []
    for preset in presets:
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--one", preset, variant, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--steps", str(args.steps)]
            env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                print(f"{preset} / {variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{preset} / {variant}: step {r['step_s'] * 1e3:.1f} ms, XLA peak {r['xla_peak'] / 2**30:.2f} GiB",
                  flush=True)
    if not rows:
        sys.exit("no variant ran")
    text = report(rows)
    print(text)
    out = args.out or (None if args.smoke else RESULTS)
    if out:
        out = pathlib.Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.md").write_text(text)
        (out / "gpu.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
