"""Gemma 4 (`gemma4_text`), and the text model of its image-text checkpoints (`gemma4`).

What Gemma 4 adds to Gemma 3's layout (tied head, embeddings times `sqrt(d_model)`, GeGLU,
sandwich norms, q/k norms, sliding layers at their own RoPE base):

- its norms scale by their weight in float32 (`norm_float32_scale`; the weights start at 1), and
  normalise the values too, without a weight (`AttentionSpec.v_norm`); the scores are not scaled
  (`query_pre_attn_scalar` 1: the q/k norms bound them);
- its global (full) layers have heads of their own width and number (`global_head_dim` and
  `num_global_key_value_heads`, or `per_layer_config`), their RoPE turning only the first
  `partial_rotary_factor` of their pairs ("proportional"), and where `attention_k_eq_v` their
  values are the keys' projection;
- the last `num_kv_shared_layers` layers compute no keys and values: each reads those of the last
  earlier layer of its type (`AttentionSpec.kv_shared`), and its MLP is twice as wide where
  `use_double_wide_mlp`;
- per-layer inputs (`hidden_size_per_layer_input`: `jaxformer.per_layer`) and a scalar per layer;
- where `enable_moe_block`, a mixture of experts beside each layer's MLP
  (`jaxformer.dense_experts`), routed by a softmax's top k, renormalised, times a scale per expert.

The image-text checkpoints (`Gemma4ForConditionalGeneration`, `gemma4`) hold the text model's config as
`text_config` and its tensors under `model.language_model.`: `jaxformer.convert.hf.TEXT_MODELS` reads
that text model as this family's, its vision and audio towers left unread; it is written back as
`gemma4_text`.
"""

from __future__ import annotations

import dataclasses

from jaxformer.config import DecoderConfig
from jaxformer.dense_experts import DenseAndExpertsSpec
from jaxformer.experts import ExpertsSpec
from jaxformer.families.common import (
    ANY,
    HF_MLP,
    Family,
    Tensor,
    attention_extras,
    attention_tensors,
    decoder_fields,
    fail,
    field,
    flag,
    hf_layer_types,
    kind_tensors,
    layer_types,
    linear,
    mlp_tensors,
    norm_tensor,
    positive_int,
    refuse_set,
    rope,
    rope_parameters,
    vector,
)
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.layers import LayerSpec, layer_specs
from jaxformer.validation import finite_float, python_int

# transformers' `Gemma4TextConfig` defaults for the fields a config.json may leave out.
DEFAULTS = {"vocab_size": 262144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6}
LAYER_OVERRIDES = {"head_dim": "head_dim", "num_key_value_heads": "n_kv_head"}  # what per_layer_config may set
TYPES = {"full": "full_attention", "sliding": "sliding_attention"}


def _count(hf: dict, key: str, default: int) -> int:
    """A count that may be 0 (absent or null: `default`)."""
    value = hf.get(key)
    if value is None:
        return default
    if python_int(value) is None or value < 0:
        fail(key, "must be an int >= 0", value)
    return python_int(value)


def _ropes(hf: dict) -> dict:
    """`{attention type: (theta, scaling)}` from `rope_parameters` keyed by layer type (transformers'
    defaults where it is absent: the sliding layers' plain RoPE at 10k, the global layers' proportional
    quarter at 1M)."""
    params = hf.get("rope_parameters")
    if params is None:
        params = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                  "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}
    if not isinstance(params, dict) or not set(params) <= set(TYPES.values()):
        fail("rope_parameters", f"must be an object of {tuple(TYPES.values())}, one RoPE each", params)
    ropes = {}
    for kind, name in TYPES.items():
        given = params.get(name) or {}
        if not isinstance(given, dict):
            fail(f"rope_parameters.{name}", "must be an object", given)
        ropes[kind] = rope(given, f"rope_parameters.{name}", hf, default_theta=1e4 if kind == "sliding" else 1e6)
    if ropes["sliding"][1] is not None:
        fail("rope_parameters.sliding_attention.rope_type", "must be 'default' (the sliding layers are unscaled)",
             ropes["sliding"][1].kind)
    return ropes


