"""Write experiments/results/paper.md: our DDP/FSDP/OSDP comparisons beside the original OSDP's figures.

Reads the ``comparison.json`` files that ``osdp-jax compare experiments/paper/<name>.toml --out
experiments/results/paper/<name>`` writes. Run from the repository's root:
python -m osdp_jax.cli.paper_report
"""
from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path("experiments") / "results"  # from the repository's root, as the docs run it

# The original OSDP (PyTorch + FairScale) on 8 TITAN RTX GPUs over PCIe 3.0, measured by its authors.
ORIGINAL = {
    "gpt2_48l_1536": ("GPT-2, 48 layers, 8 GB", {"OSDP": 192.26, "FSDP": 158.05}),
    "opt_30b_8l": ("OPT-30B shape, 8 layers, 16 GB", {"OSDP": 1261.98, "FSDP": 453.18}),
    "bert_large_2x4": ("BERT-large, 2 nodes x 4 GPUs (10 Gb Ethernet between nodes), 8 GB", {}),
    "gpt2_48l_1536_tp": ("GPT-2, 48 layers, 8 GB, a 2 (data) x 4 (model) mesh with tensor parallelism", {}),
    "opt_30b_8l_tp": ("OPT-30B shape, 8 layers, 16 GB, a 2 (data) x 4 (model) mesh with tensor parallelism", {}),
}


def fmt_bytes(n):
    return f"{n / 2**30:.2f} GiB"


def main():
    lines = ["# The OSDP paper's experiments, reproduced by prediction", "",
             "Our figures: **predicted** samples/s from the cost model with the TITAN RTX PCIe 3.0 "
             "hardware preset (spec-sheet numbers, not measured), and the **XLA-measured** per-device "
             "peak of the compiled step (compile-only on CPU; nothing was trained at this scale). The "
             "original's figures were **measured** by its authors on 8 GPUs. Regenerate: run "
             "`osdp-jax compare experiments/paper/<name>.toml --out experiments/results/paper/<name>` "
             "for each config, then `python -m osdp_jax.cli.paper_report`.", ""]
    for path in sorted((RESULTS / "paper").glob("*/comparison.json")):
        d = json.loads(path.read_text())
        name = path.parent.name
        title, original = ORIGINAL.get(name, (d["model"], {}))
        lines += [f"## {title} ({d['model']}, budget {fmt_bytes(d['budget_bytes'])} per device)", "",
                  "| method | batch | strategies | split kernels | layer segments | XLA peak (measured) "
                  "| step s (collectives s), predicted | samples/s (ours, predicted) | seq/s (original, measured) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        ours = {}
        for r in d["rows"]:
            orig = original.get(r["method"])
            orig_s = f"{orig:.2f}" if orig else "-"
            if not r["fits"]:
                lines.append(f"| {r['method']} | - | - | - | - | does not fit (needs {fmt_bytes(r['min_bytes'])}) "
                             "| - | - "
                             f"| {orig_s} |")
                continue
            ours[r["method"]] = r
            counts = ", ".join(f"{v} {k}" for k, v in sorted(r.get("counts", {}).items()))
            splits = ", ".join(f"{p.removesuffix('/kernel')} k={k}" for p, k in r.get("splits", {}).items()) or "-"
            step, comm = r.get("predicted_step_seconds"), r.get("predicted_collective_seconds")
            timing = f"{step:.2f} ({comm:.2f})" if step is not None and comm is not None else "-"
            lines.append(f"| {r['method']} | {r['batch_size']} | {counts} | {splits} | {r.get('segments', '-')} "
                         f"| {fmt_bytes(r['xla_peak_bytes'])} | {timing} | {r['predicted_samples_per_second']:.1f} "
                         f"| {orig_s} |")
        if "OSDP" in ours and "FSDP" in ours:
            o, f = ours["OSDP"], ours["FSDP"]
            speedup = o['predicted_samples_per_second'] / f['predicted_samples_per_second']
            ratio = f"OSDP / FSDP: ours {speedup:.2f}x (predicted)"
            if original:
                ratio += f", original {original['OSDP'] / original['FSDP']:.2f}x (measured)"
            lines += ["", ratio + "."]
            if "OSDP+TP" in ours:
                t = ours["OSDP+TP"]["predicted_samples_per_second"] / f["predicted_samples_per_second"]
                lines += ["", f"OSDP+TP / FSDP: ours {t:.2f}x (predicted; {ours['OSDP+TP'].get('tensor', 0)} "
                              f"parameters split over the {ours['OSDP+TP'].get('model_axis')!r} axis)."]
            if f.get("predicted_collective_seconds") is not None:
                compute = f["predicted_step_seconds"] - f["predicted_collective_seconds"]
                lines += ["", f"Bound: FSDP's step is {f['predicted_step_seconds']:.2f} s, of which "
                              f"{f['predicted_collective_seconds']:.2f} s collectives and {compute:.2f} s compute "
                              f"(with every layer recomputed in the backward pass). At FSDP's batch size, a plan "
                              f"with no collectives at all would reach at most "
                              f"{f['predicted_step_seconds'] / compute:.2f}x FSDP; "
                              f"OSDP gets beyond that only through a larger batch or less recomputation, and both "
                              f"need the memory the budget does not leave."]
        lines.append("")
    lines += ["## Why our predicted gains differ", "",
              "The search decides per layer (a layer stack is cut into segments with their own strategy, "
              "split count and remat policy), as the original did, and the per-layer optimum is exact within "
              "the cost model (in pairs of layers; a one-layer segment is a loop XLA removes). What bounds "
              "the gain is memory. The *Bound* lines show what removing every collective would give at "
              "FSDP's batch size; reaching it means replicating weights, whose cost per layer is "
              "(1 - 1/N) of the weights and their optimizer state, while the budget leaves only FSDP's "
              "headroom (budget minus FSDP's XLA peak) for replicated layers, a larger batch or saved "
              "activations. The exact search spends that headroom where it buys most: on GPT-2 it saves "
              "the matmul outputs of a few layers (remat `dots`) rather than replicate their kernels. "
              "The step times count every layer's FLOPs: XLA's cost analysis counts a loop body "
              "once, and `osdp_jax.xla.loop_flops` adds the other iterations. The original measured its "
              "FSDP baseline (FairScale's, 2022) on real GPUs, where collectives "
              "over PCIe 3.0 need not reach the 15.75 GB/s the preset assumes and were not overlapped with "
              "compute; our FSDP baseline gathers each layer's weights inside the scanned loop, the most "
              "memory-frugal form, and is modelled with the same hardware numbers as OSDP. Our throughputs "
              "are predictions from spec-sheet numbers, not measurements: on a GPU, `osdp-jax profile` and "
              "`plan.measure_time` would replace them.", ""]
    out = RESULTS / "paper.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
