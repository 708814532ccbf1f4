"""The modern decoder-only Transformer (Llama-style).

    x = embed(tokens)
    for each block:  x = x + attn(rmsnorm(x))     # GQA + RoPE, causal, KV cache
                     x = x + swiglu(rmsnorm(x))
    logits = rmsnorm(x) @ embed^T                 # tied output head (or its own matrix)

Pre-norm keeps an identity path through the residual stream; no dropout, no biases.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention import GQASelfAttention
from jaxformer.cache import KVCache, LayerKV
from jaxformer.config import DecoderConfig
from jaxformer.embeddings import lookup
from jaxformer.feedforward import SwiGLU
from jaxformer.norms import RMSNorm
from jaxformer.positions import rope_tables
from jaxformer.validation import check_step_inputs


class Block(nn.Module):
    """One pre-norm block: attention reads across positions, SwiGLU works on each."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask, layer_cache: LayerKV | None = None, pos=None):
        c = self.config
        h, layer_cache = GQASelfAttention(c, name="attn")(
            RMSNorm(c.norm_eps, name="attn_norm")(x), cos, sin, mask, layer_cache, pos)
        x = x + h  # [batch, T, d_model]
        x = x + SwiGLU(c, name="mlp")(RMSNorm(c.norm_eps, name="mlp_norm")(x))
        return x, layer_cache


class Decoder(nn.Module):
    """Decoder-only language model.

    `Decoder(config).apply({'params': params}, tokens, cache=None) -> (logits, cache)`

    Without a cache it is the plain causal forward and returns `(logits, None)`. With a
    cache the T tokens are the next T of the sequence: query i sits at absolute position
    `cache.pos + i` and may read every cached key up to it, so a multi-token prefill and
    a one-token step are the same call. The returned cache has them written and
    `pos + T`. The cache's shape is fixed by its capacity, so one jitted function serves
    every step.

    Attributes:
      config: the `DecoderConfig`.
    """

    config: DecoderConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, cache: KVCache | None = None):
        """
        Args:
          tokens: int `[batch, T]`, ids in `[0, vocab_size)`.
          cache: a `KVCache` from `KVCache.create(config, batch)`, or None.

        Returns:
          `(logits, cache)`: logits `[batch, T, vocab_size]` in `config.dtype`; the
          updated cache (None when none was given).
        """
        c = self.config
        batch, T = tokens.shape
        pos = jnp.zeros((), jnp.int32) if cache is None else cache.pos
        S = T if cache is None else cache.capacity
        check_step_inputs(tokens, c, c.vocab_size, cache)

        embed = self.param("embed", nn.initializers.normal(0.02), (c.vocab_size, c.d_model))
        x = lookup(embed, tokens).astype(c.dtype)  # [batch, T, d_model]

        cos_table, sin_table = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta)  # [max_seq_len, head_dim/2]
        cos = jax.lax.dynamic_slice_in_dim(cos_table, pos, T)  # [T, head_dim/2], angles of pos .. pos+T-1
        sin = jax.lax.dynamic_slice_in_dim(sin_table, pos, T)
        # Query i is at absolute position pos + i; key slot s holds position s. Slots past
        # pos + i are the future or not yet written: causal mask, (T, S), not square once
        # a prefix is cached.
        q_pos = pos + jnp.arange(T)  # [T]
        mask = jnp.arange(S)[None, :] <= q_pos[:, None]  # [T, S]

        new_layers = []
        for i in range(c.n_layer):
            layer_cache = None if cache is None else cache.layers[i]
            x, layer_cache = Block(c, name=f"block_{i}")(x, cos, sin, mask, layer_cache, pos)
            new_layers.append(layer_cache)
        x = RMSNorm(c.norm_eps, name="final_norm")(x)

        if c.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, embed.astype(c.dtype))  # [batch, T, vocab]
        else:
            lm_head = self.param("lm_head", nn.initializers.normal(0.02), (c.d_model, c.vocab_size))
            logits = jnp.einsum("btd,dv->btv", x, lm_head.astype(c.dtype))
        if cache is None:
            return logits, None
        # Past the capacity the writes above were clamped: make that loud, never silent.
        # (Concrete inputs were rejected in _check; this is the guard inside jit.)
        logits = jnp.where(pos + T <= S, logits, jnp.nan)
        # pos advances once, after every layer has written at the same slots.
        return logits, KVCache(layers=tuple(new_layers), pos=pos + T)
