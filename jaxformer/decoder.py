"""The modern decoder-only Transformer (Llama-style).

    x = embed(tokens)
    for each block:  x = x + attn(rmsnorm(x))     # GQA + RoPE, causal, KV cache
                     x = x + swiglu(rmsnorm(x))
    logits = rmsnorm(x) @ embed^T                 # tied output head (or its own matrix)

Pre-norm keeps an identity path through the residual stream; no dropout, no biases.
"""

from __future__ import annotations

import functools

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


class Block(nn.Module):
    """One pre-norm block, called as a scan body `(carry, *broadcast) -> (carry, None)` so the
    same module runs once per layer (`block_{i}`) or scanned over stacked parameters."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, carry, cos, sin, mask, pos):
        """`((x, layer_cache), None)` after the block, from `carry = (x [batch, T, d_model],
        layer_cache)` and `GQASelfAttention`'s `cos, sin, mask, pos`, the same for every block."""
        x, layer_cache = carry
        c = self.config
        h, layer_cache = GQASelfAttention(c, name="attn")(
            RMSNorm(c.norm_eps, c.param_dtype, name="attn_norm")(x), cos, sin, mask, layer_cache, pos)
        x = x + h  # [batch, T, d_model]
        x = x + SwiGLU(c, name="mlp")(RMSNorm(c.norm_eps, c.param_dtype, name="mlp_norm")(x))
        if isinstance(layer_cache, LayerSlice):
            layer_cache = layer_cache.next_layer()
        return (x, layer_cache), None


def scanned_blocks(n_layer: int):
    """`Block` run `n_layer` times as one: parameters, their axis names and the sown
    intermediates gain a leading layer axis, each block its own init key; the cache rides
    in the carry."""
    return nn.scan(Block, variable_axes={"params": 0, AXES_COLLECTION: 0, "intermediates": 0},
                   split_rngs={"params": True},
                   in_axes=(nn.broadcast,) * 4, length=n_layer, metadata_params={nn.PARTITION_NAME: LAYERS})


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

        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)  # [head_dim/2], a few constants
        scale = rope_attention_factor(c.rope_scaling)
        if cache is None:
            pos = None
            cos, sin = rope_cos_sin(jnp.arange(T), inv_freq, scale)  # [T, head_dim/2]
            mask = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]  # [T, S], causal
        else:
            # Row b's query t sits at position pos[b] + t, its slot in the cache.
            pos = cache.pos  # [batch]
            position = pos[:, None] + jnp.arange(T)[None, :]  # [batch, T]
            cos, sin = rope_cos_sin(position, inv_freq, scale)  # [batch, T, head_dim/2]
            # Query t of row b reads slots 0 .. pos[b] + t: causal over the cache; slots past
            # it are the future, not yet written, or a shorter prompt's padding. Not square: (T, S).
            mask = jnp.arange(S)[None, None, :] <= position[:, :, None]  # [batch, T, S]

        if c.scan_layers:
            stack = None if cache is None else LayerSlice(cache.layers, jnp.zeros((), jnp.int32))
            (x, stack), _ = scanned_blocks(c.n_layer)(c, name="blocks")((x, stack), cos, sin, mask, pos)
            new_layers = None if cache is None else stack.stack
        else:
            new_layers = []
            for i in range(c.n_layer):
                (x, layer_cache), _ = Block(c, name=f"block_{i}")(
                    (x, None if cache is None else cache.layers[i]), cos, sin, mask, pos)
                new_layers.append(layer_cache)
        x = RMSNorm(c.norm_eps, c.param_dtype, name="final_norm")(x)

        head = embed if c.tie_embeddings else param(self, "lm_head", init, (c.d_model, c.vocab_size),
                                                    (EMBED, VOCAB), c.param_dtype)
        logits = output_logits(x, head, c.tie_embeddings)  # [batch, T, vocab]
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
