"""OPT-style decoder: learned positions (offset 2), pre-LN, ReLU FFN, LM head tied to the embedding."""
from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from .common import Stack, TransformerConfig

POSITION_OFFSET = 2  # OPT's learned position table reserves the first two rows


def opt_config(n_layer, d_model, n_head, d_ff, vocab_size=50272, max_len=2048, **kw) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, max_len=max_len, n_layer=n_layer, n_head=n_head,
                             d_model=d_model, d_ff=d_ff, causal=True, pre_ln=True, activation="relu", **kw)


PRESETS = {
    "opt-mini": opt_config(n_layer=2, d_model=64, n_head=4, d_ff=256, vocab_size=128, max_len=64),
    # OPT-30B's layer shape, cut to 8 layers (the OSDP paper's operator-splitting experiment)
    "opt-30b-8l": opt_config(n_layer=8, d_model=7168, n_head=56, d_ff=28672),
}


class OPT(nn.Module):
    """tokens (B, T) int -> logits (B, T, vocab)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        dt, cd = cfg.param_dtype, cfg.compute
        init = nn.initializers.normal(0.02)
        t = tokens.shape[1]
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=cd, param_dtype=dt,
                         name="embed_tokens")
        positions = self.param("embed_positions", init, (cfg.max_len + POSITION_OFFSET, cfg.d_model), dt)
        x = embed(tokens) + positions[POSITION_OFFSET:POSITION_OFFSET + t].astype(cd)
        x = Stack(cfg, name="layers")(x)
        x = nn.LayerNorm(dtype=cd, param_dtype=dt, name="final_layer_norm")(x)
        return embed.attend(x).astype(jnp.float32)