def _layer_heads(hf: dict, types: tuple[str, ...], head_dim: int, n_kv_head: int, k_eq_v: bool) -> list[dict]:
    """Each layer's `{"head_dim", "n_kv_head"}`: `per_layer_config`'s overrides where it is given (it
    then rules, as in transformers), else the global layers' `global_head_dim` (512 by default) and,
    with `attention_k_eq_v`, `num_global_key_value_heads`."""
    n = len(types)
    given = hf.get("per_layer_config")
    if given is None:
        wider = {"head_dim": positive_int(hf, "global_head_dim", default=512)}
        kv = positive_int(hf, "num_global_key_value_heads", default=None)
        if k_eq_v and kv is not None:
            wider["num_key_value_heads"] = kv
        overrides = {i: wider for i, kind in enumerate(types) if kind == "full"}
    else:
        rule = (f"an object of layer indices in [0, {n}), each an object of "
                f"{tuple(LAYER_OVERRIDES)} (the only per-layer fields implemented)")
        if not isinstance(given, dict) or not all(
                str(i).isdigit() and int(i) < n and isinstance(o, dict) and set(o) <= set(LAYER_OVERRIDES)
                for i, o in given.items()):
            fail("per_layer_config", f"must be {rule}", given)
        overrides = {int(i): o for i, o in given.items()}
    heads = []
    for i in range(n):
        layer = {"head_dim": head_dim, "num_key_value_heads": n_kv_head, **overrides.get(i, {})}
        for key, value in layer.items():
            if python_int(value) is None or value < 1:
                fail(f"per_layer_config.{i}.{key}", "must be a positive int", value)
        heads.append({ours: layer[theirs] for theirs, ours in LAYER_OVERRIDES.items()})
    for kind in TYPES:  # (transformers makes one RoPE per type, of its layers' one width)
        widths = {h["head_dim"] for h, t in zip(heads, types) if t == kind}
        if len(widths) > 1:
            fail("per_layer_config", f"must give the {TYPES[kind]} layers one head_dim (one RoPE per type)",
                 sorted(widths))
    return heads


def _experts(hf: dict) -> ExpertsSpec:
    """The MoE block's experts: `num_experts` of `moe_intermediate_size`, `top_k_experts` a token, by
    the softmax's top k renormalised, times each expert's scale; no load-balancing loss (transformers'
    Gemma 4 trains with none)."""
    n_experts, top_k = positive_int(hf, "num_experts"), positive_int(hf, "top_k_experts")
    if top_k > n_experts:
        fail("top_k_experts", f"must be at most num_experts={n_experts}", top_k)
    return ExpertsSpec(n_experts, top_k, positive_int(hf, "moe_intermediate_size"), activation="gelu_tanh",
                       routing="softmax_topk", normalize=True, router_norm=True, expert_scale=True, aux_loss_coef=0.0)


def read_gemma4_text(hf: dict, max_seq_len: int | None) -> dict:
    hf = {**DEFAULTS, **hf}
    refuse_set(hf, "hidden_activation", "gelu_pytorch_tanh", "GeGLU with tanh GELU")
    if flag(hf, "attention_bias", False):
        fail("attention_bias", "must be false (Gemma 4's projections with biases are not implemented)", True)
    if hf.get("use_bidirectional_attention") not in (None, "vision"):  # ("vision": only image tokens see ahead)
        fail("use_bidirectional_attention", "must be null or 'vision' (jaxformer's decoder is causal)",
             hf["use_bidirectional_attention"])
    fields = decoder_fields(hf, max_seq_len=max_seq_len, tie_default=True)
    n, n_head = fields["n_layer"], fields["n_head"]
    types = list(layer_types(hf, n, lambda i: "sliding" if (i + 1) % 6 else "full"))
    types[-1] = "full"  # (transformers makes the last layer global, whatever layer_types says)
    ropes = _ropes(hf)
    fields.update(layer_types=tuple(types), rope_theta=ropes["full"][0], rope_scaling=ropes["full"][1],
                  norm_float32_scale=True, mlp_activation="gelu_tanh", embed_scale=True, qk_norm=True,
                  post_norms=True, query_pre_attn_scalar=1.0, layer_scalar=True,
                  final_logit_softcap=field(hf, "final_logit_softcapping", finite_float,
                                            "a finite number > 0 or null", default=None))
    if "sliding" in types:
        fields.update(sliding_window=positive_int(hf, "sliding_window", default=512),
                      local_rope_theta=ropes["sliding"][0])
    width = _count(hf, "hidden_size_per_layer_input", 256)
    if width:
        fields.update(per_layer_width=width,
                      per_layer_vocab_size=positive_int(hf, "vocab_size_per_layer_input", default=262144))

    shared = _count(hf, "num_kv_shared_layers", 0)
    first_shared = n - shared  # the layers from here on read their type's last keys and values
    if first_shared < 1 or not set(types[first_shared:]) <= set(types[:first_shared]):
        fail("num_kv_shared_layers", f"must leave, of num_hidden_layers={n}, a layer of each type the shared "
             "layers are before them, whose keys and values they read", shared)
    k_eq_v = flag(hf, "attention_k_eq_v", False)
    heads = _layer_heads(hf, tuple(types), positive_int(hf, "head_dim"), fields["n_kv_head"], k_eq_v)
    for i, layer in enumerate(heads):
        if n_head % layer["n_kv_head"] or layer["head_dim"] % 2:
            fail(f"per_layer_config.{i}", f"must give heads that divide num_attention_heads={n_head} and an even "
                 "head_dim", layer)
    double = flag(hf, "use_double_wide_mlp", False)
    experts = _experts(hf) if flag(hf, "enable_moe_block", False) else None

    def layer(i: int, derived: LayerSpec) -> LayerSpec:
        mixer = dataclasses.replace(derived.mixer, **heads[i], v_norm=True, k_eq_v=k_eq_v and types[i] == "full",
                                    kv_shared=i >= first_shared)
        dense = GatedMLPSpec(derived.ffn.width * (2 if double and i >= first_shared else 1), "gelu_tanh")
        return dataclasses.replace(derived, mixer=mixer, ffn=dense if experts is None else DenseAndExpertsSpec(
            dense, experts))

    specs = tuple(layer(i, spec) for i, spec in enumerate(layer_specs(DecoderConfig(**fields))))
    for i in range(first_shared, n):  # a shared layer reads its type's last keys and values: of their shape
        source = specs[max(j for j in range(first_shared) if types[j] == types[i])].mixer
        if (source.n_kv_head, source.head_dim) != (specs[i].mixer.n_kv_head, specs[i].mixer.head_dim):
            fail(f"per_layer_config.{i}", "must give a shared layer the heads of the layer whose keys and values it "
                 f"reads ({source.n_kv_head} of {source.head_dim})", heads[i])
    return dict(fields, layers=specs)


