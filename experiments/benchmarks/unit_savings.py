"""What sharding each unit saves, one at a time, by XLA's figures (compile-only).

The figures behind the README's account of the units' memory terms (``osdp_jax._cost``,
``Problem.saving_bytes``, ``Calibration.last_saving``), on the three model families of
``experiments/benchmarks/foreign.py`` at the foreign-models benchmark's size (8 simulated CPU
devices, Adam, global batch 32). Per model, XLA's temp (bytes per device) of:

- every parameter replicated, and every unit's parameters sharded at the unit (the rest replicated);
- *single*: one unit sharded, the others replicated: temp saved against all replicated;
- *marginal*: every unit sharded but one: temp that replicating that one costs against all sharded;

and each unit's parameter bytes and the activation bytes discovery counts for it
(``runtime.units.saved_bytes``). Then, on the ViT without units, the temp change of sharding its
k largest weights gathered once per step (the pool overlap of ``osdp_jax._cost``).

Writes experiments/results/unit_savings.md.

Run: python experiments/benchmarks/unit_savings.py
"""
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import optax  # noqa: E402

import osdp_jax  # noqa: E402
from experiments.benchmarks import foreign  # noqa: E402
from osdp_jax._discover import find  # noqa: E402
from osdp_jax._strategies import spec_for  # noqa: E402

FAMILIES = foreign.FAMILIES
MIB = 2**20


def main():
    mesh = jax.make_mesh((8,), ("data",))
    opt = optax.adam(1e-3)
    lines = ["# What sharding each unit saves", "",
             "Measured with `python experiments/benchmarks/unit_savings.py` (XLA's temp per device, compile-only,",
             "8 simulated CPU devices, Adam, global batch 32). *Single*: temp saved by sharding that unit alone",
             "(the rest replicated). *Marginal*: temp that replicating that unit costs when every other unit",
             "is sharded. *Activations*: the bytes discovery counts for the unit (`jax.vjp` residuals that",
             "are not inputs, global batch).", ""]
    for name, make in FAMILIES.items():
        params, loss_fn, batch = make()
        infos = {i.path: i for i in osdp_jax.describe(params)}
        units = osdp_jax.units.find(loss_fn, params, batch)
        saved = find(loss_fn, params, batch).saved
        names = list(dict.fromkeys(units[p] for p in infos if p in units))

        def temp(sharded_units, extra=()):
            specs = {p: s for p in infos if (units.get(p) in sharded_units or p in extra)
                     and (s := spec_for(infos[p], "zero3", ("data",), 8, False, 8)) is not None}
            layout = osdp_jax.Layout.from_specs(params, mesh, specs, units={} if extra else units)
            return osdp_jax.profile_step(loss_fn, opt, params, batch, mesh, layout).temp_bytes

        none, every = temp(set()), temp(set(names))
        lines += [f"## {name}", "", f"Temp: all replicated {none / MIB:.3f} MiB; every unit sharded "
                  f"{every / MIB:.3f} MiB (saves {(none - every) / MIB:.3f}).", "",
                  "| unit | parameters | activations | single | marginal |", "|---|---|---|---|---|"]
        singles = marginals = 0.0
        for u in names:
            single = none - temp({u})
            marginal = temp(set(names) - {u}) - every
            singles, marginals = singles + single, marginals + marginal
            lines.append(f"| {u} | {sum(i.nbytes for p, i in infos.items() if units.get(p) == u) / MIB:.3f} MiB | "
                         f"{saved.get(u, 0) / MIB:.3f} MiB | {single / MIB:+.3f} MiB | {marginal / MIB:+.3f} MiB |")
            print(lines[-1])
        lines += ["", f"Singles sum to {singles / MIB:.3f} MiB, marginals to {marginals / MIB:.3f} MiB, against "
                  f"{(none - every) / MIB:.3f} MiB for all units together.", ""]
        if "ViT" in name:
            biggest = sorted(infos, key=lambda p: -infos[p].nbytes)
            lines += ["Without units, the k largest weights sharded and gathered once per step (the rest replicated):", "",
                      "| k | bytes sharded | temp change | per byte |", "|---|---|---|---|"]
            for k in (4, 8, 12, 16, 32):
                z = sum(infos[p].nbytes for p in biggest[:k])
                d = temp(set(), biggest[:k]) - none
                lines.append(f"| {k} | {z / MIB:.2f} MiB | {d / MIB:+.3f} MiB | {d / z:+.2f} |")
                print(lines[-1])
            lines.append("")
    out = pathlib.Path(__file__).resolve().parents[1] / "results" / "unit_savings.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
