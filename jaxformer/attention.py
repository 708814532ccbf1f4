"""Attention, written from scratch with `jnp` ops.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Grouped-query attention: `n_head` query heads share `n_kv_head` key/value heads, query
head j reading kv head `j // n_rep`, `n_rep = n_head // n_kv_head`. Rather than repeat K
and V, the queries are viewed as `[batch, seq, n_kv, n_rep, head_dim]` and one grouped
einsum lets each group read its kv head; `n_kv == n_head` is plain multi-head attention.

Einsum letters, one meaning each in this file:
    b batch   t query position   s key position   d model width (d_model)
    h query head   n kv head   g query head within its kv group   k channel within a head
    c which projection of a packed Q/K/V (0 = Q, 1 = K, 2 = V)
"""

import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.blockwise import blockwise_attention, in_blocks_for, visible
from jaxformer.cache import LayerKV
from jaxformer.dropout import Dropout
from jaxformer.kernels import mosaic_attention, triton_attention
from jaxformer.kernels.decode_attention import decode_attention
from jaxformer.kernels.decode_attention import supports as decoding_supports
from jaxformer.lora import project
from jaxformer.norms import rms_norm
from jaxformer.positions import apply_rope, rope_attention_factor, rope_cos_sin, rope_frequencies
from jaxformer.products import precision_for, product
from jaxformer.sharding import EMBED, HEAD_DIM, HEADS, KV_HEADS, QKV, Weight, compute_param, param


