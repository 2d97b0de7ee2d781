"""A budget sweep, as in the paper's figure: DDP, FSDP and OSDP planned at each of several
per-device budgets, predicted samples/s against the budget, with the budgets no plan fits marked.

Nothing is trained. The probes compiled at the first budget are kept in the process for the
others, a layout compiled at one budget is not compiled again at another, and the share of
memory XLA needed over the model on a compiled plan is left free at the next budgets
(``osdp_jax.plan``): after the first budget a method's plan is usually one compile. Those
compiles are done ahead, together (``osdp_jax.planning.compile_ahead``, as
``osdp_jax.plan_budgets`` does for one method): every method's plan at every later budget is
drafted by the cost model, the drafts' steps are compiled at once, pipelined over the compile
threads, and then each is planned in turn, finding its step compiled.
"""
from __future__ import annotations

import json
import pathlib
import time

import osdp_jax
from osdp_jax.cli import runner


def sweep(s: runner.Setup, out: pathlib.Path, budgets: list[str]) -> list[dict]:
    """One row per (budget, method); writes ``sweep.json``, ``sweep.md`` and ``sweep.png`` to ``out``.

    Every method is drafted at the first budget by the cost model, OSDP first, so that the probes
    of all are compiled in one batch, and planned there in turn (what the compiled plans teach the
    planner is kept: FSDP's miss at the README's first budget changes OSDP's choice there). Then
    every later (budget, method) is drafted, the drafts' verification compiles are done at once
    (``osdp_jax.planning.compile_ahead``, pipelined over the compile threads), and each is planned
    in turn, finding its draft compiled. The plans are those planned one after the other; a draft
    that an earlier plan's lesson changed costs its compile for nothing."""
    rows, start = [], time.perf_counter()
    ahead = {"first": {"seconds": 0.0}, "later": {"seconds": 0.0, "compiles": 0}}
    methods = runner.methods(s)
    with osdp_jax.planning.gc_paused():  # between the plans too (osdp_jax.core.gc)
        for i, budget in enumerate(budgets):
            t0 = time.perf_counter()
            if i == 0:  # drafted: every method's probes in one batch
                _drafts(s, budgets[:1], methods)
                ahead["first"]["seconds"] = time.perf_counter() - t0
            elif i == 1:  # every later (budget, method) drafted, their verification compiles done at once
                p = s.cfg.plan
                ahead["later"]["compiles"] = osdp_jax.planning.compile_ahead(
                    s.abstract_params(), s.mesh, _drafts(s, budgets[1:], methods), loss_fn=s.loss_fn,
                    batch=s.abstract_batch(p.batch_sizes[0]), optimizer=s.optimizer)
                ahead["later"]["seconds"] = time.perf_counter() - t0
            at = runner.at_budget(s, budget)
            for method in methods:
                row = {"budget": budget, "budget_bytes": osdp_jax.parse_bytes(budget), "method": method.name}
                t0 = time.perf_counter()
                try:
                    plan = method.plan(at, verify="figures")  # nothing is trained: XLA's figures suffice
                except osdp_jax.InfeasibleBudgetError as e:  # its probes and compiles took time too
                    rows.append({**row, "fits": False, "min_bytes": e.min_bytes,
                                 "planning_seconds": time.perf_counter() - t0})
                    continue
                rows.append({**row, "fits": True, "batch_size": plan.batch_size, "counts": plan.counts(),
                             "xla_peak_bytes": plan.xla_peak_bytes,
                             "predicted_samples_per_second": plan.predicted_samples_per_second,
                             "planning_seconds": plan.planning_seconds, "compiles": plan.compiles,
                             "segments": runner.segments_text(plan)})
    seconds = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"model": s.cfg.model.preset, "rows": rows, "seconds": seconds,
                                                "ahead": ahead}, indent=1))
    (out / "sweep.md").write_text(sweep_markdown(s.cfg.model.preset, rows, seconds, ahead))
    plot_sweep(s.cfg.model.preset, rows, out / "sweep.png")
    return rows


def _drafts(s: runner.Setup, budgets: list[str], methods: list[tuple]) -> list:
    """Every method's draft at each of ``budgets``: the cost model's plan, not verified (the
    first budget's are not compiled ahead: what its verified plans teach the planner can change
    the next method's choice there)."""
    drafts = []
    for budget in budgets:
        at = runner.at_budget(s, budget)
        # OSDP (the widest space) first: its probes, compiled in one batch, include the baselines'
        # (a draft changes nothing the verified plans learn, so the order changes no plan)
        for method in reversed(methods):
            if method.tensor is not None:
                continue  # another mesh configuration: its plans are not drafts of these
            try:
                drafts.append(method.plan(at, verify=False))
            except osdp_jax.InfeasibleBudgetError:
                pass  # nothing to compile ahead: planned in turn, it compiles what it needs
    return drafts


