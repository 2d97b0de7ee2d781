"""Flax models of the OSDP paper: GPT-2, OPT and BERT, with presets by name."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import bert, gpt2, opt
from .common import TransformerConfig, weighted_cross_entropy

FAMILIES = {"gpt2": (gpt2.GPT2, gpt2.PRESETS, "causal"),
            "opt": (opt.OPT, opt.PRESETS, "causal"),
            "bert": (bert.BERT, bert.PRESETS, "mlm")}
PRESETS = {name: (family, cfg) for family, (_, presets, _) in FAMILIES.items() for name, cfg in presets.items()}


def get(preset: str):
    """``(module, config, objective)`` for a preset name; objective is "causal" or "mlm"."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    family, cfg = PRESETS[preset]
    module_cls, _, objective = FAMILIES[family]
    return module_cls(cfg), cfg, objective


def abstract_params(module, seq_len: int):
    """Parameters as ``jax.ShapeDtypeStruct`` (nothing allocated)."""
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    return jax.eval_shape(lambda t: module.init(jax.random.key(0), t), tokens)["params"]


def init_params(module, seq_len: int, seed: int):
    return jax.jit(module.init)(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))["params"]


def make_loss(module):
    """``loss(params, batch)``: weighted token cross-entropy of ``module`` on
    ``batch = {"inputs", "targets", "weights"}``, the mean over examples."""
    def loss(params, batch):
        logits = module.apply({"params": params}, batch["inputs"])
        return weighted_cross_entropy(logits, batch["targets"], batch["weights"])
    return loss


__all__ = ["FAMILIES", "PRESETS", "TransformerConfig", "abstract_params", "get", "init_params", "make_loss"]