def attention_weights(q: jax.Array, k: jax.Array, mask: jax.Array, *, scale: float | None = None,
                      softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`softmax(q k^T * scale)` over the keys each query may read: float32 `[batch, n_head,
    T, S]` from queries `q` `[batch, T, n_head, head_dim]`, keys `k` `[batch, S, n_kv,
    head_dim]` (`n_head % n_kv == 0`) and a bool `mask`, `[T, S]` or broadcastable to
    `[batch, T, S]`, True where query t may read key s.

    `scale` defaults to `1 / sqrt(head_dim)`; `softcap` (Gemma 2), if given, bounds every
    score to `(-softcap, softcap)` as `softcap * tanh(score / softcap)` before the mask.
    `sinks` (gpt-oss), float32 `[n_head]` if given, is each query head's sink logit: one more
    column of every row's softmax, dropped after it, `softmax(concat(scores, sink))[..., :-1]`,
    so that a row's weights sum to less than 1 (and to 0 where the mask blocks every key).
    """
    batch, T, n_head, head_dim = q.shape
    n_kv = k.shape[2]
    q = q.reshape(batch, T, n_kv, n_head // n_kv, head_dim)  # [batch, T, n_kv, n_rep, head_dim]
    # Scale by 1/sqrt(d_k), d_k the per-head width: it keeps the scores' variance near 1
    # so the softmax does not saturate just because heads are wide.
    scores = jnp.einsum("btngk,bsnk->bngts", q, k, preferred_element_type=jnp.float32,
                        precision=precision_for(q.dtype))
    scores = scores * (1 / math.sqrt(head_dim) if scale is None else scale)  # [batch, n_kv, n_rep, T, S] float32
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    if mask.ndim == 2:
        mask = mask[None]  # [1, T, S]
    # Block before the softmax: a 0 score would still get weight, and zeroing weights
    # after it would leave rows that no longer sum to 1. The dtype's min (not -inf)
    # turns into an exact 0 weight and keeps a fully blocked row finite.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        weights = jax.nn.softmax(scores, axis=-1)  # [batch, n_kv, n_rep, T, S]
    else:  # query head j's sink (kv head j // n_rep, member j % n_rep) as the last column of its rows
        sink = jnp.asarray(sinks, jnp.float32).reshape(n_kv, -1)[:, :, None, None]  # [n_kv, n_rep, 1, 1]
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))  # [batch, n_kv, n_rep, T, 1]
        weights = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]  # [b, n_kv, n_rep, T, S]
    return weights.reshape(batch, n_head, T, -1)  # head j = kv head j // n_rep, member j % n_rep


def combine_values(weights: jax.Array, v: jax.Array) -> jax.Array:
    """`weights [batch, n_head, T, S] @ v [batch, S, n_kv, head_dim]` per head: `[batch, T,
    n_head, head_dim]` in `v.dtype`."""
    batch, n_head, T, S = weights.shape
    n_kv, head_dim = v.shape[2], v.shape[3]
    weights = weights.reshape(batch, n_kv, n_head // n_kv, T, S).astype(v.dtype)  # [batch, n_kv, n_rep, T, S]
    out = jnp.einsum("bngts,bsnk->btngk", weights, v, precision=precision_for(v.dtype))  # [b, T, n_kv, n_rep, hd]
    return out.reshape(batch, T, n_head, head_dim)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, **scores) -> tuple[
        jax.Array, jax.Array]:
    """Scaled dot-product attention with grouped kv heads: `(out [batch, T, n_head, head_dim],
    weights [batch, n_head, T, S])`, arguments as `attention_weights` takes them (`scores`:
    its `scale`, `softcap` and `sinks`), and `v`."""
    weights = attention_weights(q, k, mask, **scores)
    return combine_values(weights, v), weights


# A window longer than any context: a full layer's (every earlier position is in it).
FULL_WINDOW = 2 ** 30


@struct.dataclass
class Visibility:
    """Which keys each query reads, by position (`blockwise.visible`): key s is visible to
    query t iff `0 <= key[s] <= query[t]` and `key[s] > query[t] - window`.

    Attributes:
      query: int `[T]` or `[batch, T]`, each query's position.
      key: int `[S]` or `[batch, S]`, each key's position (negative: an empty slot).
      window: int32 `[]`, a sliding layer's window, `FULL_WINDOW` for a full layer (an array,
        so that one scanned body serves both types).
    """

    query: jax.Array
    key: jax.Array
    window: jax.Array

    def mask(self) -> jax.Array:
        """bool `[T, S]` or `[batch, T, S]`, True where query t reads key s."""
        return visible(self.query, self.key, self.window)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, seen: Visibility, *, kind: str = "auto",
           scale: float | None = None, softcap: float | None = None,
           sinks: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Attention of `q [batch, T, n_head, head_dim]` over `k, v [batch, S, n_kv, head_dim]`
    where `seen` says: `(out [batch, T, n_head, head_dim], weights [batch, n_head, T, S] or None)`.

    `kind` "dense" builds every score (`dot_product_attention`, and gives the weights);
    "blocks" walks key blocks with an online softmax (`in_blocks`: memory linear in T; no
    weights); "auto" is "dense" below `blockwise.BLOCKS_FROM` scores per head, else "blocks", and for a
    decoding step over a cache whose slot s holds position s (`seen.key` one `[S]` for every
    row) `decoding_step`: on a GPU or TPU a kernel that reads each row's visible slots only.
    `scale`, `softcap` and `sinks` (float32 `[n_head]` or None) as `attention_weights` takes
    them; every path computes the same softmax, its sink included.
    """
    batch, T = q.shape[:2]
    S = k.shape[1]
    scores = dict(scale=scale, softcap=softcap)
    if kind == "auto" and T == 1 and seen.key.ndim == 1:
        return decoding_step(q, k, v, jnp.broadcast_to(seen.query, (batch, 1))[:, 0], seen.window, sinks=sinks,
                             **scores), None
    if not in_blocks_for(kind, T, S):
        return dot_product_attention(q, k, v, seen.mask(), sinks=sinks, **scores)
    q_pos = jnp.broadcast_to(seen.query, (batch, T))
    k_pos = jnp.broadcast_to(seen.key, (batch, S))
    return in_blocks(q, k, v, q_pos, k_pos, seen.window, sinks=sinks, **scores), None


def in_blocks(q, k, v, q_pos, k_pos, window, *, scale=None, softcap=None, sinks=None) -> jax.Array:
    """`blockwise_attention`'s algorithm on every backend (its arguments): the Pallas kernels
    on a GPU (Triton, bfloat16) and a TPU (Mosaic), where they take the head's width and dtype, and the
    `jnp` version elsewhere (`block_paths`). The choice is made as the program is lowered for its
    platform, so a program exported for "cuda" carries the Triton kernels."""
    paths = block_paths(q.shape[-1], q.dtype, scale=scale, softcap=softcap)
    return jax.lax.platform_dependent(q, k, v, q_pos, k_pos, window, sinks, **paths)


