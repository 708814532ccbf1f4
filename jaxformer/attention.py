"""Attention, written from scratch with `jnp` ops.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

`dot_product_attention` is the whole idea in a few lines; the modules around it only
project the inputs into heads and the heads back out.

The 2017 model's `MultiHeadAttention` is one module used three ways: encoder
self-attention `(x, x, x)`, masked decoder self-attention, and cross-attention
`(x, memory, memory)`, where queries come from the decoder and keys and values from
the encoder's output. Cross-attention is the only place the two stacks meet.

Grouped-query attention (GQA): `n_head` query heads share `n_kv_head` key/value heads,
query head j reading kv head `j // n_rep` with `n_rep = n_head // n_kv_head`. Instead
of repeating K and V `n_rep` times, the queries are viewed as
`[batch, seq, n_kv, n_rep, head_dim]` and one grouped einsum lets every member of a
group read its kv head. Plain multi-head attention is the case `n_kv == n_head`.

Einsum letters, one meaning each in this file:
    b batch   t query position   s key position   d model width (d_model)
    h query head   n kv head   g query head within its kv group   k channel within a head
    c which projection of a packed Q/K/V (0 = Q, 1 = K, 2 = V)
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.cache import LayerKV, LayerSlice
from jaxformer.positions import apply_rope
from jaxformer.sharding import EMBED, HEAD_DIM, HEADS, KV_HEADS, QKV, compute_param, param


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """`softmax(q k^T / sqrt(d_k))` over the keys each query may read.

    Args:
      q: `[batch, T, n_head, head_dim]` queries.
      k: `[batch, S, n_kv, head_dim]` keys, `n_head % n_kv == 0`.
      mask: bool, `[T, S]` or broadcastable to `[batch, T, S]`: True where query t may
        read key s.

    Returns:
      `[batch, n_head, T, S]` float32 weights, each row summing to 1 (the map to look at).
    """
    batch, T, n_head, head_dim = q.shape
    n_kv = k.shape[2]
    q = q.reshape(batch, T, n_kv, n_head // n_kv, head_dim)  # [batch, T, n_kv, n_rep, head_dim]
    # Scale by 1/sqrt(d_k), d_k the per-head width: it keeps the scores' variance near 1
    # so the softmax does not saturate just because heads are wide.
    scores = jnp.einsum("btngk,bsnk->bngts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(head_dim)  # [batch, n_kv, n_rep, T, S] float32
    if mask.ndim == 2:
        mask = mask[None]  # [1, T, S]
    # Block before the softmax: a 0 score would still get weight, and zeroing weights
    # after it would leave rows that no longer sum to 1. The dtype's min (not -inf)
    # turns into an exact 0 weight and keeps a fully blocked row finite.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1)  # [batch, n_kv, n_rep, T, S]
    return weights.reshape(batch, n_head, T, -1)  # head j = kv head j // n_rep, member j % n_rep


def combine_values(weights: jax.Array, v: jax.Array) -> jax.Array:
    """Each query's weighted average of the values: `weights @ V`, per head.

    Args:
      weights: `[batch, n_head, T, S]` attention weights.
      v: `[batch, S, n_kv, head_dim]` values.

    Returns:
      `[batch, T, n_head, head_dim]` in `v.dtype`.
    """
    batch, n_head, T, S = weights.shape
    n_kv, head_dim = v.shape[2], v.shape[3]
    weights = weights.reshape(batch, n_kv, n_head // n_kv, T, S).astype(v.dtype)  # [batch, n_kv, n_rep, T, S]
    out = jnp.einsum("bngts,bsnk->btngk", weights, v)  # [batch, T, n_kv, n_rep, head_dim]
    return out.reshape(batch, T, n_head, head_dim)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scaled dot-product attention with grouped kv heads (see `attention_weights`).

    Args:
      q: `[batch, T, n_head, head_dim]` queries.
      k: `[batch, S, n_kv, head_dim]` keys, `n_head % n_kv == 0`.
      v: `[batch, S, n_kv, head_dim]` values.
      mask: bool `[T, S]` or `[batch, T, S]`, True where query t may read key s.

    Returns:
      `(out, weights)`: out `[batch, T, n_head, head_dim]` in `v.dtype`; weights
      `[batch, n_head, T, S]` float32.
    """
    weights = attention_weights(q, k, mask)
    return combine_values(weights, v), weights