def sweep_markdown(model: str, rows: list[dict], seconds: float | None = None, ahead: dict | None = None) -> str:
    """The table; ``seconds``: the whole sweep's planning, written under it; ``ahead``: the
    ``seconds`` of drafting the ``"first"`` budget's plans (its probes, counted in its row), and
    the ``seconds`` and ``compiles`` of drafting and compiling ahead the ``"later"`` budgets' (a
    line of their own)."""
    f = osdp_jax.format_bytes
    names = list(dict.fromkeys(r["method"] for r in rows))
    budgets = list(dict.fromkeys(r["budget_bytes"] for r in rows))
    cell = {(r["budget_bytes"], r["method"]): r for r in rows}
    ahead = ahead or {}
    lines = [f"# {model}: predicted samples/s against the per-device budget", "",
             "Predicted by the cost model at each method's best batch size; every plan that fits was compiled "
             "and its XLA peak is within the budget. \"-\" marks a budget the method cannot meet. Planning "
             "seconds are per budget, all methods (one that does not fit included), on a warm or cold compilation "
             "cache as it came.", "",
             "| budget | " + " | ".join(names) + " | planning s (all methods) |",
             "|---" * (len(names) + 2) + "|"]
    for i, b in enumerate(budgets):
        here = [cell[b, n] for n in names if (b, n) in cell]
        spent = sum(r.get("planning_seconds", 0.0) for r in here)
        spent += ahead.get("first", {}).get("seconds", 0.0) if i == 0 else 0.0
        lines.append(f"| {f(b)} | " + " | ".join(
            f"{cell[b, n]['predicted_samples_per_second']:.1f}" if cell.get((b, n), {}).get("fits") else "-"
            for n in names) + f" | {spent:.1f} |")
    later = ahead.get("later")
    if later and len(budgets) > 1:
        lines.append(f"| later budgets' plans, drafted and compiled ahead at once ({later['compiles']} compiles) | "
                     + " | ".join("" for _ in names) + f" | {later['seconds']:.1f} |")
    if seconds is not None:
        lines += ["", f"The whole sweep: {seconds:.1f} s of planning."]
    return "\n".join(lines) + "\n"


def plot_sweep(model: str, rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    scale = 2**30 if max(r["budget_bytes"] for r in rows) >= 2**30 else 2**20
    unit = "GiB" if scale == 2**30 else "MiB"
    markers = iter("osD^v<>")
    for name in dict.fromkeys(r["method"] for r in rows):
        marker = next(markers, "o")
        pts = sorted((r["budget_bytes"] / scale, r["predicted_samples_per_second"])
                     for r in rows if r["method"] == name and r["fits"])
        line = ax.plot(*zip(*pts), marker=marker, markerfacecolor="none", label=name)[0] if pts else None
        misses = [r["budget_bytes"] / scale for r in rows if r["method"] == name and not r["fits"]]
        if misses:  # the budgets this method cannot meet, on the axis
            ax.plot(misses, [0] * len(misses), linestyle="none", marker="x", clip_on=False,
                    color=line.get_color() if line else None, label=f"{name}: does not fit")
    fitting = [r["budget_bytes"] for r in rows if r["fits"]]
    lowest = min(r["budget_bytes"] for r in rows)
    if not fitting or min(fitting) > lowest:  # budgets no method meets
        edge = (min(fitting) if fitting else max(r["budget_bytes"] for r in rows)) / scale
        ax.axvspan(lowest / scale, edge, color="gray", alpha=0.2, label="no plan fits")
    ax.set_xlabel(f"per-device budget ({unit})")
    ax.set_ylabel("predicted samples / s")
    ax.set_title(f"{model}: budget sweep")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_budgets(text: str) -> list[str]:
    """``"4GB,6GB,8GB"`` -> the budgets, each checked, in ascending order of bytes."""
    items = [b.strip() for b in text.split(",")]
    if "" in items[:-1]:  # a trailing comma is harmless; an empty item between two is a budget left out
        raise ValueError(f"an empty budget between commas in {text!r}: give every budget, e.g. --budgets 4GB,6GB,8GB")
    budgets = [b for b in items if b]
    if not budgets:
        raise ValueError("--budgets needs at least one budget, e.g. --budgets 4GB,6GB,8GB")
    for b in budgets:
        osdp_jax.parse_bytes(b)  # raises a ValueError naming the bad one
    return sorted(budgets, key=osdp_jax.parse_bytes)


__all__ = ["parse_budgets", "plot_sweep", "sweep", "sweep_markdown"]
