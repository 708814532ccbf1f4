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

from jaxformer.attention import FULL_WINDOW, GQASelfAttention, Visibility, of_type
from jaxformer.cache import KVCache, check_longrope_capacity, ring_positions
from jaxformer.config import DecoderConfig
from jaxformer.decodable import DecodingSpec
from jaxformer.embeddings import OutputHead, lookup
from jaxformer.feedforward import SwiGLU
from jaxformer.memory import prefill_bytes
from jaxformer.norms import RMSNorm
from jaxformer.positions import rope_attention_factor, rope_cos_sin, rope_frequencies, rope_inv_freq
from jaxformer.sharding import AXES_COLLECTION, EMBED, LAYERS, VOCAB, param
from jaxformer.validation import check_cache_step, check_step_inputs


def norm(config: DecoderConfig, name: str) -> RMSNorm:
    """The decoder's RMSNorm over `d_model` channels, named `name`."""
    return RMSNorm(config.norm_eps, config.param_dtype, config.norm_plus_one, name=name)


class Block(nn.Module):
    """One pre-norm block, called as a scan body `(carry, *broadcast, scanned) -> (carry,
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
    def __call__(self, carry, views, layer):
        """`((x, cache), None)` after the block.

        Args:
          carry: `(x [batch, T, d_model], cache)`, the cache the model's `KVCache` (None without
            one), which the block writes its layer of.
          views: `{attention type: (cos, sin, seen)}`, `GQASelfAttention`'s inputs for each
            type of layer (`attention_views`), the same for every block.
          layer: `(is_sliding, index)`: in a scan over both types bool `[]` this layer's type
            (else None), and its index in the model (int32 `[]` in a scan).
        """
        x, cache = carry
        c = self.config
        is_sliding, index = layer

        def angles_and_masks(views: dict):
            if self.attention_type is not None:
                views = {self.attention_type: views[self.attention_type]}
            # One scanned body serves both types: its layer's flag picks the angles (and the attention, the mask).
            return (*of_type({kind: view[:2] for kind, view in views.items()}, is_sliding),
                    {kind: view[2] for kind, view in views.items()})

        # (Groups of rows in one call, `Decoder`'s tuple of tokens: each group its own angles and masks.)
        cos, sin, masks = (zip(*map(angles_and_masks, views)) if isinstance(views, tuple)
                           else angles_and_masks(views))
        h, cache = GQASelfAttention(c, name="attn")(norm(c, "attn_norm")(x), cos, sin, masks, cache, index, is_sliding)
        if c.post_norms:  # Gemma 2's sandwich: the sublayer's output is normalised before the sum
            h = norm(c, "attn_post_norm")(h)
        x = x + h  # [batch, T, d_model]
        h = SwiGLU(c, name="mlp")(norm(c, "mlp_norm")(x))
        if c.post_norms:
            h = norm(c, "mlp_post_norm")(h)
        x = x + h  # [batch, T, d_model]
        return (x, cache), None


# `DecoderConfig.remat_policy` -> what a rematerialised block keeps for the backward pass.
REMAT_POLICIES = {"dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "dots": jax.checkpoint_policies.dots_saveable,
                  "nothing": jax.checkpoint_policies.nothing_saveable}


def block_type(config: DecoderConfig) -> type[nn.Module]:
    """`Block`, or with `config.remat` a `Block` whose activations the backward pass
    recomputes from its input rather than keeps, but for those `config.remat_policy` saves."""
    return nn.remat(Block, policy=REMAT_POLICIES[config.remat_policy]) if config.remat else Block


def scanned_blocks(config: DecoderConfig):
    """`Block` run `n_layer` times as one: parameters, their axis names and the sown
    intermediates gain a leading layer axis, each block its own init key; the cache rides
    in the carry, and each block reads its own `(is_sliding, index)`."""
    return nn.scan(block_type(config), variable_axes={"params": 0, AXES_COLLECTION: 0, "intermediates": 0},
                   split_rngs={"params": True}, in_axes=(nn.broadcast, 0),
                   length=config.n_layer, metadata_params={nn.PARTITION_NAME: LAYERS})


def attention_views(config: DecoderConfig, position: jax.Array, key_positions: dict) -> dict:
    """`{attention type: (cos, sin, seen)}` for each type among `config.attention_types`.

    Args:
      config: the model's config.
      position: int `[T]` or `[batch, T]`, each query's position.
      key_positions: `{attention type: int [S] or [batch, S]}`, the position of each key a
        layer of that type reads (negative: an empty slot).

    Returns:
      For each type, RoPE's `cos, sin` `[..., T, head_dim/2]` at the query positions (the
      sliding layers' at `local_rope_theta` if set) and the `Visibility` (its mask `[..., T,
      S]`): a full layer's query at p reads keys at positions `0 .. p`, a sliding layer's
      those in `(p - sliding_window, p]`.
    """
    c = config
    full_rope = rope_cos_sin(position, rope_frequencies(position, c.head_dim, c.rope_theta, c.rope_scaling),
                             rope_attention_factor(c.rope_scaling))  # [..., T, head_dim/2] each
    views = {}
    for kind in sorted(set(c.attention_types)):
        if kind == "full":
            views[kind] = (*full_rope, Visibility(position, key_positions[kind], jnp.int32(FULL_WINDOW)))
            continue
        rope = full_rope if c.local_rope_theta is None else rope_cos_sin(
            position, rope_inv_freq(c.head_dim, c.local_rope_theta))
        views[kind] = (*rope, Visibility(position, key_positions[kind], jnp.int32(c.sliding_window)))
    return views


def cached_views(config: DecoderConfig, T: int, cache: KVCache, slots: tuple[int, ...]) -> dict:
    """`attention_views` of a call of T tokens per row after what `cache` holds (each layer's
    `slots`). Row b's query t sits at position pos[b] + t. A full layer's slot s holds position
    s (later slots: the future, unwritten, or padding), and only its first `read_slots` are
    read (every row's positions lie below: `KVCache.span`); a ring's, what `ring_positions`
    says, followed by this call's own keys."""
    pos = cache.pos  # [batch]
    position = pos[:, None] + jnp.arange(T)[None, :]  # [batch, T]
    keys = {}
    for kind, n_slots in zip(config.attention_types, slots):
        if n_slots < cache.capacity:
            keys[kind] = jnp.concatenate([ring_positions(pos, n_slots), position], axis=1)  # [batch, R+T]
        else:
            keys[kind] = jnp.arange(cache.read_slots)  # [S]: the mask's width is the slots read
    return attention_views(config, position, keys)  # [batch, T, ...]


def cache_slots(config: DecoderConfig, cache: KVCache) -> tuple[int, ...]:
    """The slots each layer of `config` keeps in `cache`: the capacity, or for a sliding layer
    the cache's ring size if it has rings (a `ValueError` if that is shorter than the window,
    or if the cache is longer than a LongRoPE model's trained context)."""
    check_longrope_capacity(config, cache.capacity, "cache")
    rings = cache.ring_slots
    ring = rings[0] if rings else cache.capacity  # (rings of two sizes fail the layout check after)
    if rings and "sliding" in config.attention_types and ring < config.sliding_window - 1:
        raise ValueError(f"cache: its rings of {ring} slots are shorter than sliding_window - 1 = "
                         f"{config.sliding_window - 1}; make it with KVCache.create(config, ...)")
    return tuple(cache.capacity if kind == "full" else ring for kind in config.attention_types)


class Decoder(nn.Module):
    """Decoder-only language model: `apply({'params': p}, tokens, cache=None) -> (logits, cache)`.

    For a loss that never holds the whole `[batch, T, vocab]` logits, `apply(..., hidden=True)`
    gives the final normalised stream instead, and `output_head(params)` what turns it into
    logits (`jaxformer.losses.chunked_cross_entropy` takes both).

    With a cache, row b's T tokens are the next T of its sequence (positions `cache.pos[b]
    ..`), so a prefill and a one-token step are the same call, and one jitted function
    serves every step (docs/architecture.md, "How data flows"). Every layer's attention weights
    are sown (`sown_attention_weights` stacks them).
    """

    config: DecoderConfig

    @nn.compact
    def __call__(self, tokens: jax.Array | tuple, cache: KVCache | tuple | None = None, hidden: bool = False):
        """The logits of `tokens`, after the cached ones where a cache is given.

        Args:
          tokens: int `[batch, T]`, ids in `[0, vocab_size)`; or a tuple of such groups, each
            with its own cache (`cache` a tuple too): several calls in one, whose layers but
            attention run on all their tokens at once (a serving engine's one-token step of
            its batch and a prompt's next piece: one read of the weights, and the piece's
            larger matrix products carry the step's).
          cache: a `KVCache` from `KVCache.create(config, batch)`, or None.
          hidden: give the final normalised stream `[batch, T, d_model]` in place of the
            logits; `output_head(params).logits` of it are the logits.

        Returns:
          `(logits [batch, T, vocab_size] in config.dtype, cache)`, the cache None if none was given;
          with `hidden`, `[batch, T, d_model]` in place of the logits. For groups, a tuple of
          each (logits, cache) instead.

        Raises:
          ValueError: bad `tokens` (under `jit` too), positions past `max_seq_len` or a row's cache.
        """
        c = self.config
        grouped = isinstance(tokens, tuple)
        if grouped and (not isinstance(cache, tuple) or len(cache) != len(tokens) or None in cache or hidden):
            raise ValueError("groups of tokens (a tuple) go with a tuple of as many caches, and give logits")
        groups, caches = (tokens, cache) if grouped else ((tokens,), (cache,))
        slots = []
        for group, group_cache in zip(groups, caches):
            check_step_inputs(group, vocab_size=c.vocab_size, max_seq_len=c.max_seq_len)
            if group_cache is not None:
                slots.append(cache_slots(c, group_cache))
                want = group_cache.layout_shapes(group.shape[0], slots[-1], c.n_kv_head, c.head_dim, c.scan_layers)
                check_cache_step(group, group_cache, want, c.scan_layers)

        init = nn.initializers.normal(0.02)
        embed = param(self, "embed", init, (c.vocab_size, c.d_model), (VOCAB, EMBED), c.param_dtype)
        # [batch, T, d_model]; groups flattened into one row of all their tokens, [1, sum of batch * T, d_model]
        x = jnp.concatenate([lookup(embed, group).reshape(1, -1, c.d_model) for group in groups], axis=1) \
            if grouped else lookup(embed, tokens)
        x = x.astype(c.dtype)
        if c.embed_scale:  # Gemma: embeddings of std ~1/sqrt(d) brought to the stream's scale, in its dtype
            x = x * jnp.asarray(math.sqrt(c.d_model), c.dtype)

        if cache is None:
            T = tokens.shape[1]
            keys = {kind: jnp.arange(T) for kind in c.attention_types}  # [T]
            views = attention_views(c, jnp.arange(T), keys)  # cos, sin [T, head_dim/2]; keys seen [T, T]
        else:
            views = tuple(cached_views(c, group.shape[1], *rest) for group, *rest in zip(groups, caches, slots))
            views = views if grouped else views[0]

        if c.scan_layers:
            sliding = jnp.asarray([kind == "sliding" for kind in c.attention_types])  # [n_layer]
            layer = (sliding if len(set(c.attention_types)) > 1 else None, jnp.arange(c.n_layer))
            (x, written), _ = scanned_blocks(c)(c, name="blocks")((x, cache), views, layer)
        else:
            written = cache
            for i, kind in enumerate(c.attention_types):
                (x, written), _ = block_type(c)(c, kind, name=f"block_{i}")((x, written), views, (None, i))
        x = norm(c, "final_norm")(x)
        weight = embed if c.tie_embeddings else param(self, "lm_head", init, (c.d_model, c.vocab_size),
                                                      (EMBED, VOCAB), c.param_dtype)
        head = OutputHead(weight, c.tie_embeddings, c.final_logit_softcap)
        if grouped:  # each group's logits, from its tokens' places in the one row
            logits = head.logits(x)[0]  # [sum of batch * T, vocab]
            parts = jnp.split(logits, np.cumsum([group.size for group in groups])[:-1])
            return tuple(zip(*(group_cache.commit(view.layers, part.reshape(*group.shape, -1), group.shape[1])
                               for group, group_cache, view, part in zip(groups, caches, written, parts))))
        # The head's parameter exists whatever is returned: `hidden` changes the output, never the tree.
        # [batch, T, vocab] logits, or with `hidden` the stream [batch, T, d_model] they are made from
        out = x if hidden else head.logits(x)
        if cache is None:
            return out, None
        return cache.commit(written.layers, out, tokens.shape[1])

    @nn.nowrap
    def output_head(self, params) -> OutputHead:
        """The output head in `params` (the model's `{"params": ...}` tree, scanned or not): the
        embedding if tied, else `lm_head`, with the config's softcap. LoRA never adapts it, so
        an adapted model's head is its base's."""
        c = self.config
        return OutputHead(params["embed"] if c.tie_embeddings else params["lm_head"], c.tie_embeddings,
                          c.final_logit_softcap)

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
    def init_cache(self, batch_size: int, capacity: int | None = None, rewind: int = 0) -> KVCache:
        return KVCache.create(self.config, batch_size, capacity, rewind=rewind)

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
