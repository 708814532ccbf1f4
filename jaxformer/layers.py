"""A decoder layer: a mixer, a feed-forward and a norm placement, each of a kind.

    x = x + post(mixer(norm(x)))      # "pre": norm an RMSNorm, post nothing (Llama)
    x = x + post(ffn(norm(x)))        # "sandwich": both RMSNorms (Gemma 2 to 4); "post": norm nothing (OLMo 2)
    x = x + per_layer(x, in_l)        # where the model has per-layer inputs (Gemma 4: jaxformer.per_layer)
    x = x * scalar                    # where it has layer scalars (Gemma 4)

A kind is a spec, a frozen dataclass of what may vary from layer to layer (a window, a RoPE
base, a width), and the module it builds (`spec.build(config, name)`), with its parameters'
names, shapes and sharding axes (`spec.weights(d_model)`):

    mixers          AttentionSpec -> GQASelfAttention    (jaxformer.attention)
                    LatentAttentionSpec -> LatentAttention  (jaxformer.latent_attention: DeepSeek's MLA)
                    GatedDeltaNetSpec -> GatedDeltaNet   (jaxformer.deltanet: linear attention)
    feed-forwards   GatedMLPSpec  -> GatedMLP            (jaxformer.feedforward)
                    ExpertsSpec   -> Experts             (jaxformer.experts: a mixture of experts)
                    DenseAndExpertsSpec -> DenseAndExperts (jaxformer.dense_experts: both, Gemma 4)

A mixer's spec also says what a layer reads in a call besides its input (`spec.view`: RoPE's
angles and which keys each query sees) and which slots it keeps per row between calls
(`attention_type`: all of them, or a ring). `layer_specs(config)` gives each layer's
`LayerSpec`; the model builds layer i from `specs[i]`, and what every layer shares (d_model,
the norms' form, LoRA, dtypes) stays on the `DecoderConfig`. docs/architecture.md, "Layer
kinds", says how a new kind joins.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.attention import AttentionSpec, Part
from jaxformer.config import DecoderConfig
from jaxformer.deltanet import GatedDeltaNetSpec
from jaxformer.dense_experts import DenseAndExpertsSpec
from jaxformer.experts import ExpertsSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttentionSpec
from jaxformer.norms import RMSNorm, rms_norm
from jaxformer.per_layer import PerLayerInput
from jaxformer.sharding import SCALAR, param

# Where a layer's RMSNorms sit: before each sublayer; before and after it (on its output); or after it alone.
NORM_PLACEMENTS = ("pre", "sandwich", "post")
NORMED_INPUT = ("pre", "sandwich")  # the placements that normalise a sublayer's input ...
NORMED_OUTPUT = ("sandwich", "post")  # ... and its output, before the sum
MIXERS = (AttentionSpec, LatentAttentionSpec, GatedDeltaNetSpec)  # the kinds of mixer a layer may have
FEED_FORWARDS = (GatedMLPSpec, ExpertsSpec, DenseAndExpertsSpec)  # ... and of feed-forward


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One decoder layer.

    Attributes:
      mixer: how positions exchange information, one of `MIXERS` (`AttentionSpec`, `LatentAttentionSpec`,
        `GatedDeltaNetSpec`).
      ffn: the position-wise feed-forward, one of `FEED_FORWARDS` (`GatedMLPSpec`, `ExpertsSpec`,
        `DenseAndExpertsSpec`).
      norms: where the RMSNorms sit, one of `NORM_PLACEMENTS`.
    """

    mixer: AttentionSpec | LatentAttentionSpec | GatedDeltaNetSpec
    ffn: GatedMLPSpec | ExpertsSpec | DenseAndExpertsSpec
    norms: str = "pre"

    def __post_init__(self):
        if not isinstance(self.mixer, MIXERS):
            raise ValueError(f"LayerSpec.mixer: one of {[t.__name__ for t in MIXERS]}, got {type(self.mixer).__name__}")
        if not isinstance(self.ffn, FEED_FORWARDS):
            raise ValueError(f"LayerSpec.ffn: one of {[t.__name__ for t in FEED_FORWARDS]}, "
                             f"got {type(self.ffn).__name__}")
        if self.norms not in NORM_PLACEMENTS:
            raise ValueError(f"LayerSpec.norms: one of {NORM_PLACEMENTS}, got {self.norms!r}")


