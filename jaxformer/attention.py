"""Attention, written from scratch with `jnp` ops.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

`dot_product_attention` is the whole idea in a few lines; the modules around it only
project the inputs into heads and the heads back out.

Grouped-query attention (GQA): `n_head` query heads share `n_kv_head` key/value heads,
query head j reading kv head `j // n_rep` with `n_rep = n_head // n_kv_head`. Instead
of repeating K and V `n_rep` times, the queries are viewed as
`[batch, seq, n_kv, n_rep, head_dim]` and one grouped einsum lets every member of a
group read its kv head. Plain multi-head attention is the case `n_kv == n_head`.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.cache import LayerKV
from jaxformer.positions import apply_rope


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention with grouped kv heads.

    Args:
      q: `[batch, T, n_head, head_dim]` queries.
      k: `[batch, S, n_kv, head_dim]` keys, `n_head % n_kv == 0`.
      v: `[batch, S, n_kv, head_dim]` values.
      mask: bool `[T, S]` or `[batch, T, S]`, True where query t may read key s.

    Returns:
      `(out, weights)`: out `[batch, T, n_head, head_dim]` in `v.dtype`; weights
      `[batch, n_head, T, S]` float32, each row summing to 1 (the map to visualise).
    """
    batch, T, n_head, head_dim = q.shape
    n_kv = k.shape[2]
    q = q.reshape(batch, T, n_kv, n_head // n_kv, head_dim)  # [batch, T, n_kv, n_rep, head_dim]
    # Scale by 1/sqrt(d_k), d_k the per-head width: it keeps the scores' variance near 1
    # so the softmax does not saturate just because heads are wide.
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(head_dim)  # [batch, n_kv, n_rep, T, S] float32
    if mask.ndim == 2:
        mask = mask[None]  # [1, T, S]
    # Block before the softmax: a 0 score would still get weight, and zeroing weights
    # after it would leave rows that no longer sum to 1. The dtype's min (not -inf)
    # turns into an exact 0 weight and keeps a fully blocked row finite.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # [batch, n_kv, n_rep, T, S]
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(v.dtype), v)  # [batch, T, n_kv, n_rep, head_dim]
    return out.reshape(batch, T, n_head, head_dim), weights.reshape(batch, n_head, T, -1)


class GQASelfAttention(nn.Module):
    """Causal self-attention of the decoder-only model: GQA with RoPE and a KV cache.

    Attributes:
      config: a `DecoderConfig`.
    """

    config: "DecoderConfig"  # noqa: F821 (jaxformer.config; a string to avoid a cycle)

    @nn.compact
    def __call__(self, x, cos, sin, mask, layer_cache: LayerKV | None = None, pos=None):
        """
        Args:
          x: `[batch, T, d_model]` normalised residual stream.
          cos, sin: `[T, head_dim // 2]` RoPE angles of the T positions.
          mask: bool `[T, S]`, True where a query may read a key; S is T without a cache,
            the cache capacity with one.
          layer_cache: this layer's cached K/V, or None.
          pos: int32 scalar, where this call's tokens are written in the cache.

        Returns:
          `(y, layer_cache)`: y `[batch, T, d_model]`, and the cache with this call's
          K/V written (None without a cache).
        """
        c = self.config
        d, H, K, D = c.d_model, c.n_head, c.n_kv_head, c.head_dim
        init = nn.initializers.normal(0.02)
        # The output projection adds into the residual stream once per block; 1/sqrt(2L)
        # keeps the stream's variance from growing with depth (GPT-2).
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))
        wq = self.param("wq", init, (d, H, D)).astype(c.dtype)
        wk = self.param("wk", init, (d, K, D)).astype(c.dtype)
        wv = self.param("wv", init, (d, K, D)).astype(c.dtype)
        wo = self.param("wo", residual_init, (H, D, d)).astype(c.dtype)

        q = jnp.einsum("btd,dhk->bthk", x, wq)  # [batch, T, n_head, head_dim]
        k = jnp.einsum("btd,dhk->bthk", x, wk)  # [batch, T, n_kv, head_dim]
        v = jnp.einsum("btd,dhk->bthk", x, wv)  # [batch, T, n_kv, head_dim]
        # Rotate q and k (never v) before caching: a cached key keeps its position.
        q = apply_rope(q, cos, sin, c.rope_pairing)
        k = apply_rope(k, cos, sin, c.rope_pairing)
        if layer_cache is not None:
            layer_cache = layer_cache.write(k, v, pos)
            k, v = layer_cache.k, layer_cache.v  # [batch, capacity, n_kv, head_dim]
        out, _ = dot_product_attention(q, k, v, mask)  # [batch, T, n_head, head_dim]
        return jnp.einsum("bthk,hkd->btd", out, wo), layer_cache  # concat heads, then W_O
