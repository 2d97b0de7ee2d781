"""Sequence parallelism: what splitting the row layers' outputs on their sequence saves, and costs.

On a 2 (data) x 4 (model) mesh of simulated CPU devices, for two models of ``tests/``: the plan
with the pairs split over the model axis (``plan(tensor={})``), without and with
``sequence=True``, at 1 GB per device: the predicted and XLA peak per device, and the predicted
samples/s (default CPU profile). Every parameter replicated over the data axis (all-replicated,
``strategies=("replicate",)``) for the Flax attention stack, all-ZeRO-3 for the SwiGLU stack.

Writes experiments/results/sequence_parallelism.md. Run:
python experiments/benchmarks/sequence_parallelism.py
"""
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import foreign  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
import test_tensor  # noqa: E402

import osdp_jax  # noqa: E402

MODELS = {
    "2 Flax attention + MLP blocks, seq 64, d 128, batch 8, all replicated":
        (lambda: test_tensor._mha_stack(seq=64, d=128), ("replicate",)),
    "SwiGLU layers.Stack, 2 layers, d 64, seq 16, batch 8, all ZeRO-3":
        (lambda: foreign.swiglu_lm(layers=2, d=64, ffn=128, vocab=128, batch=8, seq=16), ("zero3",)),
}


def main():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    lines = ["# Sequence parallelism", "",
             f"Measured with `python experiments/benchmarks/sequence_parallelism.py` (jax {jax.__version__}), 8 "
             "simulated CPU devices in a 2 (data) x 4 (model) mesh, `plan(tensor={})` at 1 GB per device, "
             "SGD. Peaks per device, predicted and by XLA (compiling the step); samples/s predicted (default "
             "CPU profile).", "",
             "| model | sequence | predicted peak | XLA peak | XLA peak against without | predicted samples/s |",
             "|---|---|---|---|---|---|"]
    for name, (make, strategies) in MODELS.items():
        params, loss_fn, batch = make()
        plans = [osdp_jax.plan(params, mesh, budget="1GB", loss_fn=loss_fn, batch=batch, optimizer=optax.sgd(0.1),
                               units=(), tensor={}, strategies=strategies, sequence=s) for s in (False, True)]
        for plan in plans:
            lines.append(f"| {name} | {plan.sequence} | {plan.predicted_peak_bytes / 1e6:.3f} MB "
                         f"| {plan.xla_peak_bytes / 1e6:.3f} MB "
                         f"| {plan.xla_peak_bytes / plans[0].xla_peak_bytes - 1:+.1%} "
                         f"| {plan.predicted_samples_per_second:.1f} |")
    text = "\n".join(lines) + "\n"
    (ROOT / "experiments" / "results" / "sequence_parallelism.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
