"""What every checkpoint family shares: reading `config.json` fields with errors that name
them, RoPE's parameters, the fields every family writes, and the tensor table's rows.

A family module (`jaxformer.families.llama`, `.gemma`, ...) reads the fields that are its
own and lists its tensors with these; docs/architecture.md, "Checkpoint families", says how.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

from jaxformer.attention import AttentionSpec
from jaxformer.config import ROPE_SCALINGS, DecoderConfig, RopeScaling
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.layers import layer_specs
from jaxformer.quantized import QArray, reshape
from jaxformer.validation import finite_float, python_int

DEFAULT_ROPE_THETA = 10000.0  # transformers' default when config.json names none
REQUIRED = object()  # `field`'s default: the field must be present
HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}  # config.json's names -> ours


def fail(field_name: str, rule: str, value: Any) -> None:
    raise ValueError(f"config.json {field_name}: {rule} (got {value!r})")


def field(hf: dict, key: str, convert: Callable[[Any], Any], rule: str, *, default: Any = REQUIRED,
          where: str | None = None) -> Any:
    """`config.json`'s `key` through `convert` (None: the wrong kind), checked positive;
    `default` when absent or null, else a ValueError naming the field (inside `where`, an
    object of config.json, if given) and `rule`."""
    name = key if where is None else f"{where}.{key}"
    if hf.get(key) is None:
        if default is REQUIRED:
            raise ValueError(f"config.json {name}: missing; it must be {rule}")
        return default
    value = convert(hf[key])
    if value is None or not value > 0:
        fail(name, f"must be {rule}", hf[key])
    return value


def positive_int(hf: dict, key: str, default: Any = REQUIRED) -> int:
    return field(hf, key, python_int, "a positive int", default=default)


def flag(hf: dict, key: str, default: bool) -> bool:
    """A true/false field; `default` when absent or null (`bool("false")` would be True)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        fail(key, "must be true or false", value)
    return value


def refuse_set(hf: dict, key: str, allowed: Any, why: str) -> None:
    """A ValueError naming `key` unless it is absent, null or `allowed`."""
    if hf.get(key) not in (None, allowed):
        fail(key, f"must be {allowed!r}: {why}", hf[key])


def rope(given: dict, where: str, hf: dict, *, default_theta: float = DEFAULT_ROPE_THETA
         ) -> tuple[float, RopeScaling | None]:
    """The RoPE base and scaling one object of config.json states (`rope_type` or `type`,
    `rope_theta`, the scaling's fields), named `where` in errors; `hf` is the whole config.

    A variant the decoder does not compute (longrope, dynamic...) changes the angles:
    refused, never loaded as plain RoPE."""
    rope_type = given.get("rope_type", given.get("type", "default"))
    if rope_type not in ("default", *ROPE_SCALINGS):
        fail(f"{where}.rope_type", f"must be one of {('default', *ROPE_SCALINGS)}", rope_type)
    theta = field(given, "rope_theta", finite_float, "a finite number > 0", where=where, default=default_theta)

    def number(key: str, convert=finite_float, rule: str = "a finite number > 0", default: Any = REQUIRED):
        return field(given, key, convert, rule, where=where, default=default)

    if rope_type == "proportional":  # (Gemma 4's: its own reading of partial_rotary_factor, 1.0 when absent)
        fraction = number("partial_rotary_factor", rule="a number in (0, 1]", default=1.0)
        if fraction > 1:
            fail(f"{where}.partial_rotary_factor", "must be a number in (0, 1]", fraction)
        return theta, RopeScaling("proportional", number("factor", default=1.0), partial_rotary_factor=fraction)
    if given.get("partial_rotary_factor", 1.0) != 1.0:
        fail(f"{where}.partial_rotary_factor", "RoPE must rotate every channel (1.0)", given["partial_rotary_factor"])

    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", number("factor"))
    if rope_type == "longrope":
        return theta, _longrope(hf, given, where, number)
    context = number("original_max_position_embeddings", python_int, "a positive int")
    if rope_type == "yarn":
        return theta, _yarn(hf, given, where, number, context)
    low, high = number("low_freq_factor"), number("high_freq_factor")
    if not high > low:
        fail(f"{where}.high_freq_factor", f"must be above low_freq_factor={low:g}", high)
    return theta, RopeScaling("llama3", number("factor"), context, low_freq_factor=low, high_freq_factor=high)


