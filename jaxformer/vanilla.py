"""The 2017 encoder-decoder Transformer, faithful to "Attention Is All You Need".

    memory = encoder(dropout(embed(src) * sqrt(d) + PE))          # N x [self-attn, FFN]
    y      = decoder(dropout(embed(tgt_in) * sqrt(d) + PE), memory)  # N x [masked self-attn,
                                                                  #      cross-attn, FFN]
    logits = y @ embed^T + b                                      # tied with both embeddings

Every sublayer is wrapped post-norm, `LayerNorm(x + Dropout(Sublayer(x)))`: the norm sits
on the residual path itself, which is why the paper needs its warmup schedule
(`jaxformer.schedules.noam_schedule`). `norm_first=True` gives the pre-norm variant.

Masks are True where a query may read a key (PyTorch's nn.Transformer uses True = blocked):
  source padding:  keys that are `pad_id` in `src` (encoder self-attn and cross-attn);
  target:          causal AND keys that are not `pad_id` in `tgt_in`.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.attention import MultiHeadAttention
from jaxformer.cache import KVCache, LayerKV, attention_entry
from jaxformer.config import VanillaConfig
from jaxformer.decodable import DecodingSpec
from jaxformer.dropout import Dropout
from jaxformer.embeddings import lookup, output_logits
from jaxformer.feedforward import FeedForward
from jaxformer.norms import LayerNorm
from jaxformer.positions import sinusoidal_table
from jaxformer.sharding import EMBED, VOCAB, param
from jaxformer.validation import check_cache_step, check_step_inputs, check_token_layout


class Residual(nn.Module):
    """The sublayer connection, post-norm or (`norm_first`) pre-norm `x + Dropout(Sublayer(LayerNorm(x)))`.

    Use: `y = residual(x, sublayer(residual.sublayer_input(x)))`.
    """

    config: VanillaConfig

    def setup(self):
        self.norm = LayerNorm(self.config.norm_eps, self.config.param_dtype)
        self.dropout = Dropout(self.config.dropout)

    def sublayer_input(self, x: jax.Array) -> jax.Array:
        return self.norm(x) if self.config.norm_first else x

    def __call__(self, x: jax.Array, sublayer_out: jax.Array, deterministic: bool = True) -> jax.Array:
        x = x + self.dropout(sublayer_out, deterministic=deterministic)
        return x if self.config.norm_first else self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention over the whole source, then the FFN."""

    config: VanillaConfig

    def setup(self):
        self.self_attn = MultiHeadAttention(self.config)
        self.attn_residual = Residual(self.config)
        self.ffn = FeedForward(self.config)
        self.ffn_residual = Residual(self.config)

    def __call__(self, x, src_mask, deterministic: bool = True):
        h, _ = self.self_attn(self.attn_residual.sublayer_input(x), src_mask, deterministic=deterministic)
        x = self.attn_residual(x, h, deterministic)  # [batch, S, d_model]
        return self.ffn_residual(x, self.ffn(self.ffn_residual.sublayer_input(x), deterministic), deterministic)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention into the memory, then the FFN."""

    config: VanillaConfig

    def setup(self):
        self.self_attn = MultiHeadAttention(self.config)
        self.self_residual = Residual(self.config)
        self.cross_attn = MultiHeadAttention(self.config)
        self.cross_residual = Residual(self.config)
        self.ffn = FeedForward(self.config)
        self.ffn_residual = Residual(self.config)

    def cross_kv(self, memory: jax.Array) -> LayerKV:
        return self.cross_attn.project_kv(memory)

    def __call__(self, y, tgt_mask, src_mask, *, memory=None, memory_kv=None, layer_cache=None, pos=None,
                 deterministic: bool = True):
        h, layer_cache = self.self_attn(self.self_residual.sublayer_input(y), tgt_mask, layer_cache=layer_cache,
                                        pos=pos, deterministic=deterministic)
        y = self.self_residual(y, h, deterministic)  # [batch, T, d_model]
        # The key line: queries from the decoder, keys and values from the encoder.
        h, _ = self.cross_attn(self.cross_residual.sublayer_input(y), src_mask, memory=memory, memory_kv=memory_kv,
                               deterministic=deterministic)
        y = self.cross_residual(y, h, deterministic)
        y = self.ffn_residual(y, self.ffn(self.ffn_residual.sublayer_input(y), deterministic), deterministic)
        return y, layer_cache


class VanillaTransformer(nn.Module):
    """The encoder-decoder: `__call__(src, tgt_in) -> logits` for teacher forcing; `encode` and
    `decode` for inference. Dropout needs `deterministic=False` and `rngs={'dropout': key}`;
    attention weights are sown per layer (`mutable=['intermediates']`)."""

    config: VanillaConfig

    def setup(self):
        c = self.config
        init = nn.initializers.xavier_uniform()  # every matrix, as the PyTorch original initialises them
        table = (VOCAB, EMBED)
        if c.tie_embeddings:  # section 3.4: one matrix for both embeddings and the output
            self.src_embed = self.tgt_embed = param(self, "embed", init, (c.src_vocab_size, c.d_model), table,
                                                    c.param_dtype)
            self.head = self.tgt_embed
        else:
            self.src_embed = param(self, "src_embed", init, (c.src_vocab_size, c.d_model), table, c.param_dtype)
            self.tgt_embed = param(self, "tgt_embed", init, (c.tgt_vocab_size, c.d_model), table, c.param_dtype)
            self.head = param(self, "out_proj", init, (c.d_model, c.tgt_vocab_size), (EMBED, VOCAB), c.param_dtype)
        self.out_bias = param(self, "out_bias", nn.initializers.zeros, (c.tgt_vocab_size,), (VOCAB,), c.param_dtype)
        self.encoder_layers = [EncoderLayer(c, name=f"encoder_layers_{i}") for i in range(c.n_layer)]
        self.decoder_layers = [DecoderLayer(c, name=f"decoder_layers_{i}") for i in range(c.n_layer)]
        self.embed_dropout = Dropout(c.dropout)
        if c.has_final_norm:  # pre-norm leaves the residual stream unnormalised: norm it once at the end
            self.encoder_norm = LayerNorm(c.norm_eps, c.param_dtype)
            self.decoder_norm = LayerNorm(c.norm_eps, c.param_dtype)

    def embed(self, table: jax.Array, tokens: jax.Array, positions: jax.Array, deterministic: bool = True) -> jax.Array:
        """`Dropout(embedding * sqrt(d_model) + PE)` for `tokens` `[batch, T]` at `positions` (`[T]`
        or `[batch, T]`). The scale lifts the xavier-initialised embeddings (entries about
        1/sqrt(d)) to the sinusoid's amplitude of 1, so positions do not drown tokens."""
        c = self.config
        pe = jnp.take(sinusoidal_table(c.max_seq_len, c.d_model), positions, axis=0)  # [(batch,) T, d_model]
        x = lookup(table, tokens).astype(c.dtype) * math.sqrt(c.d_model) + pe.astype(c.dtype)  # [batch, T, d_model]
        return self.embed_dropout(x, deterministic=deterministic)

    def source_mask(self, src: jax.Array) -> jax.Array:
        """`[batch, 1, S]`, True at real (non-pad) source tokens: the keys every query may read."""
        return (src != self.config.pad_id)[:, None, :]

    def encode(self, src: jax.Array, deterministic: bool = True) -> jax.Array:
        """The memory `[batch, S, d_model]` of `src`, int `[batch, S]` right-padded with `pad_id`.

        Raises:
          ValueError: `src` not a `[batch, S]` int array (under `jit` too), ids outside the
            source vocabulary, or longer than `max_seq_len`.
        """
        c = self.config
        check_step_inputs(src, vocab_size=c.src_vocab_size, max_seq_len=c.max_seq_len, name="src")
        src_mask = self.source_mask(src)
        x = self.embed(self.src_embed, src, jnp.arange(src.shape[1]), deterministic)  # [batch, S, d_model]
        for layer in self.encoder_layers:
            x = layer(x, src_mask, deterministic)
        return self.encoder_norm(x) if c.has_final_norm else x

    def cross_kv(self, memory: jax.Array) -> tuple[LayerKV, ...]:
        """Every decoder layer's cross-attention K/V of `memory`, computed once per source."""
        return tuple(layer.cross_kv(memory) for layer in self.decoder_layers)

    def decode(self, tgt_in: jax.Array, memory, src: jax.Array, *, cache: KVCache | None = None,
               memory_kv: tuple[LayerKV, ...] | None = None, deterministic: bool = True):
        """The decoder's logits of `tgt_in` over the encoded source.

        Args:
          tgt_in: int `[batch, T]` decoder input (BOS then the target, shifted right).
          memory: `[batch, S, d_model]` from `encode`, or None with `memory_kv` (`cross_kv(memory)`).
          src: int `[batch, S]` source ids (for its padding mask).
          cache: the decoder self-attention `KVCache` (`init_cache(batch)`), or None.
          deterministic: False applies dropout.

        Returns:
          `(logits [batch, T, tgt_vocab_size], cache)`, as `Decoder` (and raising as it does).
        """
        c = self.config
        check_step_inputs(tgt_in, vocab_size=c.tgt_vocab_size, max_seq_len=c.max_seq_len, name="tgt_in")
        if cache is not None:
            want = cache.layout_shapes(tgt_in.shape[0], (attention_entry("full", c.n_head, c.head_dim),) * c.n_layer,
                                       (cache.capacity,) * c.n_layer, stacked=False)
            check_cache_step(tgt_in, cache, want, stacked=False, name="tgt_in")
        check_token_layout(src, "src")  # only its padding is read here: encode checked its ids
        T = tgt_in.shape[1]
        src_mask = self.source_mask(src)  # [batch, 1, S]
        if cache is None:  # teacher forcing: causal AND not padding
            pos, positions = None, jnp.arange(T)  # [T]
            tgt_mask = jnp.tril(jnp.ones((T, T), bool))[None] & (tgt_in != c.pad_id)[:, None, :]  # [batch, T, T]
        else:  # row b's query t at position pos[b] + t reads cache slots 0 .. pos[b] + t, of the span's
            pos = cache.pos  # [batch]
            positions = pos[:, None] + jnp.arange(T)[None, :]  # [batch, T]
            tgt_mask = jnp.arange(cache.read_slots)[None, None, :] <= positions[:, :, None]  # [batch, T, span]
        y = self.embed(self.tgt_embed, tgt_in, positions, deterministic)  # [batch, T, d_model]
        new_layers = []
        for i, layer in enumerate(self.decoder_layers):
            y, layer_cache = layer(y, tgt_mask, src_mask, memory=memory,
                                   memory_kv=None if memory_kv is None else memory_kv[i],
                                   layer_cache=None if cache is None else cache.layers[i], pos=pos,
                                   deterministic=deterministic)
            new_layers.append(layer_cache)
        if c.has_final_norm:
            y = self.decoder_norm(y)
        logits = output_logits(y, self.head, c.tie_embeddings) + self.out_bias.astype(c.dtype)  # [batch, T, tgt_vocab]
        if cache is None:
            return logits, None
        return cache.commit(new_layers, logits, T)

    def __call__(self, src: jax.Array, tgt_in: jax.Array, deterministic: bool = True) -> jax.Array:
        """Teacher-forced logits `[batch, T, tgt_vocab_size]` for `tgt_in` given `src`."""
        memory = self.encode(src, deterministic)
        return self.decode(tgt_in, memory, src, deterministic=deterministic)[0]

    # The decoding protocol (`jaxformer.decodable.Decodable`): the prompt is the source,
    # encoded once; the decoder starts from BOS.

    @nn.nowrap
    def init_inputs(self) -> tuple[jax.Array, jax.Array]:
        """The smallest `(src, tgt_in)` `init` accepts."""
        return jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32)

    @nn.nowrap
    def decoding_spec(self) -> DecodingSpec:
        c = self.config
        return DecodingSpec(prompt_vocab_size=c.src_vocab_size, vocab_size=c.tgt_vocab_size,
                            max_seq_len=c.max_seq_len, pad_id=c.pad_id, ragged_prompts=False)

    @nn.nowrap
    def decoder_prompt(self, prompt: np.ndarray, bos_id: int | None) -> np.ndarray:
        if bos_id is None:
            raise ValueError("bos_id is required for an encoder-decoder: the decoder's first token")
        return np.full((prompt.shape[0], 1), bos_id, np.int32)

    @nn.nowrap
    def init_cache(self, batch_size: int, capacity: int | None = None, rewind: int = 0) -> KVCache:
        """An empty cache for the decoder's self-attention (every head its own K and V; no
        rings, so any `rewind` fits)."""
        c = self.config
        return KVCache.zeros(batch_size, capacity, n_layer=c.n_layer, n_kv_head=c.n_head, head_dim=c.head_dim,
                             max_seq_len=c.max_seq_len, dtype=c.cache_storage_dtype)

    def decode_context(self, src: jax.Array) -> tuple[tuple[LayerKV, ...], jax.Array]:
        """The cross-attention K/V of the encoded source, and the source (for its padding mask)."""
        return self.cross_kv(self.encode(src)), src

    def decode_step(self, tokens: jax.Array, cache: KVCache, context):
        memory_kv, src = context
        return self.decode(tokens, None, src, cache=cache, memory_kv=memory_kv)

    def decode_last(self, tokens: jax.Array, cache: KVCache, context, last: jax.Array):
        logits, cache = self.decode_step(tokens, cache, context)
        return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], cache