def write_gemma4_text(config: DecoderConfig) -> dict:
    c = config
    specs = layer_specs(c)
    if not all(getattr(spec.mixer, "v_norm", False) for spec in specs):
        raise ValueError("config.layers: a gemma4_text checkpoint's attention normalises its values (v_norm) in "
                         "every layer")
    shared = _trailing_shared(specs)
    first = c.n_layer - shared
    full = [spec for spec in specs if spec.mixer.window is None]
    experts = {spec.ffn.experts for spec in specs if isinstance(spec.ffn, DenseAndExpertsSpec)}
    local = c.rope_theta if c.local_rope_theta is None else c.local_rope_theta
    per_layer = {str(i): {theirs: getattr(spec.mixer, ours) for theirs, ours in LAYER_OVERRIDES.items()
                          if getattr(spec.mixer, ours) != getattr(c, ours)}
                 for i, spec in enumerate(specs)}
    fields = {
        "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": c.final_logit_softcap,
        "sliding_window": c.sliding_window, "layer_types": hf_layer_types(c), "attention_bias": False,
        "rope_parameters": {"full_attention": _rope(c.rope_theta, c.rope_scaling),
                            "sliding_attention": rope_parameters(local, None)},
        "per_layer_config": {i: o for i, o in per_layer.items() if o},
        "attention_k_eq_v": any(spec.mixer.k_eq_v for spec in full), "num_kv_shared_layers": shared,
        "use_double_wide_mlp": shared > 0 and _dense(specs[first]).width == 2 * c.ffn_dim,
        "hidden_size_per_layer_input": c.per_layer_width or 0,
        "vocab_size_per_layer_input": c.per_layer_vocab_size or c.vocab_size,
        "enable_moe_block": bool(experts), "use_bidirectional_attention": None}
    if experts:
        spec = experts.pop()
        fields.update(num_experts=spec.n_experts, top_k_experts=spec.top_k, moe_intermediate_size=spec.width)
    return fields


def _trailing_shared(specs) -> int:
    """How many of the last layers read another's keys and values."""
    n = 0
    while n < len(specs) and specs[-1 - n].mixer.kv_shared:
        n += 1
    return n


def _dense(spec: LayerSpec) -> GatedMLPSpec:
    return spec.ffn.dense if isinstance(spec.ffn, DenseAndExpertsSpec) else spec.ffn


def _rope(theta: float, scaling) -> dict:
    """The global layers' `rope_parameters` as transformers writes a proportional RoPE (its factor where not 1)."""
    if scaling is None or scaling.kind != "proportional":
        return rope_parameters(theta, scaling)
    factor = {} if scaling.factor == 1 else {"factor": scaling.factor}
    return {"rope_type": "proportional", "rope_theta": theta, "partial_rotary_factor": scaling.partial_rotary_factor,
            **factor}