def _longrope(hf: dict, given: dict, where: str, number: Callable) -> RopeScaling:
    """LongRoPE's fields (Phi-3's long context), with transformers' defaults: the trained
    context from the object or config.json's top level, `factor` the ratio of the two contexts."""
    context = number("original_max_position_embeddings", python_int, "a positive int", default=None)
    if context is None:
        context = field(hf, "original_max_position_embeddings", python_int, "a positive int")
    factor = number("factor", default=None)
    if factor is None:
        factor = field(hf, "max_position_embeddings", python_int, "a positive int") / context
    lists = {}
    for key in ("short_factor", "long_factor"):
        factors = given.get(key)
        if not (isinstance(factors, list) and factors and all(
                finite_float(f) is not None and finite_float(f) > 0 for f in factors)):
            fail(f"{where}.{key}", "must be a list of finite numbers > 0, one per RoPE pair", factors)
        lists[key] = tuple(finite_float(f) for f in factors)
    if len(lists["short_factor"]) != len(lists["long_factor"]):
        fail(f"{where}.long_factor", f"must be as long as short_factor ({len(lists['short_factor'])})",
             given["long_factor"])
    return RopeScaling("longrope", factor, context, attention_factor=number("attention_factor", default=None),
                       **lists)


def _yarn(hf: dict, given: dict, where: str, number: Callable, context: int) -> RopeScaling:
    """YaRN's fields, with transformers' defaults: `factor` from the two contexts when
    absent, and the attention factor from `mscale` / `mscale_all_dim` when given; `mscale_all_dim`
    kept too, for a latent attention's softmax scale (`RopeScaling.mscale_all_dim`)."""
    factor = number("factor", default=None)
    if factor is None:
        factor = field(hf, "max_position_embeddings", python_int, "a positive int") / context
    attention_factor = number("attention_factor", default=None)
    mscale, mscale_all_dim = number("mscale", default=None), number("mscale_all_dim", default=None)
    if attention_factor is None and mscale and mscale_all_dim:

        def m(weight: float) -> float:  # YaRN's 0.1 * weight * ln(factor) + 1
            return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

        attention_factor = m(mscale) / m(mscale_all_dim)
    truncate = given.get("truncate")
    if truncate is not None and not isinstance(truncate, bool):
        fail(f"{where}.truncate", "must be true or false", truncate)
    return RopeScaling("yarn", factor, context, beta_fast=number("beta_fast", default=None),
                       beta_slow=number("beta_slow", default=None), attention_factor=attention_factor,
                       truncate=truncate, mscale_all_dim=mscale_all_dim)


def single_rope(hf: dict, *, default_theta: float = DEFAULT_ROPE_THETA) -> tuple[float, RopeScaling | None]:
    """The one RoPE of every layer, from `rope_parameters` (transformers >= 5) or the older
    top-level `rope_theta` and `rope_scaling` (a contradiction between the two is refused)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        fail("rope_parameters", "must be an object", params)
    if "rope_type" not in params and params and all(isinstance(v, dict) for v in params.values()):
        fail("rope_parameters", "per-layer-type RoPE parameters are not supported by this family", params)
    scaling = hf.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        fail("rope_scaling", "must be an object or null", scaling)
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        fail("partial_rotary_factor", "RoPE must rotate every channel (1.0)", hf["partial_rotary_factor"])
    if "rope_type" in params or "type" in params:
        stale = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if stale not in ("default", params.get("rope_type", params.get("type"))):
            fail("rope_scaling", f"contradicts rope_parameters.rope_type={params.get('rope_type')!r}", scaling)
        return rope(params, "rope_parameters", hf, default_theta=default_theta)
    given = {**(scaling or {}), **({"rope_theta": hf["rope_theta"]} if "rope_theta" in hf else {})}
    where = "rope_scaling" if scaling else "rope_theta"
    theta, rope_scaling = rope(given, where, hf, default_theta=default_theta)
    return theta, rope_scaling


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict:
    """One `rope_parameters` object as transformers >= 5 writes it: type, base, the scaling's fields."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if k != "kind" and v is not None}
    return {"rope_type": scaling.kind, "rope_theta": theta, **fields}


def refuse_sliding(hf: dict) -> None:
    """For a family that never slides (Llama, Gemma 1): a `layer_types` that says otherwise is refused."""
    given = hf.get("layer_types")
    if given is not None and (not isinstance(given, list) or any(t != "full_attention" for t in given)):
        fail("layer_types", "every layer must be 'full_attention' (this family has no sliding window)", given)


