"""BERT-style encoder with a masked-language-model head (decoder tied to the word embedding)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from .common import Stack, TransformerConfig


def bert_config(n_layer, d_model, n_head, vocab_size=30522, max_len=512, **kw) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab_size, max_len=max_len, n_layer=n_layer, n_head=n_head,
                             d_model=d_model, d_ff=4 * d_model, causal=False, pre_ln=False,
                             activation="gelu", **kw)


PRESETS = {
    "bert-mini": bert_config(n_layer=2, d_model=64, n_head=4, vocab_size=128, max_len=64),
    "bert-large": bert_config(n_layer=24, d_model=1024, n_head=16),
}


class BERT(nn.Module):
    """tokens (B, T) int -> MLM logits (B, T, vocab). One segment (token type 0)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        dt, cd = cfg.param_dtype, cfg.compute
        init = nn.initializers.normal(0.02)
        t = tokens.shape[1]
        word = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, dtype=cd, param_dtype=dt,
                        name="word_embeddings")
        positions = self.param("position_embeddings", init, (cfg.max_len, cfg.d_model), dt)
        token_type = self.param("token_type_embeddings", init, (2, cfg.d_model), dt)
        x = word(tokens) + positions[:t].astype(cd) + token_type[0].astype(cd)
        x = nn.LayerNorm(dtype=cd, param_dtype=dt, name="embeddings_ln")(x)
        x = Stack(cfg, name="encoder")(x)
        # MLM head: transform, then the tied decoder plus its own bias
        x = nn.Dense(cfg.d_model, kernel_init=init, dtype=cd, param_dtype=dt, name="mlm_dense")(x)
        x = nn.LayerNorm(dtype=cd, param_dtype=dt, name="mlm_ln")(jax.nn.gelu(x))
        bias = self.param("mlm_bias", nn.initializers.zeros, (cfg.vocab_size,), dt)
        return (word.attend(x) + bias.astype(cd)).astype(jnp.float32)
