"""A probe compiler option, on and off: cold ``plan()`` wall time with each, alternating, same run.

The planner compiles its probes (and, by default, the chosen plan) with
``osdp_jax.runtime.step.PROBE_ONLY_CPU`` on XLA:CPU. For each ``--drop`` option this takes the
cold ``plan()`` of each config (every in-process cache cleared, a fresh setup, as
``planning_time.py``'s *cold*) with ``PROBE_ONLY_CPU`` as it is and without that option (XLA's
default), alternating the two ``--repeats`` times in one process, after one plan of gpt2_mini that
warms the process. It also checks that the plans and their XLA peaks are the same either way (an
option that changed the figures would change a plan). A run's time varies by a third on this
machine from minute to minute, so only medians of alternating repeats are compared.

Writes experiments/results/probe_options.md.

Run: python experiments/benchmarks/probe_options.py [--drop xla_cpu_parallel_codegen_split_count]
     [--configs bert_mini,gpt2_mini,...] [--repeats 5]
"""
import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402

from experiments import config, runner  # noqa: E402
from osdp_jax.planning import clear_compiled, clear_probe_cache, compile_threads  # noqa: E402
from osdp_jax.runtime import step  # noqa: E402

CONFIGS = ["bert_mini", "gpt2_mini", "paper/gpt2_48l_1536"]


def cold_plan(name: str, options: dict):
    """A cold plan of config ``name`` with ``PROBE_ONLY_CPU`` set to ``options``: (seconds, plan)."""
    saved = dict(step.PROBE_ONLY_CPU)
    step.PROBE_ONLY_CPU.clear()
    step.PROBE_ONLY_CPU.update(options)
    try:
        s = runner.setup(config.load(f"experiments/{name}.toml"))
        clear_probe_cache()
        clear_compiled()
        jax.clear_caches()
        t0 = time.perf_counter()
        plan = runner.make_plan(s)
        return time.perf_counter() - t0, plan
    finally:
        step.PROBE_ONLY_CPU.clear()
        step.PROBE_ONLY_CPU.update(saved)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drop", default="xla_cpu_parallel_codegen_split_count",
                    help=f"an option of PROBE_ONLY_CPU to compare without; it has {sorted(step.PROBE_ONLY_CPU)}")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.drop not in step.PROBE_ONLY_CPU:
        ap.error(f"--drop {args.drop!r} is not in PROBE_ONLY_CPU, which has {sorted(step.PROBE_ONLY_CPU)}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    with_it = dict(step.PROBE_ONLY_CPU)
    without = {k: v for k, v in with_it.items() if k != args.drop}
    cold_plan("gpt2_mini", with_it)  # the process's first plan pays one-time costs
    rows = []
    for name in args.configs.split(","):
        times = {"with": [], "without": []}
        plans = {}
        for i in range(args.repeats):
            for label, options in (("without", without), ("with", with_it)):
                seconds, plan = cold_plan(name, options)
                times[label].append(seconds)
                plans.setdefault(label, (plan.layout, plan.batch_size, plan.xla_peak_bytes))
                same = plans[label] == (plan.layout, plan.batch_size, plan.xla_peak_bytes)
                print(f"{name} ({i + 1}/{args.repeats}) {label}: {seconds:.2f} s{'' if same else ' (ANOTHER PLAN)'}",
                      flush=True)
        rows.append(dict(name=name, times=times, same=len(set(plans.values())) == 1,
                         without=statistics.median(times["without"]), with_=statistics.median(times["with"])))
    value = with_it[args.drop]
    lines = ["# A probe compiler option, on and off", "",
             f"Measured with `python experiments/benchmarks/probe_options.py --drop {args.drop}` on this machine, 8 "
             f"simulated CPU devices, {compile_threads()} compile threads: a cold `plan()` of each config (every "
             f"in-process cache cleared, a fresh setup) with the probes' options (`PROBE_ONLY_CPU`) as they are, "
             f"`{args.drop}={value!r}` among them, and without it (XLA's default), alternating, "
             f"{args.repeats} times each in one process. Medians; every repeat below.", "",
             "| config | without | with | with / without | same plan and XLA peak |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['without']:.2f} s | {r['with_']:.2f} s | {r['with_'] / r['without']:.2f} | "
                     f"{'yes' if r['same'] else 'NO'} |")
    lines.append("")
    for r in rows:
        lines.append(f"- {r['name']}: without {', '.join(f'{t:.2f}' for t in r['times']['without'])}; "
                     f"with {', '.join(f'{t:.2f}' for t in r['times']['with'])}")
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "probe_options.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
