"""The modern decoder-only Transformer (Llama-style).

    x = embed(tokens)
    for each block:  x = x + attn(rmsnorm(x))     # GQA + RoPE, causal, KV cache
                     x = x + swiglu(rmsnorm(x))
    logits = rmsnorm(x) @ embed^T                 # tied output head (or its own matrix)

Pre-norm keeps an identity path through the residual stream; no dropout, no biases.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.attention import GQASelfAttention
from jaxformer.cache import KVCache, LayerSlice
from jaxformer.config import DecoderConfig
from jaxformer.decodable import DecodingSpec
from jaxformer.embeddings import lookup, output_logits
from jaxformer.feedforward import SwiGLU
from jaxformer.memory import prefill_bytes
from jaxformer.norms import RMSNorm
from jaxformer.positions import rope_attention_factor, rope_cos_sin, rope_inv_freq
from jaxformer.sharding import AXES_COLLECTION, EMBED, LAYERS, VOCAB, param
from jaxformer.validation import check_cache_step, check_step_inputs


def norm(config: DecoderConfig, name: str) -> RMSNorm:
    """The decoder's RMSNorm over `d_model` channels, named `name`."""
    return RMSNorm(config.norm_eps, config.param_dtype, config.norm_plus_one, name=name)


class Block(nn.Module):
    """One pre-norm block, called as a scan body `(carry, *broadcast, is_sliding) -> (carry,
    None)` so the same module runs once per layer (`block_{i}`) or scanned over stacked
    parameters.

    Attributes:
      config: the model's `DecoderConfig`.
      attention_type: this layer's entry of `config.attention_types`; None in a scan, where
        the scanned `is_sliding` says it.
    """

    config: DecoderConfig
    attention_type: str | None = None

    @nn.compact
    def __call__(self, carry, views, pos, is_sliding):
        """`((x, layer_cache), None)` after the block.

        Args:
          carry: `(x [batch, T, d_model], layer_cache)`.
          views: `{attention type: (cos, sin, mask)}`, `GQASelfAttention`'s inputs for each
            type of layer (`attention_views`), the same for every block.
          pos: int32 `[batch]`, the cache rows' write positions, or None without a cache.
          is_sliding: bool `[]`, this layer's type in a scan over mixed types.
        """
        x, layer_cache = carry
        c = self.config
        if self.attention_type is not None:
            cos, sin, mask = views[self.attention_type]
        elif len(views) == 1:
            (cos, sin, mask), = views.values()
        else:  # one scanned body serves both types: its layer's flag picks the inputs
            cos, sin, mask = jax.tree.map(lambda local, full: jnp.where(is_sliding, local, full),
                                          views["sliding"], views["full"])
        h, layer_cache = GQASelfAttention(c, name="attn")(norm(c, "attn_norm")(x), cos, sin, mask, layer_cache, pos)
        if c.post_norms:  # Gemma 2's sandwich: the sublayer's output is normalised before the sum
            h = norm(c, "attn_post_norm")(h)
        x = x + h  # [batch, T, d_model]
        h = SwiGLU(c, name="mlp")(norm(c, "mlp_norm")(x))
        if c.post_norms:
            h = norm(c, "mlp_post_norm")(h)
        x = x + h  # [batch, T, d_model]
        if isinstance(layer_cache, LayerSlice):
            layer_cache = layer_cache.next_layer()
        return (x, layer_cache), None


def scanned_blocks(n_layer: int):
    """`Block` run `n_layer` times as one: parameters, their axis names and the sown
    intermediates gain a leading layer axis, each block its own init key; the cache rides
    in the carry, and each block reads its own entry of the scanned `is_sliding`."""
    return nn.scan(Block, variable_axes={"params": 0, AXES_COLLECTION: 0, "intermediates": 0},
                   split_rngs={"params": True}, in_axes=(nn.broadcast, nn.broadcast, 0), length=n_layer,
                   metadata_params={nn.PARTITION_NAME: LAYERS})


def attention_views(config: DecoderConfig, position: jax.Array, key_position: jax.Array) -> dict:
    """`{attention type: (cos, sin, mask)}` for each type among `config.attention_types`.

    Args:
      config: the model's config.
      position: int `[T]` or `[batch, T]`, each query's position.
      key_position: int `[S]`, each key slot's position.

    Returns:
      For each type, RoPE's `cos, sin` `[..., T, head_dim/2]` at the query positions (the
      sliding layers' at `local_rope_theta` if set) and the bool mask `[..., T, S]`: a full
      layer's query at p reads keys at positions `<= p`, a sliding layer's those in
      `(p - sliding_window, p]`.
    """
    c = config
    full_rope = rope_cos_sin(position, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                             rope_attention_factor(c.rope_scaling))  # [..., T, head_dim/2] each
    query, key = position[..., :, None], key_position  # [..., T, 1], [S]
    causal = key <= query  # [..., T, S]
    views = {}
    for kind in sorted(set(c.attention_types)):
        if kind == "full":
            views[kind] = (*full_rope, causal)
            continue
        rope = full_rope if c.local_rope_theta is None else rope_cos_sin(
            position, rope_inv_freq(c.head_dim, c.local_rope_theta))
        views[kind] = (*rope, causal & (key > query - c.sliding_window))
    return views


