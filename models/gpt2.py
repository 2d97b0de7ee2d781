"""GPT-2 (minGPT-style decoder): learned positions, pre-LN blocks, untied LM head."""
from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from .common import Stack, TransformerConfig


def gpt2_config(n_layer, d_model, n_head, vocab_size=30522, max_len=512, **kw) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, max_len=max_len, n_layer=n_layer, n_head=n_head,
                             d_model=d_model, d_ff=4 * d_model, causal=True, pre_ln=True,
                             activation="gelu", **kw)


PRESETS = {
    # trains on a CPU in a minute or two (the addition task: vocab of 10 digits)
    "gpt2-mini": gpt2_config(n_layer=2, d_model=64, n_head=4, vocab_size=16, max_len=32),
    # the OSDP paper's GPT-2 experiments (about 1.5B and 2.5B parameters)
    "gpt2-48l-1536": gpt2_config(n_layer=48, d_model=1536, n_head=48),
    "gpt2-48l-2048": gpt2_config(n_layer=48, d_model=2048, n_head=32),
}


class GPT2(nn.Module):
    """tokens (B, T) int -> logits (B, T, vocab)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        dt, cd = cfg.param_dtype, cfg.compute
        init = nn.initializers.normal(0.02)
        t = tokens.shape[1]
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=cd, param_dtype=dt, name="wte")
        wpe = self.param("wpe", init, (cfg.max_len, cfg.d_model), dt)
        x = wte(tokens) + wpe[:t].astype(cd)
        x = Stack(cfg, name="blocks")(x)
        x = nn.LayerNorm(dtype=cd, param_dtype=dt, name="ln_f")(x)
        return nn.Dense(cfg.vocab_size, use_bias=False, kernel_init=init, dtype=cd, param_dtype=dt,
                        name="lm_head")(x).astype(jnp.float32)
