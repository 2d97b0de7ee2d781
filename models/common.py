"""Transformer pieces shared by the GPT-2, OPT and BERT models.

Layers are stacked and run with ``osdp_jax.layers.Stack`` (a ``jax.lax.scan`` under
``jax.checkpoint``): one set of stacked parameters (leading axis = layer) and one compiled loop body
per segment. That keeps compile time flat in depth, lets XLA free each layer's activations, and
lets a plan gather each layer's weights inside the loop and cut the stack into segments with their
own strategy and remat policy (see ``experiments/benchmarks/gather_memory.py``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen as nn

import osdp_jax


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape of a transformer stack. Every size is a count (tokens, features or layers)."""

    vocab_size: int
    max_len: int  # longest sequence (learned position table rows)
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int  # feed-forward hidden width
    causal: bool = True
    pre_ln: bool = True  # GPT-2/OPT put LayerNorm before each sub-layer, BERT after
    activation: str = "gelu"  # "gelu" or "relu"
    dtype: str = "float32"  # parameter dtype (the masters)
    compute_dtype: str = ""  # the dtype layers compute in, e.g. "bfloat16" ("": the parameter dtype)

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")
        if self.activation not in ("gelu", "relu"):
            raise ValueError(f"activation must be 'gelu' or 'relu', got {self.activation!r}")
        for name in ("vocab_size", "max_len", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def param_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def compute(self):
        """The compute dtype: ``compute_dtype``, else the parameter dtype."""
        return jnp.dtype(self.compute_dtype or self.dtype)


def attention(x, qkv_kernel, qkv_bias, out_kernel, out_bias, n_head: int, causal: bool, dtype=None):
    """Multi-head self-attention in plain JAX: ``x`` (B, T, D) -> (B, T, D), computed in ``dtype``
    (default: the inputs' and kernels' common type).

    The projections go through ``osdp_jax.split.dense``, so a plan may split their kernels.
    """
    b, t, d = x.shape
    q, k, v = jnp.split(osdp_jax.split.dense(x, qkv_kernel, qkv_bias, dtype=dtype), 3, axis=-1)
    q, k, v = (y.reshape(b, t, n_head, d // n_head) for y in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // n_head).astype(x.dtype)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(scores.dtype).min)
    att = jax.nn.softmax(scores, axis=-1)
    y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
    return osdp_jax.split.dense(y, out_kernel, out_bias, dtype=dtype)


class Block(nn.Module):
    """One transformer layer: attention and feed-forward, each with a residual and a LayerNorm."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dt, cd = cfg.param_dtype, cfg.compute
        init = nn.initializers.normal(0.02)
        d = cfg.d_model
        qkv_k = self.param("qkv_kernel", init, (d, 3 * d), dt)
        qkv_b = self.param("qkv_bias", nn.initializers.zeros, (3 * d,), dt)
        out_k = self.param("out_kernel", init, (d, d), dt)
        out_b = self.param("out_bias", nn.initializers.zeros, (d,), dt)
        ln1 = nn.LayerNorm(dtype=cd, param_dtype=dt, name="ln1")
        ln2 = nn.LayerNorm(dtype=cd, param_dtype=dt, name="ln2")
        act = jax.nn.gelu if cfg.activation == "gelu" else jax.nn.relu
        fc1 = nn.Dense(cfg.d_ff, kernel_init=init, dtype=cd, param_dtype=dt, name="fc1")
        fc2 = nn.Dense(d, kernel_init=init, dtype=cd, param_dtype=dt, name="fc2")

        def attn(h):
            return attention(h, qkv_k, qkv_b, out_k, out_b, cfg.n_head, cfg.causal,
                             cd if cfg.compute_dtype else None)

        if cfg.pre_ln:
            x = x + attn(ln1(x))
            x = x + fc2(act(fc1(ln2(x))))
        else:
            x = ln1(x + attn(x))
            x = ln2(x + fc2(act(fc1(x))))
        return x


def Stack(config: TransformerConfig, name: str) -> nn.Module:  # noqa: N802 (a module factory)
    """``n_layer`` Blocks with stacked parameters (``<name>/layers/...``, leading axis = layer), run
    by ``osdp_jax.layers.Stack``: under an osdp-jax plan each layer's ZeRO-3 weights are gathered
    inside the loop (and again in the backward pass), segment by segment as the plan cuts the
    stack; elsewhere an ordinary scan with full rematerialisation."""
    return osdp_jax.layers.Stack(Block(config), length=config.n_layer, name=name)


def weighted_cross_entropy(logits, targets, weights):
    """Mean over the batch of each example's weighted token cross-entropy (nats).

    Every example in a batch carries the same total weight in this project's tasks, so this is
    also the mean over weighted tokens, and per-device means average to the global one.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    per_example = (nll * weights).sum(-1) / jnp.maximum(weights.sum(-1), 1e-9)
    return per_example.mean()
