"""The modern decoder-only Transformer (Llama-style).

    x = embed(tokens)
    for each layer:  x = x + attn(rmsnorm(x))     # the mixer: GQA + RoPE, causal, KV cache
                     x = x + swiglu(rmsnorm(x))   # the feed-forward
    logits = rmsnorm(x) @ embed^T                 # tied output head (or its own matrix)

Each layer is built from its `LayerSpec` (`jaxformer.layers`: a mixer, a feed-forward and a
norm placement, each of a kind). Pre-norm keeps an identity path through the residual
stream; no dropout, no biases.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.cache import Entry, KVCache, check_longrope_capacity, ring_positions
from jaxformer.config import DecoderConfig
from jaxformer.decodable import DecodingSpec
from jaxformer.dense_experts import DenseAndExpertsSpec
from jaxformer.embeddings import OutputHead, lookup
from jaxformer.experts import ROUTER_COLLECTION, ExpertsSpec, expert_counts
from jaxformer.layers import (
    Block,
    LayerSpec,
    Segment,
    layer_specs,
    norm,
    scan_name,
    scanned_places,
    segments,
    shares_kv,
    view_key,
)
from jaxformer.memory import prefill_bytes
from jaxformer.per_layer import PerLayerInputs
from jaxformer.sharding import AXES_COLLECTION, EMBED, LAYERS, VOCAB, param
from jaxformer.validation import check_cache_step, check_step_inputs

# `DecoderConfig.remat_policy` -> what a rematerialised block keeps for the backward pass.
REMAT_POLICIES = {"dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "dots": jax.checkpoint_policies.dots_saveable,
                  "nothing": jax.checkpoint_policies.nothing_saveable}


def block_type(config: DecoderConfig) -> type[nn.Module]:
    """`Block`, or with `config.remat` a `Block` whose activations the backward pass
    recomputes from its input rather than keeps, but for those `config.remat_policy` saves."""
    return nn.remat(Block, policy=REMAT_POLICIES[config.remat_policy]) if config.remat else Block


class Pattern(nn.Module):
    """One period of a segment of layers (`jaxformer.layers.Segment`) as one scan body: its
    bodies' blocks, `block_{j}`, called in order, `(carry, views, layer) -> (carry, None)` as
    `Block` is.

    Attributes:
      config: the model's `DecoderConfig`.
      pattern: the segment's bodies, each the specs its block may be.
    """

    config: DecoderConfig
    pattern: tuple[tuple[LayerSpec, ...], ...]

    @nn.compact
    def __call__(self, carry, views, layer):
        """`(carry, None)` after the period's layers; `layer` is `(which, index, own)`, body j's flag
        `which[j]` (or None), its index in the model `index[j]` (int32 `[len(pattern)]`) and its
        per-layer input `own[j]` (or None)."""
        which, index, own = layer
        for j, body in enumerate(self.pattern):
            mine = (which[j], index[j], None if own is None else own[j])
            carry, _ = block_type(self.config)(self.config, body, name=f"block_{j}")(carry, views, mine)
        return carry, None


def scanned_blocks(config: DecoderConfig, segment: Segment, name: str) -> nn.Module:
    """A segment's layers run as one, named `name`: its body (a `Block` of its one body's specs, or
    a `Pattern` of several) scanned `segment.repeats` times. Parameters, their axis names, the
    sown intermediates and routers' logits gain a leading axis, each period its own init key; the cache rides in the
    carry, and each block reads its own `(which, index)`."""
    one = len(segment.pattern) == 1
    scanned = nn.scan(block_type(config) if one else Pattern,
                      variable_axes={"params": 0, AXES_COLLECTION: 0, "intermediates": 0, ROUTER_COLLECTION: 0},
                      split_rngs={"params": True}, in_axes=(nn.broadcast, 0),
                      length=segment.repeats, metadata_params={nn.PARTITION_NAME: LAYERS})
    return scanned(config, segment.pattern[0] if one else segment.pattern, name=name)


def scan_inputs(specs: tuple[LayerSpec, ...], segment: Segment, per_layer: jax.Array | None = None) -> tuple:
    """What a segment's scan reads per period, `(which, index, own)`: each body's flag, bool `[repeats]`
    (whether the layer is its body's second spec; None for a body of one), each layer's index in the
    model (int32 `[repeats]`) and its per-layer input (`[repeats, batch, T, width]` of `per_layer`
    `[batch, T, n_layer, width]`; None without), as a tuple over the bodies, or for a body alone itself."""
    which = tuple(jnp.asarray([body.index(specs[i]) == 1 for i in segment.layers(j)]) if len(body) > 1 else None
                  for j, body in enumerate(segment.pattern))
    period = len(segment.pattern)
    index = segment.first_layer + jnp.arange(segment.repeats * period).reshape(segment.repeats, period)
    own = None
    if per_layer is not None:  # [repeats, period, batch, T, width]: own[r, j] is layer first + r * period + j's
        rows = per_layer[:, :, segment.first_layer:segment.first_layer + segment.repeats * period]
        own = jnp.moveaxis(rows, 2, 0).reshape(segment.repeats, period, *rows.shape[:2], rows.shape[-1])
    if period == 1:
        return which[0], index[:, 0], None if own is None else own[:, 0]
    return which, index, own  # index[r, j]: layer first + r * period + j


def views(specs: tuple[LayerSpec, ...], position: jax.Array, key_positions: dict) -> dict:
    """`{view_key(mixer spec): its view}` for each distinct mixer among `specs` (`AttentionSpec.view`:
    RoPE's `cos, sin` `[..., T, rotary_dim/2]` at the query positions, int `[T]` or `[batch, T]`, and
    the `Visibility` of the keys), the keys at `key_positions[attention type]` (`[S]` or `[batch, S]`,
    negative: an empty slot) for each attention type. Mixers that rotate alike share one RoPE."""
    ropes, out = {}, {}
    for mixer in sorted({s.mixer for s in specs}, key=view_key):
        if mixer.rotation not in ropes:  # (GQA's head_dim channels, a latent attention's RoPE channels alone)
            ropes[mixer.rotation] = mixer.rope(position)
        out[view_key(mixer)] = mixer.view(position, key_positions[mixer.attention_type], ropes[mixer.rotation])
    return out


def cached_views(specs: tuple[LayerSpec, ...], T: int, cache: KVCache, slots: tuple[int, ...]) -> dict:
    """`views` of a call of T tokens per row after what `cache` holds (each layer's `slots`).
    Row b's query t sits at position pos[b] + t. A full layer's slot s holds position s (later
    slots: the future, unwritten, or padding), and only its first `read_slots` are read (every
    row's positions lie below: `KVCache.span`); a ring's, what `ring_positions` says, followed
    by this call's own keys."""
    pos = cache.pos  # [batch]
    position = pos[:, None] + jnp.arange(T)[None, :]  # [batch, T]
    keys = {}
    for spec, n_slots in zip(specs, slots):
        if n_slots < cache.capacity:
            keys[spec.mixer.attention_type] = jnp.concatenate([ring_positions(pos, n_slots), position], axis=1)
        else:
            keys[spec.mixer.attention_type] = jnp.arange(cache.read_slots)  # [S]: the mask's width is the slots read
    return views(specs, position, keys)  # [batch, T, ...]


def cache_slots(config: DecoderConfig, cache: KVCache) -> tuple[int, ...]:
    """The slots each layer of `config` keeps in `cache`: the capacity, or for a sliding layer
    the cache's ring size if it has rings (a `ValueError` if that is shorter than the window,
    or if the cache is longer than a LongRoPE model's trained context)."""
    check_longrope_capacity(config, cache.capacity, "cache")
    rings = cache.ring_slots
    ring = rings[0] if rings else cache.capacity  # (rings of two sizes fail the layout check after)
    windows = [spec.mixer.window for spec in layer_specs(config)]  # each layer's: None for a full one
    widest = max((window for window in windows if window is not None), default=None)
    if rings and widest is not None and ring < widest - 1:
        raise ValueError(f"cache: its rings of {ring} slots are shorter than sliding_window - 1 = "
                         f"{widest - 1}; make it with KVCache.create(config, ...)")
    return tuple(cache.capacity if window is None else ring for window in windows)


class Decoder(nn.Module):
    """Decoder-only language model: `apply({'params': p}, tokens, cache=None) -> (logits, cache)`.

    For a loss that never holds the whole `[batch, T, vocab]` logits, `apply(..., hidden=True)`
    gives the final normalised stream instead, and `output_head(params)` what turns it into
    logits (`jaxformer.losses.chunked_cross_entropy` takes both).

    With a cache, row b's T tokens are the next T of its sequence (positions `cache.pos[b]
    ..`), so a prefill and a one-token step are the same call, and one jitted function
    serves every step (docs/architecture.md, "How data flows"). Every attending layer's weights
    are sown (`sown_attention_weights` stacks them), and every router's logits (`expert_load`
    counts what they chose).
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
        slots = []  # each cached group's slots per layer
        for group, group_cache in zip(groups, caches):
            check_step_inputs(group, vocab_size=c.vocab_size, max_seq_len=c.max_seq_len)
            if group_cache is not None:
                slots.append(cache_slots(c, group_cache))
                want = group_cache.layout_shapes(group.shape[0], tuple(Entry(*e) for e in c.cache_entries),
                                                 slots[-1], c.scan_layers)
                check_cache_step(group, group_cache, want, c.scan_layers)

        init = nn.initializers.normal(0.02)
        embed = param(self, "embed", init, (c.vocab_size, c.d_model), (VOCAB, EMBED), c.param_dtype)
        # [batch, T, d_model]; groups flattened into one row of all their tokens, [1, sum of batch * T, d_model]
        x = jnp.concatenate([lookup(embed, group).reshape(1, -1, c.d_model) for group in groups], axis=1) \
            if grouped else lookup(embed, tokens)
        x = x.astype(c.dtype)
        if c.embed_scale:  # Gemma: embeddings of std ~1/sqrt(d) brought to the stream's scale, in its dtype
            x = x * jnp.asarray(math.sqrt(c.d_model), c.dtype)
        per_layer = None  # Gemma 4's per-layer inputs, [batch, T, n_layer, width] (a grouped call's [1, N, ...])
        if c.per_layer_width:
            ids = jnp.concatenate([group.reshape(1, -1) for group in groups], axis=1) if grouped else tokens
            per_layer = PerLayerInputs(c, name="per_layer_inputs")(ids, x)

        specs = layer_specs(c)
        if cache is None:
            T = tokens.shape[1]
            keys = {spec.mixer.attention_type: jnp.arange(T) for spec in specs}  # [T]
            part_views = (views(specs, jnp.arange(T), keys),)  # cos, sin [T, rotary_dim/2]; keys seen [T, T]
        else:  # each group of rows its own, at its positions in its cache
            part_views = tuple(cached_views(specs, group.shape[1], group_cache, group_slots)
                               for group, group_cache, group_slots in zip(groups, caches, slots))

        # The carry: the stream, the caches, and where layers share keys and values, the last of each type.
        carry = (x, caches, {} if shares_kv(specs) else None)
        if c.scan_layers:  # each run of repeated specs one scan (`segments`), in order
            for k, segment in enumerate(segments(specs)):
                carry, _ = scanned_blocks(c, segment, scan_name(k))(carry, part_views,
                                                                    scan_inputs(specs, segment, per_layer))
        else:
            for i, spec in enumerate(specs):
                own = None if per_layer is None else per_layer[:, :, i]
                carry, _ = block_type(c)(c, (spec,), name=f"block_{i}")(carry, part_views, (None, i, own))
        x, written, _ = carry
        x = norm(c, "final_norm")(x)
        weight = embed if c.tie_embeddings else param(self, "lm_head", init, (c.d_model, c.vocab_size),
                                                      (EMBED, VOCAB), c.param_dtype)
        head = OutputHead(weight, c.tie_embeddings, c.final_logit_softcap)
        if grouped:  # each group's logits, from its tokens' places in the one row
            logits = head.logits(x)[0]  # [sum of batch * T, vocab]
            parts = jnp.split(logits, np.cumsum([group.size for group in groups])[:-1])
            return tuple(zip(*(group_cache.commit(each.layers, part.reshape(*group.shape, -1), group.shape[1])
                               for group, group_cache, each, part in zip(groups, caches, written, parts))))
        # The head's parameter exists whatever is returned: `hidden` changes the output, never the tree.
        # [batch, T, vocab] logits, or with `hidden` the stream [batch, T, d_model] they are made from
        out = x if hidden else head.logits(x)
        if cache is None:
            return out, None
        return cache.commit(written[0].layers, out, tokens.shape[1])

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
                            prefill_bytes=functools.partial(prefill_bytes, c),
                            keeps_state=any(kind == "linear" for kind, _ in c.cache_entries))

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

    def decode_last(self, tokens: jax.Array, cache: KVCache, context: None, last: jax.Array):
        # The final stream at `last` alone through the head: a prompt's other positions' logits
        # (1B's head: a quarter of a 128-token prefill's arithmetic) are never read.
        x, cache = self(tokens, cache, hidden=True)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [batch, 1, d_model]
        return self.output_head(self.variables["params"]).logits(x)[:, 0], cache


def attending_layers(config: DecoderConfig) -> tuple[int, ...]:
    """The layers of `config` that sow attention weights: all but linear attention's (Gated DeltaNet
    weighs no keys)."""
    return tuple(i for i, spec in enumerate(layer_specs(config)) if spec.mixer.attention_type != "linear")


def sown_attention_weights(intermediates, config: DecoderConfig, layers: list[int] | None = None) -> jax.Array:
    """`[len(layers), batch, n_head, T, S]` float32: the attention weights a `Decoder` of `config`
    sowed in each of `layers` (None: every layer that attends, `attending_layers`), from
    `apply(..., mutable=['intermediates'])`'s second output."""
    layers = attending_layers(config) if layers is None else layers
    sown = intermediates["intermediates"]
    if not config.scan_layers:
        return jnp.stack([sown[f"block_{i}"]["attn"]["attention_weights"][0] for i in layers])
    places = scanned_places(layer_specs(config))  # layer i: row `row` of its body's stack
    weights = []
    for i in layers:
        path, row, _ = places[i]
        body = functools.reduce(lambda tree, name: tree[name], path, sown)
        weights.append(body["attn"]["attention_weights"][0][row])
    return jnp.stack(weights)


def layer_tree(tree: dict, config: DecoderConfig, i: int):
    """Layer i's part of `tree`, a tree laid out as a `Decoder` of `config` lays out its parameters
    (the parameters, or a collection it sowed): `block_{i}`, or layer i's row of its scanned stack."""
    if not config.scan_layers:
        return tree[f"block_{i}"]
    path, row, _ = scanned_places(layer_specs(config))[i]
    return jax.tree.map(lambda leaf: leaf[row], functools.reduce(lambda node, name: node[name], path, tree))


def expert_load(model: Decoder, variables: dict, tokens: jax.Array, mask: jax.Array | None = None
                ) -> dict[int, jax.Array]:
    """`{i: int32 [E]}` for each layer i of experts: the (token, choice) pairs its router sends to each
    expert over `tokens [batch, T]` (those `mask` keeps, bool `[batch, T]`; None: all), by the layer's
    own routing rule on the logits it sows (`jaxformer.experts.expert_counts`). Each sums to its `top_k`
    times the tokens kept; a model without experts gives `{}`. One forward of `model` (jit the call)."""
    config = model.config
    _, sown = model.apply(variables, tokens, mutable=[ROUTER_COLLECTION])
    loads = {}
    for i, spec in enumerate(layer_specs(config)):
        beside = isinstance(spec.ffn, DenseAndExpertsSpec)  # (Gemma 4's experts, beside a dense MLP: mlp/experts)
        if isinstance(spec.ffn, ExpertsSpec) or beside:
            sown_mlp, mlp = (layer_tree(tree, config, i)["mlp"] for tree in (sown[ROUTER_COLLECTION],
                                                                             variables["params"]))
            sown_mlp, mlp = (sown_mlp["experts"], mlp["experts"]) if beside else (sown_mlp, mlp)
            (logits,) = sown_mlp["logits"]  # [batch, T, E]
            loads[i] = expert_counts(logits, spec.ffn.experts if beside else spec.ffn, mlp.get("correction_bias"),
                                     mask)
    return loads
