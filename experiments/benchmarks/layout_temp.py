"""XLA's temp of hand-set layouts: what two of the cost model's fitted terms miss.

Two tables, each of layouts set by hand (not searched), compiled for their figures as the
planner's probes are (``figures_only="probe"``), 8 simulated CPU devices:

1. **The remat term by base** (the mini configs, at each of their batch sizes). The planner
   fits a remat policy's temp per layer on the remat probe minus the per-layer probe (every
   stacked parameter ZeRO-3, the rest replicated: the *zero3 base*), at the largest batch size
   B, and charges it at batch b in proportion, ``term(b) = term(B) b / B``
   (``_calibration.calibrate``). Here the "dots" policy's extra temp (bytes, whole stack) is
   measured on that base and on the *replicated base* (every parameter replicated), where the
   stacks' full-size gradients are alive through the backward loop.
2. **All-ZeRO-3 temp against batch size** (gpt2_48l_1536, FSDP's layout: every parameter
   ZeRO-3, remat "full"). The planner probes it at the smallest and largest candidate batch
   sizes and interpolates linearly between (``_cost.interpolate``); the *linear* column is that
   line through the two measured ends.

Every figure is measured, except the *charged* and *linear* columns, which are the planner's
arithmetic on measured figures, as labelled.

Writes experiments/results/layout_temp.md.

Run: python experiments/benchmarks/layout_temp.py
"""
import dataclasses
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import osdp_jax  # noqa: E402
from experiments import config, runner  # noqa: E402

MINIS = ("gpt2_mini", "opt_mini", "bert_mini")
PAPER = "paper/gpt2_48l_1536"
MIB = 2**20


def _layout(plan: osdp_jax.Plan, batch: int, stack: str, remat: str) -> osdp_jax.Plan:
    """``plan`` at ``batch``, every per-step parameter replicated and every stacked one ``stack``
    ("replicate" or "zero3", sharded on its first dimension after the layer axis), every layer
    under ``remat``."""
    j = json.loads(plan.to_json())
    j["batch_size"] = batch
    for q in j["params"]:
        zero3 = q["in_loop"] and stack == "zero3"
        q["strategy"], q["spec"] = ("zero3", [None, "data"] + [None] * (len(q["shape"]) - 2)) if zero3 else ("replicate", [])
        for seg in q["segments"]:
            seg.update(strategy=q["strategy"], spec=q["spec"], remat=remat, split=1)
    return osdp_jax.Plan.from_json(json.dumps(j))


def _temp(s, plan: osdp_jax.Plan) -> float:
    """XLA's temp bytes of ``plan``'s step, compiled as a probe."""
    return osdp_jax.profile_step(s.loss_fn, s.optimizer, s.abstract_params(), s.abstract_batch(plan.batch_size),
                                 s.mesh, plan, figures_only="probe").temp_bytes


def remat_rows(name: str) -> list[dict]:
    s = runner.setup(config.load(f"experiments/{name}.toml"))
    base = runner.make_plan(s, verify=False)  # any plan of the model: only its parameter list is used
    sizes = sorted(s.cfg.plan.batch_sizes)
    rows = []
    for b in sizes:
        t = {(stack, remat): _temp(s, _layout(base, b, stack, remat))
             for stack in ("replicate", "zero3") for remat in ("full", "dots")}
        rows.append(dict(config=name, batch=b, rep_full=t["replicate", "full"], rep_dots=t["replicate", "dots"],
                         z_full=t["zero3", "full"], z_dots=t["zero3", "dots"]))
    top = rows[-1]["z_dots"] - rows[-1]["z_full"]
    for r in rows:
        r["charged"] = top * r["batch"] / sizes[-1]
    return rows


def batch_rows() -> list[dict]:
    s = runner.setup(config.load(f"experiments/{PAPER}.toml"))
    fsdp = runner.make_plan(runner.at_budget(s, osdp_jax.parse_bytes("4GB")), strategies=("zero3",), remat=("full",),
                            splits=(1,), per_layer=False, verify=False)
    sizes = sorted(s.cfg.plan.batch_sizes)
    temps = {b: _temp(s, dataclasses.replace(fsdp, batch_size=b)) for b in sizes}
    lo, hi = sizes[0], sizes[-1]
    return [dict(batch=b, temp=temps[b], linear=temps[lo] + (b - lo) / (hi - lo) * (temps[hi] - temps[lo]))
            for b in sizes]


def main():
    remat = [r for name in MINIS for r in remat_rows(name)]
    batch = batch_rows()
    lines = ["# XLA's temp of hand-set layouts", "",
             "Measured with `python experiments/benchmarks/layout_temp.py` (8 simulated CPU devices; each layout",
             "compiled for its figures as a probe). See the script's docstring for the layouts.", "",
             "## The remat term by base", "",
             "Temp of the whole step, every per-step parameter replicated, the layer stack replicated or",
             "ZeRO-3, every layer under remat \"full\" or \"dots\". *Extra*: dots minus full, measured. *Charged*:",
             "what the planner charges for every layer under \"dots\" at that batch size, the zero3 base's extra",
             "at the largest size scaled in proportion (arithmetic on the measured figures).", "",
             "| config | batch | replicated: full | dots | extra | zero3: full | dots | extra | charged |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in remat:
        lines.append(f"| {r['config']} | {r['batch']} | {r['rep_full'] / MIB:.3f} MiB | {r['rep_dots'] / MIB:.3f} MiB | "
                     f"{(r['rep_dots'] - r['rep_full']) / MIB:+.3f} MiB | {r['z_full'] / MIB:.3f} MiB | "
                     f"{r['z_dots'] / MIB:.3f} MiB | {(r['z_dots'] - r['z_full']) / MIB:+.3f} MiB | "
                     f"{r['charged'] / MIB:+.3f} MiB |")
    lines += ["", f"## All-ZeRO-3 temp against batch size ({PAPER}, remat \"full\")", "",
              "*Linear*: the line through the two measured ends, as the planner interpolates (arithmetic).", "",
              "| batch | temp | linear | linear / temp - 1 |", "|---|---|---|---|"]
    for r in batch:
        lines.append(f"| {r['batch']} | {r['temp'] / MIB:.1f} MiB | {r['linear'] / MIB:.1f} MiB | "
                     f"{r['linear'] / r['temp'] - 1:+.1%} |")
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "layout_temp.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