def gemma4_layer(c: DecoderConfig, i: int) -> list:
    """Layer i: Gemma 3's four norms and attention (k's projection and norm where it computes its keys, v's
    where its values are not k's), its MLP, or its MLP and experts with their norms, its per-layer input's
    gate, projection and norm, and its scalar."""
    hf, block, spec = f"model.layers.{i}.", f"block_{i}", layer_specs(c)[i]
    d = c.d_model
    table = [norm_tensor(c, hf + "input_layernorm.weight", block, "attn_norm"),
             *attention_tensors(d, spec.mixer, hf, block), *attention_extras(d, spec.mixer, hf, block),
             norm_tensor(c, hf + "post_attention_layernorm.weight", block, "attn_post_norm"),
             norm_tensor(c, hf + "pre_feedforward_layernorm.weight", block, "mlp_norm"),
             norm_tensor(c, hf + "post_feedforward_layernorm.weight", block, "mlp_post_norm"),
             vector(hf + "layer_scalar", (block, "layer_scalar"), 1)]
    if isinstance(spec.ffn, DenseAndExpertsSpec):
        table += moe_tensors(d, spec.ffn, hf, (block, "mlp"))
    else:
        table += mlp_tensors(d, spec.ffn, hf, block)
    if c.per_layer_width:
        P, own = c.per_layer_width, (block, "per_layer")
        table += [linear(hf + "per_layer_input_gate.weight", (*own, "w_gate"), (d, P), P, d),
                  linear(hf + "per_layer_projection.weight", (*own, "w_proj"), (P, d), d, P),
                  vector(hf + "post_per_layer_input_norm.weight", (*own, "norm", "weight"), d)]
    return table


def moe_tensors(d: int, spec: DenseAndExpertsSpec, hf: str, path: tuple[str, ...]) -> list:
    """A layer's MLP (`mlp.*_proj`) and experts beside it: the router (`router.proj`, its `scale` per
    channel and `per_expert_scale`), the experts stacked (`experts.gate_up_proj` `[E, 2F, d]`, the gate's
    rows then up's; `experts.down_proj` `[E, d, F]`), and the norms after the MLP, before and after
    the experts."""
    E, F = spec.experts.n_experts, spec.experts.width
    experts = (*path, "experts")
    gate_up = hf + "experts.gate_up_proj"
    return [*kind_tensors(spec.dense.weights(d), HF_MLP, hf, (*path, "dense")),
            vector(hf + "post_feedforward_layernorm_1.weight", (*path, "dense_post_norm", "weight"), d),
            vector(hf + "pre_feedforward_layernorm_2.weight", (*path, "experts_norm", "weight"), d),
            vector(hf + "post_feedforward_layernorm_2.weight", (*path, "experts_post_norm", "weight"), d),
            linear(hf + "router.proj.weight", (*experts, "router"), (d, E), E, d),
            vector(hf + "router.scale", (*experts, "router_scale"), d),
            vector(hf + "router.per_expert_scale", (*experts, "expert_scale"), E),
            Tensor(gate_up, (E, F, d), (*experts, "w_gate"), (E, d, F), transpose=True, rows=(0, F)),
            Tensor(gate_up, (E, F, d), (*experts, "w_up"), (E, d, F), transpose=True, rows=(F, 2 * F)),
            Tensor(hf + "experts.down_proj", (E, d, F), (*experts, "w_down"), (E, F, d), transpose=True)]


def per_layer_tensors(c: DecoderConfig) -> list:
    """The per-layer inputs' table `embed_tokens_per_layer` `[V', L * P]`, its projection from the
    embedding `per_layer_model_projection` `[L * P, d]` and the norm after it, where the model has them."""
    if not c.per_layer_width:
        return []
    V, L, P, d = c.per_layer_vocab_size or c.vocab_size, c.n_layer, c.per_layer_width, c.d_model
    return [Tensor("model.embed_tokens_per_layer.weight", (V, L * P), ("per_layer_inputs", "embed"), (V, L, P)),
            linear("model.per_layer_model_projection.weight", ("per_layer_inputs", "w_proj"), (d, L, P), L * P, d),
            vector("model.per_layer_projection_norm.weight", ("per_layer_inputs", "norm", "weight"), P)]


GEMMA4_FEATURES = {"embed_scale": (True,), "mlp_activation": ("gelu_tanh",), "qk_norm": (True,), "post_norms": (True,),
                   "query_pre_attn_scalar": (1.0,), "sliding_window": ANY, "local_rope_theta": ANY,
                   "final_logit_softcap": ANY, "norm_float32_scale": (True,), "layer_scalar": (True,),
                   "per_layer_width": ANY}
GEMMA4_TEXT = Family("gemma4_text", "Gemma4ForCausalLM", read_gemma4_text, write_gemma4_text, gemma4_layer,
                     GEMMA4_FEATURES, model_tensors=per_layer_tensors)