# The dtypes each platform's kernel attends in blocks in. On a GPU, bfloat16 alone: float32 products
# at HIGHEST precision (no TF32) run on the CUDA cores, and on an H200 the Triton kernels took
# 9-16x the dense attention's time there against the `jnp` blocks' 1.3-2x; in bfloat16 0.3-0.6x
# (`benchmarks/attention_paths.py`, docs/performance.md).
KERNEL_DTYPES = {"cuda": (jnp.bfloat16,), "tpu": (jnp.float32, jnp.bfloat16)}


def block_paths(head_dim: int, dtype, *, scale=None, softcap=None) -> dict:
    """`{"cuda": f, "tpu": f, "default": f}`, each `f(q, k, v, q_pos, k_pos, window, sinks=None)`
    attending in blocks on that platform (a kernel, or the `jnp` version where the kernel does not
    take the head, or is slower in `dtype`: `KERNEL_DTYPES`)."""

    def path(attention):  # `attention(q, k, v, q_pos, k_pos, window, **options)` with this layer's scores
        def run(q, k, v, q_pos, k_pos, window, sinks=None):
            return attention(q, k, v, q_pos, k_pos, window, scale=scale, softcap=softcap, sinks=sinks)
        return run

    in_jnp = path(blockwise_attention)

    def kernel(platform, module):
        takes = module.supports(head_dim, dtype) and jnp.dtype(dtype) in KERNEL_DTYPES[platform]
        return path(module.flash_attention) if takes else in_jnp

    return {"cuda": kernel("cuda", triton_attention), "tpu": kernel("tpu", mosaic_attention), "default": in_jnp}


def decoding_step(q, k, v, q_pos, window, *, scale=None, softcap=None, sinks=None) -> jax.Array:
    """One new token per row over a cache whose slot s holds position s: `[batch, 1, n_head,
    head_dim]` from `q [batch, 1, n_head, head_dim]`, `k, v [batch, S, n_kv, head_dim]` and
    `q_pos` int `[batch]` (slots `(q_pos - window, q_pos]` visible). On a GPU or TPU, the
    ragged decoding kernel reads those slots alone; elsewhere the dense attention over all S
    (`decoding_paths`). `scale`, `softcap` and `sinks` as `attention_weights` takes them."""
    paths = decoding_paths(q.shape[-1], q.dtype, scale=scale, softcap=softcap)
    return jax.lax.platform_dependent(q, k, v, q_pos, window, sinks, **paths)


def decoding_paths(head_dim: int, dtype, *, scale=None, softcap=None) -> dict:
    """`{"cuda": f, "tpu": f, "default": f}`, each `f(q, k, v, q_pos, window, sinks=None)` a
    `decoding_step` on that platform (the kernel, or the dense attention where the kernel does not
    take the head)."""

    def dense(q, k, v, q_pos, window, sinks=None):
        seen = Visibility(q_pos[:, None], jnp.arange(k.shape[1]), window)
        return dot_product_attention(q, k, v, seen.mask(), scale=scale, softcap=softcap, sinks=sinks)[0]

    def kernel(platform):
        def run(q, k, v, q_pos, window, sinks=None):  # (the kernel takes one query per row: [batch, n_head, head_dim])
            return decode_attention(q[:, 0], k, v, q_pos, window, scale=scale, softcap=softcap, sinks=sinks,
                                    platform=platform)[:, None]
        return run if decoding_supports(head_dim, dtype, platform) else dense

    return {"cuda": kernel("triton"), "tpu": kernel("mosaic"), "default": dense}


def of_type(by_type: dict, is_sliding):
    """A layer's entry of `by_type` (`{attention type: pytree}`): the only one, or in a scan over
    both types the sliding one where the traced `is_sliding` is set, else the full one (the two
    the same shape)."""
    if len(by_type) == 1:
        (value,) = by_type.values()
        return value
    return jax.tree.map(lambda sliding, full: jnp.where(is_sliding, sliding, full), by_type["sliding"],
                        by_type["full"])