class GQASelfAttention(nn.Module):
    """Causal self-attention of the decoder-only model: GQA with RoPE and a KV cache.

    Attributes:
      config: a `DecoderConfig`.
    """

    config: "DecoderConfig"  # noqa: F821 (jaxformer.config; a string to avoid a cycle)

    @nn.compact
    def __call__(self, x, cos, sin, mask, layer_cache: LayerKV | LayerSlice | None = None, pos=None):
        """
        Args:
          x: `[batch, T, d_model]` normalised residual stream.
          cos, sin: `[T, head_dim // 2]` (or `[batch, T, head_dim // 2]`) RoPE angles of the
            T positions.
          mask: bool `[T, S]` or `[batch, T, S]`, True where a query may read a key; S is T
            without a cache, the cache capacity with one.
          layer_cache: this layer's cached K/V (its slice of a stacked cache in a scanned
            model), or None.
          pos: int32 `[batch]`, each row's slot for this call's first token in the cache.

        Returns:
          `(y, layer_cache)`: y `[batch, T, d_model]`, and the cache with this call's
          K/V written (None without a cache). The weights `[batch, n_head, T, S]` are
          sown into the 'intermediates' collection as `attention_weights`.
        """
        c = self.config
        d, H, K, D = c.d_model, c.n_head, c.n_kv_head, c.head_dim
        init = nn.initializers.normal(0.02)
        # The output projection adds into the residual stream once per block; 1/sqrt(2L)
        # keeps the stream's variance from growing with depth (GPT-2).
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))

        wq = compute_param(self, "wq", init, (d, H, D), (EMBED, HEADS, HEAD_DIM))
        wk = compute_param(self, "wk", init, (d, K, D), (EMBED, KV_HEADS, HEAD_DIM))
        wv = compute_param(self, "wv", init, (d, K, D), (EMBED, KV_HEADS, HEAD_DIM))
        wo = compute_param(self, "wo", residual_init, (H, D, d), (HEADS, HEAD_DIM, EMBED))

        q = jnp.einsum("btd,dhk->bthk", x, wq)  # [batch, T, n_head, head_dim]
        k = jnp.einsum("btd,dnk->btnk", x, wk)  # [batch, T, n_kv, head_dim]
        v = jnp.einsum("btd,dnk->btnk", x, wv)  # [batch, T, n_kv, head_dim]
        if c.qkv_bias:  # Qwen2's q/k/v biases, added before RoPE as a Linear layer adds them
            q = q + compute_param(self, "bq", nn.initializers.zeros, (H, D), (HEADS, HEAD_DIM))
            k = k + compute_param(self, "bk", nn.initializers.zeros, (K, D), (KV_HEADS, HEAD_DIM))
            v = v + compute_param(self, "bv", nn.initializers.zeros, (K, D), (KV_HEADS, HEAD_DIM))
        # Rotate q and k (never v) before caching: a cached key keeps its position.
        q = apply_rope(q, cos, sin, c.rope_pairing)
        k = apply_rope(k, cos, sin, c.rope_pairing)
        if layer_cache is not None:
            layer_cache = layer_cache.write(k, v, pos)
            k, v = layer_cache.read()  # [batch, capacity, n_kv, head_dim]
        out, weights = dot_product_attention(q, k, v, mask)  # [batch, T, n_head, head_dim]
        self.sow("intermediates", "attention_weights", weights)  # a no-op unless asked for (mutable)
        return jnp.einsum("bthk,hkd->btd", out, wo), layer_cache  # concat heads, then W_O