class Decoder(nn.Module):
    """Decoder-only language model: `apply({'params': p}, tokens, cache=None) -> (logits, cache)`.

    With a cache, row b's T tokens are the next T of its sequence (positions `cache.pos[b]
    ..`), so a prefill and a one-token step are the same call, and one jitted function
    serves every step (docs/architecture.md, "How data flows"). Every layer's attention weights
    are sown (`sown_attention_weights` stacks them).
    """

    config: DecoderConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, cache: KVCache | None = None):
        """The logits of `tokens`, after the cached ones where a cache is given.

        Args:
          tokens: int `[batch, T]`, ids in `[0, vocab_size)`.
          cache: a `KVCache` from `KVCache.create(config, batch)`, or None.

        Returns:
          `(logits [batch, T, vocab_size] in config.dtype, cache)`, the cache None if none was given.

        Raises:
          ValueError: bad `tokens` (under `jit` too), positions past `max_seq_len` or a row's cache.
        """
        c = self.config
        check_step_inputs(tokens, vocab_size=c.vocab_size, max_seq_len=c.max_seq_len)
        if cache is not None:
            check_cache_step(tokens, cache, (c.n_layer, c.n_kv_head, c.head_dim, c.scan_layers))
        T = tokens.shape[1]
        S = T if cache is None else cache.capacity

        init = nn.initializers.normal(0.02)
        embed = param(self, "embed", init, (c.vocab_size, c.d_model), (VOCAB, EMBED), c.param_dtype)
        x = lookup(embed, tokens).astype(c.dtype)  # [batch, T, d_model]
        if c.embed_scale:  # Gemma: embeddings of std ~1/sqrt(d) brought to the stream's scale, in its dtype
            x = x * jnp.asarray(math.sqrt(c.d_model), c.dtype)

        if cache is None:
            pos = None
            views = attention_views(c, jnp.arange(T), jnp.arange(S))  # cos, sin [T, head_dim/2]; mask [T, S]
        else:
            # Row b's query t sits at position pos[b] + t, its slot in the cache; the mask is
            # not square, (T, S): slots past a query are the future, unwritten, or padding.
            pos = cache.pos  # [batch]
            views = attention_views(c, pos[:, None] + jnp.arange(T)[None, :], jnp.arange(S))  # [batch, T, ...]

        is_sliding = jnp.asarray([kind == "sliding" for kind in c.attention_types])  # [n_layer]
        if c.scan_layers:
            stack = None if cache is None else LayerSlice(cache.layers, jnp.zeros((), jnp.int32))
            (x, stack), _ = scanned_blocks(c.n_layer)(c, name="blocks")((x, stack), views, pos, is_sliding)
            new_layers = None if cache is None else stack.stack
        else:
            new_layers = []
            for i, kind in enumerate(c.attention_types):
                (x, layer_cache), _ = Block(c, kind, name=f"block_{i}")(
                    (x, None if cache is None else cache.layers[i]), views, pos, is_sliding[i])
                new_layers.append(layer_cache)
        x = norm(c, "final_norm")(x)

        head = embed if c.tie_embeddings else param(self, "lm_head", init, (c.d_model, c.vocab_size),
                                                    (EMBED, VOCAB), c.param_dtype)
        logits = output_logits(x, head, c.tie_embeddings)  # [batch, T, vocab]
        if c.final_logit_softcap is not None:  # Gemma 2: every logit within (-cap, cap)
            logits = jnp.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
        if cache is None:
            return logits, None
        return cache.commit(new_layers, logits, T)

    # The decoding protocol (`jaxformer.decodable.Decodable`): the model continues its prompt.

    @nn.nowrap
    def init_inputs(self) -> tuple[jax.Array]:
        """The smallest input `init` accepts (the parameters depend on the config alone)."""
        return (jnp.zeros((1, 1), jnp.int32),)

    @nn.nowrap
    def decoding_spec(self) -> DecodingSpec:
        c = self.config
        return DecodingSpec(prompt_vocab_size=c.vocab_size, vocab_size=c.vocab_size, max_seq_len=c.max_seq_len,
                            pad_id=0, ragged_prompts=True, supports_speculative=True,
                            prefill_bytes=functools.partial(prefill_bytes, c))

    @nn.nowrap
    def decoder_prompt(self, prompt: np.ndarray, bos_id: int | None) -> np.ndarray:
        return prompt

    @nn.nowrap
    def init_cache(self, batch_size: int, capacity: int | None = None) -> KVCache:
        return KVCache.create(self.config, batch_size, capacity)

    def decode_context(self, prompt: jax.Array) -> None:
        return None  # every step reads the cache alone

    def decode_step(self, tokens: jax.Array, cache: KVCache, context: None):
        return self(tokens, cache)


def sown_attention_weights(intermediates, config: DecoderConfig) -> jax.Array:
    """`[n_layer, batch, n_head, T, S]` float32: the attention weights a `Decoder` of `config`
    sowed, from `apply(..., mutable=['intermediates'])`'s second output."""
    sown = intermediates["intermediates"]
    if config.scan_layers:
        return sown["blocks"]["attn"]["attention_weights"][0]
    return jnp.stack([sown[f"block_{i}"]["attn"]["attention_weights"][0] for i in range(config.n_layer)])