QK_NORMS = ("head", "projection")  # what a q/k norm normalises over (AttentionSpec.qk_norm_over)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The "attention" mixer kind of a decoder layer: causal softmax attention of `n_head` query
    heads over `n_kv_head` key/value heads (GQA), RoPE on q and k, a KV cache between calls.

    What a layer of this kind may change from its neighbours (Gemma's sliding layers, their
    local RoPE base) is here; what every layer shares (d_model, the norms' form, LoRA, the
    compute dtype) stays on the model's `DecoderConfig`.

    Attributes:
      n_head, n_kv_head, head_dim: query heads, key/value heads, channels per head.
      window: keys a query reads, itself included (a "sliding" layer); None: every earlier one.
      rope_theta, rope_scaling: RoPE's base and `RopeScaling` (None: none) at this layer.
      use_rope: whether q and k rotate at all; False: a NoPE layer (SmolLM3's every fourth),
        whose attention sees no position but through the causal mask.
      rope_pairing: which channels RoPE rotates together ("split_half" or "interleaved").
      qk_norm: an RMSNorm over each head's channels of q and of k, before RoPE (Qwen3, Gemma 3).
      qk_norm_over: what `qk_norm` normalises over: "head", each head's channels; or
        "projection", all of q's heads and channels at once, and of k's (OLMoE).
      qkv_bias: q, k and v carry a bias (Qwen2).
      scale: the scores' scale; None: `head_dim ** -0.5`.
      softcap: scores pass through `softcap * tanh(score / softcap)` (Gemma 2); None: not.
      sinks: a learned logit per query head joins each row's softmax and is dropped after it
        (gpt-oss's attention sinks: a row may give less than all its weight to the keys).
      o_bias: the output projection carries a bias (gpt-oss).
      output_gate: each head's output is gated, `out * sigmoid(gate)` before the output projection,
        the gate a second projection like q's: `wq` `[d_model, n_head, 2 head_dim]` gives each head
        its query's channels then its gate's (Qwen3-Next's and Qwen3.5's doubled `q_proj`).
      partial_rotary_factor: RoPE rotates each head's first `rotary_dim = int(head_dim * factor)`
        channels of q and k (split in halves among themselves) and passes the rest (Qwen3-Next: 0.25).
      v_norm: the values pass an RMSNorm without a weight over each head's channels (Gemma 4).
      k_eq_v: the values are the key projection's output, before its norm and RoPE: no `wv`
        (Gemma 4's global layers, `attention_k_eq_v`).
      kv_shared: the layer computes no keys and values: it attends over those of the last earlier
        layer of its attention type that does, as that layer read them (Gemma 4's last
        `num_kv_shared_layers` layers). It has no `wk`, `wv` or k norm, and keeps nothing in a cache.
    """

    n_head: int
    n_kv_head: int
    head_dim: int
    window: int | None
    rope_theta: float
    rope_scaling: "RopeScaling | None"  # noqa: F821 (jaxformer.config)
    rope_pairing: str = "split_half"
    qk_norm: bool = False
    qk_norm_over: str = "head"
    qkv_bias: bool = False
    scale: float | None = None
    softcap: float | None = None
    sinks: bool = False
    o_bias: bool = False
    use_rope: bool = True
    output_gate: bool = False
    partial_rotary_factor: float = 1.0
    v_norm: bool = False
    k_eq_v: bool = False
    kv_shared: bool = False

    def __post_init__(self):
        if self.qk_norm_over not in QK_NORMS:
            raise ValueError(f"AttentionSpec.qk_norm_over must be one of {QK_NORMS} (got {self.qk_norm_over!r})")
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"AttentionSpec.partial_rotary_factor must rotate an even number of channels, 2 .. "
                             f"head_dim={self.head_dim} (got {self.partial_rotary_factor}: {self.rotary_dim})")
        if self.qkv_bias and (self.k_eq_v or self.kv_shared):
            raise ValueError("AttentionSpec.qkv_bias must be False with k_eq_v or kv_shared (no checkpoint has both)")

    @property
    def rotary_dim(self) -> int:
        """The channels of each head RoPE rotates, the first ones: `int(head_dim * partial_rotary_factor)`."""
        return int(self.head_dim * self.partial_rotary_factor)

    def weights(self, d_model: int) -> dict[str, "Weight"]:
        """The matrices and biases a layer of this spec holds, by name: what `GQASelfAttention`
        declares, and what a checkpoint family's table and the sharding rules read."""
        H, K, D = self.n_head, self.n_kv_head, self.head_dim
        Q = 2 * D if self.output_gate else D  # q's channels per head, its gate's after them where it has one
        weights = {"wq": Weight((d_model, H, Q), (EMBED, HEADS, HEAD_DIM)),
                   "wk": Weight((d_model, K, D), (EMBED, KV_HEADS, HEAD_DIM)),
                   "wv": Weight((d_model, K, D), (EMBED, KV_HEADS, HEAD_DIM)),
                   "wo": Weight((H, D, d_model), (HEADS, HEAD_DIM, EMBED), inputs=2)}  # o reads heads x channels
        for name in ("wk", "wv") if self.kv_shared else ("wv",) if self.k_eq_v else ():
            del weights[name]
        if self.qkv_bias:
            weights.update(bq=Weight((H, Q), (HEADS, HEAD_DIM), inputs=0),
                           bk=Weight((K, D), (KV_HEADS, HEAD_DIM), inputs=0),
                           bv=Weight((K, D), (KV_HEADS, HEAD_DIM), inputs=0))
        if self.sinks:
            weights.update(sinks=Weight((H,), (HEADS,), inputs=0))
        if self.o_bias:
            weights.update(bo=Weight((d_model,), (EMBED,), inputs=0))
        return weights

    def build(self, config, name: str) -> "GQASelfAttention":
        """The module of a layer of this spec, named `name` in its block."""
        return GQASelfAttention(config, self, name=name)

    @property
    def attention_type(self) -> str:
        """"sliding" with a window, else "full": which slots a cache keeps for the layer (a ring, or all)."""
        return "full" if self.window is None else "sliding"

    @property
    def cache_entry(self) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """What a layer of this spec keeps per row (`jaxformer.cache.Entry`): a key and a value of
        `[n_kv_head, head_dim]` a slot, every position's or a ring's; nothing ("none") where it
        reads another layer's (`kv_shared`)."""
        if self.kv_shared:
            return "none", ((), ())
        return self.attention_type, ((self.n_kv_head, self.head_dim),) * 2

    @property
    def rotation(self) -> tuple:
        """What RoPE's angles depend on, `(channels, base, scaling, use_rope)` (`decoder.views`
        computes one RoPE for the mixers that rotate alike; a NoPE layer's is the identity)."""
        return self.rotary_dim, self.rope_theta, self.rope_scaling, self.use_rope

    def rope(self, position: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE's `cos, sin` `[..., T, rotary_dim/2]` at `position` (int `[T]` or `[batch, T]`); a NoPE
        layer's are 1 and 0, the identity rotation (`a * 1 - b * 0` is `a` exactly), so that a scanned
        body may run RoPE and NoPE layers alike, picking each layer's angles (`layers.shareable`)."""
        if not self.use_rope:
            shape = (*position.shape, self.rotary_dim // 2)
            return jnp.ones(shape, jnp.float32), jnp.zeros(shape, jnp.float32)
        return rope_cos_sin(position, rope_frequencies(position, self.rotary_dim, self.rope_theta, self.rope_scaling),
                            rope_attention_factor(self.rope_scaling))

    def view(self, position: jax.Array, key_position: jax.Array, rope=None) -> tuple[jax.Array, jax.Array, Visibility]:
        """What a layer of this spec reads in a call besides its input: RoPE's `cos, sin` at the
        query positions (`rope(position)`, or `rope` where the caller has them), and the
        `Visibility` of the keys at `key_position` (`[S]` or `[batch, S]`; negative: an empty
        slot): a query at p reads the keys at `0 .. p`, or with a window those in `(p - window, p]`."""
        cos, sin = self.rope(position) if rope is None else rope
        window = FULL_WINDOW if self.window is None else self.window
        return cos, sin, Visibility(position, key_position, jnp.int32(window))


class Part(NamedTuple):
    """One group of rows of a call, as a mixer reads it: `rows` rows of `T` tokens, their RoPE
    angles `cos, sin` `[rows, T, rotary_dim/2]` (or `[T, ...]`), `masks` `{attention type:
    Visibility}` (the types its layer may be), the model's cache for them (a `KVCache`, or None)
    and, for a layer that reads another's keys and values (`AttentionSpec.kv_shared`), those
    (`(keys, values)`, `[rows, S, n_kv, head_dim]` each, as that layer read them; else None).

    A call is one part, whose tokens are `x`'s `[batch, T]`; a serving engine's step and a
    prompt's piece in one call are two, laid out one after the other in one row of `x`, `[1,
    sum of rows * T]`: every product but attention's runs on all their tokens at once."""

    rows: int
    T: int
    cos: jax.Array
    sin: jax.Array
    masks: dict
    cache: Any
    kv: tuple | None = None

    def take(self, a: jax.Array, start: int, grouped: bool) -> jax.Array:
        """This part's tokens of `a` (`[1, N, ...]` in a grouped call: from token `start`), `[rows, T, ...]`."""
        return a[0, start:start + self.rows * self.T].reshape(self.rows, self.T, *a.shape[2:]) if grouped else a


class GQASelfAttention(nn.Module):
    """Causal self-attention of the decoder-only model: GQA with RoPE and a KV cache (a mixer of
    kind `AttentionSpec`).

    Attributes:
      config: the model's `DecoderConfig` (d_model, the norms' form, LoRA, dtypes, `attention_impl`).
      spec: this layer's `AttentionSpec` (in a scan over layers of several specs, the first: their
        parameters have one shape).
    """

    config: "DecoderConfig"  # noqa: F821 (jaxformer.config; a string to avoid a cycle)
    spec: AttentionSpec

    @nn.compact
    def __call__(self, x, parts: tuple[Part, ...], layer=None, is_sliding=None, keep_kv: bool = False):
        """Attends causally over `x` (and the cache), with GQA and RoPE.

        Args:
          x: `[batch, T, d_model]` normalised residual stream (a grouped call's `[1, N, d_model]`).
          parts: the call's `Part`s: one, or several groups of rows laid out in `x` one after
            another, each with its own angles, masks and cache. A part's S keys are T without a
            cache, and with one those its layer's view gives (the first S slots, the cache's span,
            or a ring's then this call's); a `kv_shared` layer's are its part's `kv`.
          layer: this layer's index in the caches (traced in a scan).
          is_sliding: bool `[]` in a scan over two kinds of layer, whether this one is the second: the
            sliding one where they are of two types, which picks its mask (of one type, one mask).
          keep_kv: give each part's keys and values as attended over, for the later layers that
            read them (`AttentionSpec.kv_shared`).

        Returns:
          `(y [batch, T, d_model], caches, kv)`: each part's cache with this call's K/V written into
          the layer's slots (a `kv_shared` layer's as it was), and with `keep_kv` each part's `(keys,
          values)` (else None); the weights are sown into 'intermediates' as `attention_weights`
          where they were made (dense attention: `config.attention_impl` "dense", or "auto" on
          short sequences) in an ungrouped call, unless the cache keeps the two types in two
          stacks: their shapes differ.
        """
        c, a = self.config, self.spec
        table = a.weights(c.d_model)  # this layer's parameters' shapes and axes, by name
        init = nn.initializers.normal(0.02)
        # The output projection adds into the residual stream once per block; 1/sqrt(2L)
        # keeps the stream's variance from growing with depth (GPT-2).
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))

        def weight(name, initializer=init):
            return compute_param(self, name, initializer, *table[name][:2])

        # (`project`: the einsums, plus an adapter's low-rank term where `config.lora` adds one.)
        einsums = {"wq": "btd,dhk->bthk", "wk": "btd,dnk->btnk", "wv": "btd,dnk->btnk"}
        made = project(self, x, *((name, einsums[name], weight(name)) for name in einsums if name in table))
        q, k, v = (*made, None, None)[:3]  # [batch, T, n_head, head_dim (x2 with a gate)]; k, v [batch, T, n_kv,
        # head_dim] or None
        v = k if a.k_eq_v else v  # (Gemma 4: the key projection serves as the values too, before k's norm)
        wo = weight("wo", residual_init)
        zeros = nn.initializers.zeros
        if a.qkv_bias:  # Qwen2's q/k/v biases, added before RoPE as a Linear layer adds them
            q, k, v = q + weight("bq", zeros), k + weight("bk", zeros), v + weight("bv", zeros)
        if a.output_gate:  # each head's channels: its query's, then its output gate's
            q, gate = jnp.split(q, 2, axis=-1)  # [batch, T, n_head, head_dim] each
        if a.qk_norm and a.qk_norm_over == "head":  # each head's q and k over its channels: bounded scores (Qwen3)
            q = rms_norm(c, HEAD_DIM, name="q_norm")(q)
            k = None if k is None else rms_norm(c, HEAD_DIM, name="k_norm")(k)
        elif a.qk_norm:  # OLMoE's: q over all its heads' channels at once, [batch, T, n_head * head_dim], k alike
            q = rms_norm(c, HEADS, name="q_norm")(q.reshape(*q.shape[:2], -1)).reshape(q.shape)
            k = rms_norm(c, KV_HEADS, name="k_norm")(k.reshape(*k.shape[:2], -1)).reshape(k.shape)
        if a.v_norm and v is not None:  # Gemma 4's: each head's values over its channels, no weight
            v = rms_norm(c, HEAD_DIM, name="v_norm", scaled=False)(v)
        sinks = None
        if a.sinks:  # gpt-oss's, float32 [n_head]: logits compared with the float32 scores, whatever the compute dtype
            sinks = param(self, "sinks", zeros, *table["sinks"][:2], c.param_dtype).astype(jnp.float32)
        scores = dict(scale=a.scale, softcap=a.softcap, sinks=sinks)
        grouped = len(parts) > 1
        outs, written, kept, start = [], [], [], 0
        for part in parts:  # (one, unless groups of rows share the call: each attends in its own cache)
            # Rotate q and k (never v) before caching: a cached key keeps its position.
            part_q = apply_rope(part.take(q, start, grouped), part.cos, part.sin, a.rope_pairing)

            def read(keys, values, kind=None, part_q=part_q, masks=part.masks):
                # -> (out [rows, T, n_head, head_dim], weights or None). `keys` read as a layer of `kind`
                # reads them (a cache of two stacks names the kind of each); None: this layer's own
                # type, picked by its flag in a scan over both.
                seen = masks[kind] if kind else of_type(masks, is_sliding)
                if keep_kv:
                    kept.append((keys, values))
                return attend(part_q, keys, values, seen, kind=c.attention_impl, **scores)

            cache = part.cache
            if a.kv_shared:  # another layer's keys and values, as it read them: nothing of this layer's to keep
                out, weights = read(*part.kv)
            elif cache is None:
                part_k = apply_rope(part.take(k, start, grouped), part.cos, part.sin, a.rope_pairing)
                out, weights = read(part_k, part.take(v, start, grouped))
            else:  # the layer's view writes this call's K/V and gives the keys it reads: [rows, S, n_kv, head_dim]
                # (`part.masks` has a key per type the layer may be: a view of two stacks attends in those alone)
                part_k = apply_rope(part.take(k, start, grouped), part.cos, part.sin, a.rope_pairing)
                view = cache.layer(layer, tuple(part.masks))
                (out, weights), view = view.attend(read, part_k, part.take(v, start, grouped), cache.pos, cache.stop,
                                                   cache.read_slots)
                cache = cache.with_layer(layer, view)
            if weights is not None and not grouped:  # (a cache of two stacks gives none)
                self.sow("intermediates", "attention_weights", weights)  # a no-op unless asked for (mutable)
            outs.append(out.reshape(1, -1, *out.shape[2:]) if grouped else out)
            written.append(cache)
            start += part.rows * part.T
        out = jnp.concatenate(outs, axis=1) if grouped else outs[0]  # [batch, T, n_head, head_dim]
        if a.output_gate:  # how much of each head's channels passes (Qwen3-Next)
            out = out * jax.nn.sigmoid(gate)
        (y,) = project(self, out, ("wo", "bthk,hkd->btd", wo))  # concat heads, then W_O: [batch, T, d_model]
        if a.o_bias:  # gpt-oss's o_proj bias, added as a Linear layer adds it
            y = y + weight("bo", zeros)
        return y, tuple(written), (tuple(kept) if keep_kv else None)


class MultiHeadAttention(nn.Module):
    """The 2017 multi-head attention: encoder self-attention, masked decoder self-attention,
    and cross-attention (queries from the decoder, keys and values from the encoder).

    `h` heads of width `d_model / h` cost about one full-width head, but give `h` attention
    patterns. One packed `[d_model, 3, h, d_k]` projection (torch's `in_proj_weight`) is read
    as Q, K, V split into heads.
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
        self.dropout = Dropout(c.dropout)

    def project_kv(self, memory: jax.Array) -> LayerKV:
        """Cross-attention's K/V of `memory` `[batch, S, d_model]`, projected once per source."""
        dtype = self.config.dtype
        kv = product("bsd,dchk->cbshk", memory, self.w_qkv[:, 1:].astype(dtype))
        kv = kv + self.b_qkv[1:, None, None].astype(dtype)  # [2, batch, S, n_head, head_dim]
        return LayerKV(k=kv[0], v=kv[1])

    def __call__(self, x, mask, *, memory=None, memory_kv: LayerKV | None = None,
                 layer_cache: LayerKV | None = None, pos=None, deterministic: bool = True):
        """Attends from `x` over `x` itself or the encoder's `memory`.

        Args:
          x: `[batch, T, d_model]`, the queries' input.
          mask: bool, broadcastable to `[batch, T, S]`.
          memory: `[batch, S, d_model]`, cross-attention's K/V input (or `memory_kv`, projected
            by `project_kv`); neither for self-attention.
          layer_cache: this layer's `LayerKV` (self-attention with a cache), or None.
          pos: int32 `[batch]`, each row's position for this call's first token (with `layer_cache`).
          deterministic: False applies dropout to the attention weights.

        Returns:
          `(y [batch, T, d_model], layer_cache)`, this call's K/V written; the weights are sown
          into 'intermediates' as `attention_weights`.
        """
        dtype = self.config.dtype
        if memory is None and memory_kv is None:  # self-attention: one GEMM for Q, K and V
            qkv = product("btd,dchk->cbthk", x, self.w_qkv.astype(dtype))
            q, k, v = qkv + self.b_qkv[:, None, None].astype(dtype)  # each [batch, T, n_head, head_dim]
        else:  # cross-attention: Q from the decoder, K and V from the encoder's output
            q = product("btd,dhk->bthk", x, self.w_qkv[:, 0].astype(dtype))
            q = q + self.b_qkv[0].astype(dtype)
            memory_kv = self.project_kv(memory) if memory_kv is None else memory_kv
            k, v = memory_kv.k, memory_kv.v  # [batch, S, n_head, head_dim]
        if layer_cache is not None:
            layer_cache = layer_cache.write(k, v, pos)
            k, v = layer_cache.read(mask.shape[-1])  # [batch, S, n_head, head_dim]: the slots the mask covers
        weights = attention_weights(q, k, mask)  # [batch, n_head, T, S]
        self.sow("intermediates", "attention_weights", weights)
        out = combine_values(self.dropout(weights, deterministic=deterministic), v)  # [batch, T, n_head, head_dim]
        y = product("bthk,hkd->btd", out, self.w_o.astype(dtype))  # concat heads, then W_O
        y = y + self.b_o.astype(dtype)
        return y, layer_cache