class MultiHeadAttention(nn.Module):
    """The 2017 multi-head attention: one packed Q/K/V projection, heads by reshape.

    `h` heads of width `d_model / h` cost about what one full-width head costs, but give
    `h` separate attention patterns. The heads are not `h` small matrices: one
    `[d_model, 3, h, d_k]` projection (torch packs the same as `in_proj_weight`) is
    read as Q, K, V split into heads.

    Attributes:
      config: a `VanillaConfig`.
    """

    config: "VanillaConfig"  # noqa: F821

    def setup(self):
        c = self.config
        # Xavier-uniform per matrix: W_Q, W_K, W_V are each a [d_model, d_model] map.
        self.w_qkv = param(self, "w_qkv", nn.initializers.xavier_uniform(in_axis=0, out_axis=(2, 3), batch_axis=(1,)),
                           (c.d_model, 3, c.n_head, c.head_dim), (EMBED, QKV, HEADS, HEAD_DIM), c.param_dtype)
        self.b_qkv = param(self, "b_qkv", nn.initializers.zeros, (3, c.n_head, c.head_dim), (QKV, HEADS, HEAD_DIM),
                           c.param_dtype)
        self.w_o = param(self, "w_o", nn.initializers.xavier_uniform(in_axis=(0, 1), out_axis=2),
                         (c.n_head, c.head_dim, c.d_model), (HEADS, HEAD_DIM, EMBED), c.param_dtype)
        self.b_o = param(self, "b_o", nn.initializers.zeros, (c.d_model,), (EMBED,), c.param_dtype)
        self.dropout = nn.Dropout(c.dropout)

    def project_kv(self, memory: jax.Array) -> LayerKV:
        """Keys and values of `memory` `[batch, S, d_model]`: cross-attention's K/V, computed
        once per source and reused at every decoding step."""
        dtype = self.config.dtype
        kv = jnp.einsum("bsd,dchk->cbshk", memory, self.w_qkv[:, 1:].astype(dtype))
        kv = kv + self.b_qkv[1:, None, None].astype(dtype)  # [2, batch, S, n_head, head_dim]
        return LayerKV(k=kv[0], v=kv[1])

    def __call__(self, x, mask, *, memory=None, memory_kv: LayerKV | None = None,
                 layer_cache: LayerKV | None = None, pos=None, deterministic: bool = True):
        """
        Args:
          x: `[batch, T, d_model]`, the queries' input.
          mask: bool, broadcastable to `[batch, T, S]`, True where a query may read a key.
          memory: `[batch, S, d_model]` keys' and values' input for cross-attention;
            None for self-attention (keys and values from `x`).
          memory_kv: cross-attention K/V already projected by `project_kv`.
          layer_cache: self-attention KV cache of this layer (cached decoding).
          pos: int32 `[batch]`, each row's slot for this call's first K/V in `layer_cache`.
          deterministic: False applies dropout to the attention weights.

        Returns:
          `(y, layer_cache)`: y `[batch, T, d_model]`; the cache with this call's K/V
          written (None without one). The weights `[batch, n_head, T, S]` are sown into
          the 'intermediates' collection as `attention_weights`.
        """
        dtype = self.config.dtype
        if memory is None and memory_kv is None:  # self-attention: one GEMM for Q, K and V
            qkv = jnp.einsum("btd,dchk->cbthk", x, self.w_qkv.astype(dtype))
            q, k, v = qkv + self.b_qkv[:, None, None].astype(dtype)  # each [batch, T, n_head, head_dim]
        else:  # cross-attention: Q from the decoder, K and V from the encoder's output
            q = jnp.einsum("btd,dhk->bthk", x, self.w_qkv[:, 0].astype(dtype)) + self.b_qkv[0].astype(dtype)
            memory_kv = self.project_kv(memory) if memory_kv is None else memory_kv
            k, v = memory_kv.k, memory_kv.v  # [batch, S, n_head, head_dim]
        if layer_cache is not None:
            layer_cache = layer_cache.write(k, v, pos)
            k, v = layer_cache.read()  # [batch, capacity, n_head, head_dim]
        weights = attention_weights(q, k, mask)  # [batch, n_head, T, S]
        self.sow("intermediates", "attention_weights", weights)
        out = combine_values(self.dropout(weights, deterministic=deterministic), v)  # [batch, T, n_head, head_dim]
        y = jnp.einsum("bthk,hkd->btd", out, self.w_o.astype(dtype)) + self.b_o.astype(dtype)  # concat heads, W_O
        return y, layer_cache
