"""Where ZeRO-3 gathers decides its memory: XLA's per-device peak of one train step, compile-only.

For a model preset (default gpt2-48l-1536, batch 8, sequence 512, 8 devices), compiles the step as
DDP (all replicated), FSDP with every weight gathered once per step, and FSDP with the stacked
layer weights gathered per layer inside the scanned loop (``osdp_jax.layers.scan``), and prints
XLA's figures and the collectives in the HLO.

Run: python experiments/benchmarks/gather_memory.py [--preset NAME] [--batch B] [--seq T]
"""
import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import osdp_jax  # noqa: E402
from osdp_jax.cli import config, runner  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-48l-1536")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    args = ap.parse_args()
    cfg = config.load("experiments/paper/gpt2_48l_1536.toml",
                      {"model.preset": args.preset, "data.seq_len": str(args.seq),
                       "plan.batch_sizes": str(args.batch)})
    s = runner.setup(cfg)
    params, batch = s.abstract_params(), s.abstract_batch(args.batch)
    in_loop, dense = osdp_jax.discover(s.loss_fn, params, batch)
    fsdp = osdp_jax.Layout.fsdp(params, s.mesh, in_loop=in_loop, dense=dense - in_loop)
    once = osdp_jax.Layout.from_specs(params, s.mesh, fsdp.specs_by_path, dense=dense - in_loop,
                                      stacks_per_step=True)

    print(f"{args.preset}, global batch {args.batch}, sequence {args.seq}, 8 devices (XLA, compile-only)")
    for name, layout in (("DDP", osdp_jax.Layout.ddp(params, s.mesh)),
                         ("FSDP, gathered once per step", once),
                         ("FSDP, gathered per layer in the loop", fsdp)):
        prof = osdp_jax.profile_step(s.loss_fn, s.optimizer, params, batch, s.mesh, layout)
        print(f"{name:38s} peak {osdp_jax.format_bytes(prof.peak_bytes):>11s}  "
              f"temp {osdp_jax.format_bytes(prof.temp_bytes):>11s}  "
              f"args {osdp_jax.format_bytes(prof.argument_bytes):>11s}  collectives {prof.collectives}")


if __name__ == "__main__":
    main()