def layer_specs(config: DecoderConfig) -> tuple[LayerSpec, ...]:
    """Each layer's `LayerSpec` as `config` states it: `config.layers` where a family filled them
    in (checked: `filled_specs`), else derived from the flat fields: an attention layer whose
    window and RoPE follow its `attention_types` entry (a sliding layer's base is
    `local_rope_theta` where set, unscaled), and a gated MLP."""
    c = config
    if c.layers:
        return filled_specs(c)
    ffn = GatedMLPSpec(c.ffn_dim, c.mlp_activation)
    shared = dict(n_head=c.n_head, n_kv_head=c.n_kv_head, head_dim=c.head_dim, rope_pairing=c.rope_pairing,
                  qk_norm=c.qk_norm, qkv_bias=c.qkv_bias, softcap=c.attn_logit_softcap,
                  scale=None if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar ** -0.5)
    full = AttentionSpec(window=None, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, **shared)
    sliding = full if c.sliding_window is None else AttentionSpec(
        window=c.sliding_window, **shared, **(dict(rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)
                                              if c.local_rope_theta is None else
                                              dict(rope_theta=c.local_rope_theta, rope_scaling=None)))
    norms = "sandwich" if c.post_norms else "pre"
    return tuple(LayerSpec(full if kind == "full" else sliding, ffn, norms) for kind in c.attention_types)


# What every layer's attention shares with the config: checkpoints convert every layer's RoPE pairing
# alike. (Its heads and their width may differ from layer to layer, Gemma 4's global layers'; the
# cache keeps each layer's `cache_entry`, and a scanned model's one shape per stack, which
# `jaxformer.cache.layer_shapes` checks.)
MODEL_WIDE = ("rope_pairing",)


def filled_specs(config: DecoderConfig) -> tuple[LayerSpec, ...]:
    """`config.layers`, each a `LayerSpec` whose mixer agrees with the config on `MODEL_WIDE`, and
    whose `kv_shared` attention (if it is) follows a layer of its type that computes keys and values,
    in a model not scanned; a ValueError naming the first entry that is not."""
    computed = {}  # the attention type of each layer so far that computes keys and values: the last one's mixer
    for i, spec in enumerate(config.layers):
        if not isinstance(spec, LayerSpec):
            raise ValueError(f"config.layers[{i}] must be a LayerSpec (got {type(spec).__name__})")
        for field in (field for field in MODEL_WIDE if hasattr(spec.mixer, field)):
            mine, model = getattr(spec.mixer, field), getattr(config, field)
            if mine != model:
                raise ValueError(f"config.layers[{i}].mixer.{field} must be the config's {field}={model!r}, one for "
                                 f"every layer (got {mine!r})")
        mixer = spec.mixer
        if not getattr(mixer, "kv_shared", False):
            computed[mixer.attention_type] = mixer
            continue
        source = computed.get(mixer.attention_type)
        if source is None:
            raise ValueError(f"config.layers[{i}].mixer.kv_shared: no earlier layer of its type "
                             f"({mixer.attention_type}) computes the keys and values it reads")
        if (mixer.n_kv_head, mixer.head_dim) != (source.n_kv_head, source.head_dim):
            raise ValueError(f"config.layers[{i}].mixer.kv_shared: its heads ({mixer.n_kv_head} of {mixer.head_dim}) "
                             f"must be those whose keys and values it reads ({source.n_kv_head} of {source.head_dim})")
        if config.scan_layers:
            raise ValueError(f"config.layers[{i}].mixer.kv_shared with scan_layers=True: a scanned body does not pass "
                             "keys and values from layer to layer (not implemented); use scan_layers=False")
    return config.layers


def shares_kv(specs: tuple[LayerSpec, ...]) -> bool:
    """Whether a layer of `specs` reads another's keys and values (`AttentionSpec.kv_shared`): the
    layers then pass theirs on, by attention type, in the call's carry."""
    return any(getattr(spec.mixer, "kv_shared", False) for spec in specs)