def layer_types(hf: dict, n_layer: int, derived: Callable[[int], str] | None) -> tuple[str, ...] | None:
    """Each layer's attention type from `layer_types` (its names mapped to ours), else
    `derived(i)` for layer i (the family's rule when the field is absent), else None (all full)."""
    given = hf.get("layer_types")
    if given is None:
        return None if derived is None else tuple(derived(i) for i in range(n_layer))
    if not (isinstance(given, list) and len(given) == n_layer and all(t in HF_LAYER_TYPES for t in given)):
        fail("layer_types", f"must list {n_layer} (num_hidden_layers) entries of {tuple(HF_LAYER_TYPES)}", given)
    return tuple(HF_LAYER_TYPES[t] for t in given)


def hf_layer_types(config: DecoderConfig) -> list[str]:
    """`config.attention_types` in config.json's names."""
    names = {ours: theirs for theirs, ours in HF_LAYER_TYPES.items()}
    return [names[t] for t in config.attention_types]


def decoder_fields(hf: dict, *, max_seq_len: int | None, tie_default: bool, norm_eps_key: str = "rms_norm_eps"
                   ) -> dict:
    """`DecoderConfig` fields every family reads the same way: sizes, heads, the norm's
    epsilon, the tied head, `max_seq_len` (default `max_position_embeddings`)."""
    d_model, n_head = positive_int(hf, "hidden_size"), positive_int(hf, "num_attention_heads")
    head_dim = positive_int(hf, "head_dim", default=d_model // n_head)
    return dict(
        vocab_size=positive_int(hf, "vocab_size"), n_layer=positive_int(hf, "num_hidden_layers"), n_head=n_head,
        n_kv_head=positive_int(hf, "num_key_value_heads", default=n_head), d_model=d_model,
        max_seq_len=positive_int(hf, "max_position_embeddings") if max_seq_len is None else max_seq_len,
        norm_eps=field(hf, norm_eps_key, finite_float, "a finite number > 0"),
        d_ff=positive_int(hf, "intermediate_size"),
        rope_pairing="split_half",  # the only pairing transformers implements
        tie_embeddings=flag(hf, "tie_word_embeddings", tie_default),
        head_dim_override=None if head_dim * n_head == d_model else head_dim)


def common_hf_fields(config: DecoderConfig) -> dict:
    """The config.json fields every family writes."""
    c = config
    return {"vocab_size": c.vocab_size, "hidden_size": c.d_model, "intermediate_size": c.ffn_dim,
            "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
            "head_dim": c.head_dim, "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
            "tie_word_embeddings": c.tie_embeddings}


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor, or a part of it: its name and shape there, its place and shape in
    jaxformer's tree.

    A fused tensor is listed once per part, each with the part's `rows` `(start, stop)` of its
    second-to-last axis (Phi-3's `qkv_proj`: q, k and v one after another; Gemma 4's experts'
    `gate_up_proj` `[E, 2F, d]`: the gate's rows then up's), its `grouped` rows `(size, start,
    stop)` of its first axis, rows `start .. stop - 1` of every group of `size` (Qwen3-Next's
    `in_proj_qkvz`: each key head's q, k, v and z together), or `columns` `(first, step)` of its
    last axis (gpt-oss's `gate_up_proj`: the gate at even columns, up at odd); the parts are
    `Tensor`s of the same `hf_key`. A tensor that is one expert's of a parameter stacked over `E`
    experts (`[E, ...]` in jaxformer's tree) names it by `expert` `(e, E)`.
    """

    hf_key: str
    hf_shape: tuple[int, ...]  # of this part: [out, in] for a torch Linear
    path: tuple[str, ...]
    shape: tuple[int, ...]  # of this part, in jaxformer's layout (without the experts' axis)
    transpose: bool = False  # a torch Linear weight: [..., out, in] there, [..., in, out] (split into heads) here
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None
    expert: tuple[int, int] | None = None
    grouped: tuple[int, int, int] | None = None

    def to_jax(self, w: np.ndarray) -> np.ndarray:
        """`w` (an array, or a checkpoint's quantized matrix: a `QArray`) in jaxformer's layout."""
        w = w.swapaxes(-1, -2) if self.transpose else w
        return reshape(w, self.shape) if isinstance(w, QArray) else w.reshape(self.shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        if not self.transpose:
            return w.reshape(self.hf_shape)
        *stack, n_out, n_in = self.hf_shape
        return np.swapaxes(w.reshape(*stack, n_in, n_out), -1, -2)

    @property
    def index(self) -> tuple:
        """This part of the whole checkpoint tensor, a numpy index (`()`: all of it)."""
        if self.rows is not None:
            return (..., slice(*self.rows), slice(None))
        if self.grouped is not None:  # rows start .. stop - 1 of each group, the groups in order
            size, start, stop = self.grouped
            groups = self.hf_shape[0] // (stop - start)
            return ((np.arange(groups)[:, None] * size + np.arange(start, stop)[None, :]).reshape(-1),)
        if self.columns is not None:
            return (..., slice(self.columns[0], None, self.columns[1]))
        return ()


def whole_shape(parts: list[Tensor]) -> tuple[int, ...]:
    """The shape of the checkpoint tensor `parts` (all of one `hf_key`) make up together."""
    first = parts[0]
    if first.rows is not None:
        return (*first.hf_shape[:-2], sum(t.hf_shape[-2] for t in parts), first.hf_shape[-1])
    if first.grouped is not None:
        return (sum(t.hf_shape[0] for t in parts), *first.hf_shape[1:])
    if first.columns is not None:
        return (*first.hf_shape[:-1], sum(t.hf_shape[-1] for t in parts))
    return first.hf_shape


def linear(hf_key: str, path: tuple[str, ...], shape: tuple[int, ...], n_out: int, n_in: int,
           rows: tuple[int, int] | None = None, expert: tuple[int, int] | None = None) -> Tensor:
    """A torch `Linear` weight `[n_out, n_in]` (or its `rows`) as jaxformer's `[n_in, ...]` `shape`
    (expert `expert[0]`'s of a parameter stacked over `expert[1]`)."""
    return Tensor(hf_key, (n_out, n_in), path, shape, transpose=True, rows=rows, expert=expert)


def vector(hf_key: str, path: tuple[str, ...], n: int) -> Tensor:
    """A 1-D tensor (a norm's weight) stored the same way in both."""
    return Tensor(hf_key, (n,), path, (n,))


def outer_tensors(c: DecoderConfig) -> list[Tensor]:
    """The embedding, the final norm and (untied) the output head: every family's."""
    V, d = c.vocab_size, c.d_model
    table = [Tensor("model.embed_tokens.weight", (V, d), ("embed",), (V, d)),
             vector("model.norm.weight", ("final_norm", "weight"), d)]
    if not c.tie_embeddings:  # a tied checkpoint has no lm_head.weight: it is embed_tokens
        table.append(linear("lm_head.weight", ("lm_head",), (d, V), V, d))
    return table


# Each kind's parameters by their checkpoint names (after `model.layers.{i}.`).
HF_ATTENTION = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj"}
HF_MLP = {"w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def kind_tensors(weights: dict, names: dict, prefix: str, path: tuple[str, ...]) -> list[Tensor]:
    """A layer kind's matrices (`spec.weights(d_model)`, those of `names` it has) as torch `Linear`
    weights `{prefix}{name}.weight` `[out, in]`, at `path + (name,)` in the parameter tree."""
    def linear_of(name: str) -> Tensor:
        shape, _, inputs = weights[name]
        return linear(f"{prefix}{names[name]}.weight", (*path, name), shape, math.prod(shape[inputs:]),
                      math.prod(shape[:inputs]))

    return [linear_of(name) for name in names if name in weights]


def attention_tensors(d_model: int, spec: AttentionSpec, prefix: str, block: str) -> list[Tensor]:
    """An attention layer's `{prefix}self_attn.{q,k,v,o}_proj.weight` as `{block}/attn/w{q,k,v,o}`."""
    return kind_tensors(spec.weights(d_model), HF_ATTENTION, prefix, (block, "attn"))


def attention_extras(d_model: int, spec: AttentionSpec, prefix: str, block: str) -> list[Tensor]:
    """What the spec adds to the four projections: their biases (`{prefix}self_attn.{q,k,v,o}_proj.bias`:
    Qwen2's q/k/v, gpt-oss's all four), RMSNorms of q and k (`self_attn.{q,k}_norm.weight`: Qwen3,
    Gemma 3, OLMoE), and gpt-oss's sinks (`self_attn.sinks`, one logit a query head)."""
    weights = spec.weights(d_model)
    table = [Tensor(f"{prefix}self_attn.{x}_proj.bias", (math.prod(weights[f"b{x}"].shape),), (block, "attn", f"b{x}"),
                    weights[f"b{x}"].shape) for x in "qkvo" if f"b{x}" in weights]
    if spec.sinks:
        table.append(vector(f"{prefix}self_attn.sinks", (block, "attn", "sinks"), spec.n_head))
    if spec.qk_norm:  # over each head's channels; OLMoE's over the whole projection (no k's where k is another's)
        whole = spec.qk_norm_over == "projection"
        for x, heads in (("q", spec.n_head), ("k", spec.n_kv_head))[:1 if spec.kv_shared else 2]:
            table.append(vector(f"{prefix}self_attn.{x}_norm.weight", (block, "attn", f"{x}_norm", "weight"),
                                spec.head_dim * (heads if whole else 1)))
    return table


def mlp_tensors(d_model: int, spec: GatedMLPSpec, prefix: str, block: str) -> list[Tensor]:
    """A gated MLP's `{prefix}mlp.{gate,up,down}_proj.weight` as `{block}/mlp/w_{gate,up,down}`."""
    return kind_tensors(spec.weights(d_model), HF_MLP, prefix, (block, "mlp"))


def norm_tensor(c: DecoderConfig, hf_key: str, block: str, name: str) -> Tensor:
    """A block's RMSNorm weight over `d_model`, `{block}/{name}/weight`."""
    return vector(hf_key, (block, name, "weight"), c.d_model)


# The features of `DecoderConfig` a family may or may not hold, at their plain (Llama) values.
PLAIN_FEATURES = dict(qkv_bias=False, qk_norm=False, norm_plus_one=False, mlp_activation="silu", embed_scale=False,
                      query_pre_attn_scalar=None, attn_logit_softcap=None, final_logit_softcap=None,
                      post_norms=False, sliding_window=None, local_rope_theta=None, norm_float32_scale=False,
                      layer_scalar=False, per_layer_width=None)
ANY = "any"  # `Family.features`: every value of the field


@dataclasses.dataclass(frozen=True)
class Family:
    """A checkpoint family: one `model_type` of config.json, read and written.

    Attributes:
      model_type: config.json's `model_type`.
      architecture: its `architectures` entry, the transformers class that opens it.
      read: `(hf, max_seq_len) -> DecoderConfig fields`: all of them, with errors naming
        config.json's field (`decoder_fields` for the shared ones).
      write: `config -> config.json fields` of this family, besides `common_hf_fields`.
      layer_tensors: `(config, i) -> [Tensor]`, layer i's tensors (`model.layers.{i}.`).
      features: the values of `PLAIN_FEATURES` fields this format holds, a tuple or `ANY`
        per field; a field not named must have its plain value.
      pairings: the RoPE pairings its checkpoints hold as they are (`save_hf` moves another to
        the first): split-half alone, transformers' only one, but where a family says otherwise.
      ignored: `(config, key) -> bool`, the checkpoint tensors `load_hf` skips (DeepSeek's
        multi-token prediction layers); None: none, every tensor must be the table's.
      model_tensors: `config -> [Tensor]`, the model's own tensors besides the embedding, the
        final norm and the head (Gemma 4's per-layer embeddings); None: none.
    """

    model_type: str
    architecture: str
    read: Callable[[dict, int | None], dict]
    write: Callable[[DecoderConfig], dict]
    layer_tensors: Callable[[DecoderConfig, int], list[Tensor]]
    features: dict = dataclasses.field(default_factory=dict)
    pairings: tuple[str, ...] = ("split_half",)
    ignored: Callable[[DecoderConfig, str], bool] | None = None
    model_tensors: Callable[[DecoderConfig], list[Tensor]] | None = None

    def tensors(self, config: DecoderConfig) -> list[Tensor]:
        """Every tensor of the checkpoint (both directions read this one table)."""
        return outer_tensors(config) + (self.model_tensors(config) if self.model_tensors else []) + [
            t for i in range(config.n_layer) for t in self.layer_tensors(config, i)]

    def check_fits(self, config: DecoderConfig) -> None:
        """A ValueError naming the first feature of `config` this format cannot hold."""
        # (config.json states each layer by its fields: filled specs it would read back otherwise would be lost.)
        if config.layers:
            fields = self.read({**common_hf_fields(config), **self.write(config)}, config.max_seq_len)
            if layer_specs(config.replace(**{"layers": (), **fields})) != layer_specs(config):
                raise ValueError(f"config.layers cannot be written as a {self.model_type} checkpoint (it holds the "
                                 "layers its fields state)")
        for name, plain in PLAIN_FEATURES.items():
            values, value = self.features.get(name, (plain,)), getattr(config, name)
            if values != ANY and value not in values:
                raise ValueError(f"config.{name}={value!r} cannot be written as a {self.model_type} checkpoint "
                                 f"(it holds {' or '.join(map(repr, values))})")