def _kinds(specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    """The different specs among `specs`, full layers' first (the order a scan's flag indexes)."""
    return tuple(sorted(set(specs), key=lambda s: (s.mixer.attention_type, specs.index(s))))


def shareable(specs: tuple[LayerSpec, ...]) -> bool:
    """Whether one scanned body may run every layer of `specs`: at most two specs, which differ in
    their window and RoPE alone (one set of parameter shapes, one norm placement, one feed-forward;
    RoPE's base, scaling, or none at all: a NoPE layer's angles are the identity's), and whose masks
    their attention types tell apart: one full and one sliding, or two of one window."""
    kinds = _kinds(specs)

    def shared(spec: LayerSpec):  # what one body holds for every layer it runs
        mixer = spec.mixer  # (a latent attention's score scale, which its RoPE scaling may set, too; it always rotates)
        if isinstance(mixer, GatedDeltaNetSpec):  # (no window, no RoPE: all of it is shared)
            return spec
        own = dict(scale=mixer.softmax_scale) if isinstance(mixer, LatentAttentionSpec) else dict(use_rope=True)
        mixer = dataclasses.replace(mixer, window=None, rope_theta=1.0, rope_scaling=None, **own)
        return dataclasses.replace(spec, mixer=mixer)

    types, windows = {s.mixer.attention_type for s in kinds}, {s.mixer.window for s in kinds}
    return len(kinds) <= 2 and len({shared(s) for s in kinds}) == 1 and (len(types) == len(kinds) or len(windows) == 1)


def distinct(specs: tuple[LayerSpec, ...]) -> tuple[LayerSpec, ...]:
    """The different specs among `specs`, full layers' first (the order a scan's flag indexes),
    for one scanned body: `shareable` ones. A ValueError otherwise."""
    kinds = _kinds(specs)
    if not shareable(specs):
        raise ValueError(f"scan_layers=True: one scanned body runs two kinds of layer at most, which differ in "
                         f"their window and RoPE alone (one full and one sliding, or two of one window); these "
                         f"layers are {len(kinds)} kinds")
    return kinds


class Segment(NamedTuple):
    """Layers `first_layer .. first_layer + len(pattern) * repeats - 1` of a scanned model: one
    `nn.scan` over `repeats` periods, each running `pattern`'s bodies in order.

    Attributes:
      first_layer: the index of its first layer in the model.
      pattern: one period's bodies, each the specs one scanned `Block` may be (`distinct`):
        layer `first_layer + r * len(pattern) + j` runs body j.
      repeats: the periods, the scan's length.
    """

    first_layer: int
    pattern: tuple[tuple[LayerSpec, ...], ...]
    repeats: int

    def layers(self, j: int) -> range:
        """The model's indices of the layers body j runs, one per period."""
        period = len(self.pattern)
        return range(self.first_layer + j, self.first_layer + period * self.repeats, period)


def _run(specs: tuple[LayerSpec, ...], period: int) -> int:
    """How many of `specs`, from the first, repeat their first `period`: layer i shares a body
    with every earlier layer `period`, `2 * period`, ... before it."""
    columns = [{spec} for spec in specs[:period]]  # each body's specs so far
    for i in range(period, len(specs)):
        column = columns[i % period] | {specs[i]}
        if not shareable(tuple(column)):
            return i
        columns[i % period] = column
    return len(specs)


def segments(specs: tuple[LayerSpec, ...]) -> tuple[Segment, ...]:
    """The segments a scanned model of layers `specs` runs, in order: from the first layer not
    yet in one, the shortest period that repeats over the most layers (at least twice), or that
    layer alone when none does. A uniform model, or Gemma 3's five sliding layers to one full
    (one body of both), is one segment of one body; DeepSeek's 3 dense layers then 58 of
    experts two; Qwen3-Next's three linear-attention layers then one attention layer, 12 times,
    one of four bodies; a period's tail that does not complete it becomes segments of its own."""
    out, start = [], 0
    while start < len(specs):
        rest = specs[start:]
        period, repeats = 1, 1  # a layer alone, when nothing repeats
        for p in range(1, len(rest) // 2 + 1):
            n = _run(rest, p) // p
            if n >= 2 and p * n > period * repeats:  # (a tie keeps the shorter period, found first)
                period, repeats = p, n
        pattern = tuple(distinct(rest[j:period * repeats:period]) for j in range(period))
        out.append(Segment(start, pattern, repeats))
        start += period * repeats
    return tuple(out)


def scan_name(k: int) -> str:
    """Segment k's name in a scanned model: `blocks`, `blocks_1`, `blocks_2`, ..."""
    return "blocks" if k == 0 else f"blocks_{k}"


def scanned_places(specs: tuple[LayerSpec, ...]) -> tuple[tuple[tuple[str, ...], int, int], ...]:
    """Where each layer of `specs` sits in a scanned model's parameters: `(path, row, rows)`, its
    parameters row `row` of the `[rows, ...]` leaves under `path`: `(scan_name(k),)` for a
    segment of one body, `(scan_name(k), f"block_{j}")` for body j of a longer pattern."""
    places = {}
    for k, segment in enumerate(segments(specs)):
        for j in range(len(segment.pattern)):
            path = (scan_name(k),) if len(segment.pattern) == 1 else (scan_name(k), f"block_{j}")
            for row, i in enumerate(segment.layers(j)):
                places[i] = (path, row, segment.repeats)
    return tuple(places[i] for i in range(len(specs)))


def view_key(mixer) -> str:
    """A mixer spec's key among a call's views: its attention type, then its text, so that the
    views, a dict, flatten in one order in every program, full layers' first (specs themselves
    do not sort: a window may be None)."""
    return f"{mixer.attention_type} {mixer!r}"


def pick(values: tuple, which):
    """The only entry of `values`, or of two (a scan over two kinds of layer, `distinct`'s order)
    the second where the traced bool `which` is set, else the first (the two the same shape)."""
    if len(values) == 1:
        return values[0]
    return jax.tree.map(lambda first, second: jnp.where(which, second, first), *values)


def norm(config: DecoderConfig, name: str) -> RMSNorm:
    """The decoder's RMSNorm over `d_model` channels, named `name`."""
    return rms_norm(config, name=name)


class Block(nn.Module):
    """One layer, called as a scan body `(carry, views, layer) -> (carry, None)` so the same
    module runs once per layer (`block_{i}`) or scanned over stacked parameters.

    Attributes:
      config: the model's `DecoderConfig`.
      specs: the specs this block may be: its layer's; in a scan over layers of several specs,
        each of them (`distinct`: their parameters share shapes, and the scanned flag picks).
    """

    config: DecoderConfig
    specs: tuple[LayerSpec, ...]

    @nn.compact
    def __call__(self, carry, views, layer):
        """`((x, caches, shared), None)` after the layer.

        Args:
          carry: `(x [batch, T, d_model], caches, shared)`: a tuple of the call's caches (None without
            one; several for groups of rows in one call: `Part`), each of which the layer writes; and
            in a model whose layers share keys and values (`shares_kv`), `{attention type: each
            part's (keys, values)}` of the last layer of that type that computed them (else None).
          views: `({view_key(mixer spec): (cos, sin, seen)}, ...)`, one dict per part, every distinct
            mixer's view of the part's tokens (`jaxformer.decoder.views`), the same for every layer.
          layer: `(which, index, own)`: in a scan over two specs bool `[]`, whether this layer is the
            second of `specs` (else None); its index in the model (int32 `[]` in a scan); and its
            per-layer input `[batch, T, per_layer_width]` (`jaxformer.per_layer`; None without).
        """
        x, caches, shared = carry
        c = self.config
        which, index, own = layer
        spec = self.specs[0]
        mixer = spec.mixer

        def part(part_views: dict, cache, kv) -> Part:
            mine = [part_views[view_key(s.mixer)] for s in self.specs]  # (cos, sin, seen) of each spec
            cos, sin = pick(tuple(view[:2] for view in mine), which)
            rows_T = cos.shape[:2] if cos.ndim == 3 else (x.shape[0], cos.shape[0])
            masks = {s.mixer.attention_type: view[2] for s, view in zip(self.specs, mine)}
            return Part(*rows_T, cos, sin, masks, cache, kv)

        def before(name: str, h):  # a sublayer's input, normalised unless the norms sit after it alone (OLMo 2)
            return norm(c, name)(h) if spec.norms in NORMED_INPUT else h

        def after(name: str, h):  # its output, normalised before the sum ("sandwich": Gemma 2's; "post": OLMo 2's)
            return norm(c, name)(h) if spec.norms in NORMED_OUTPUT else h

        # A layer that shares keys and values reads its type's last ones; one that computes them passes them on.
        kvs = shared[mixer.attention_type] if getattr(mixer, "kv_shared", False) else (None,) * len(views)
        keep = shared is not None and kvs[0] is None
        h, caches, kept = mixer.build(c, "attn")(before("attn_norm", x), tuple(map(part, views, caches, kvs)), index,
                                                 which, keep_kv=keep)
        if keep:
            shared = {**shared, mixer.attention_type: kept}
        x = x + after("attn_post_norm", h)  # [batch, T, d_model]
        ffn = spec.ffn.build(c, "mlp")
        normed = before("mlp_norm", x)
        h = ffn(normed, x) if getattr(spec.ffn, "reads_stream", False) else ffn(normed)
        x = x + after("mlp_post_norm", h)  # [batch, T, d_model]
        if c.per_layer_width:  # Gemma 4: what the layer makes of its own input
            x = x + PerLayerInput(c, name="per_layer")(x, own)
        if c.layer_scalar:  # Gemma 4: the whole stream scaled by the layer's number
            x = x * param(self, "layer_scalar", nn.initializers.ones, (1,), (SCALAR,), c.param_dtype).astype(c.dtype)
        return (x, caches, shared), None
