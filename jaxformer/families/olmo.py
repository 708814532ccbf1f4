"""OLMo 2 and OLMo 3: Llama's tensors less its input norms, each sublayer's output normalised
before the sum (`x + norm(attn(x))`, `x + norm(mlp(x))`: the "post" placement, its norms
`post_attention_layernorm` and `post_feedforward_layernorm`), and RMSNorms of q and of k over the
whole projection (`self_attn.{q,k}_norm.weight` of `n_head * head_dim` and `n_kv_head * head_dim`,
as OLMoE's). OLMo 3 slides three layers of four (`layer_types`, over `sliding_window`), and its
RoPE is per layer type (`rope_parameters.full_attention`, `.sliding_attention`): the 7B and 32B
ship YaRN on the full layers alone."""

from __future__ import annotations

import dataclasses

from jaxformer.config import DecoderConfig
from jaxformer.families.common import (
    ANY,
    HF_LAYER_TYPES,
    Family,
    attention_extras,
    attention_tensors,
    decoder_fields,
    fail,
    flag,
    hf_layer_types,
    layer_types,
    mlp_tensors,
    norm_tensor,
    positive_int,
    refuse_set,
    refuse_sliding,
    rope,
    rope_parameters,
    single_rope,
)
from jaxformer.layers import layer_specs

OLMO3_THETA = 500000.0  # Olmo3Config's RoPE base where config.json names none


def _shared(hf: dict, max_seq_len: int | None) -> dict:
    """What OLMo 2 and 3 read alike: the sizes, SwiGLU without biases, the q/k norms."""
    hf = {"rms_norm_eps": 1e-05, **hf}  # transformers' Olmo2Config and Olmo3Config default
    refuse_set(hf, "hidden_act", "silu", "the SwiGLU gate must be silu")
    if flag(hf, "attention_bias", False):
        fail("attention_bias", "must be false (q/k/v/o biases are not implemented for OLMo)", True)
    return dict(decoder_fields(hf, max_seq_len=max_seq_len, tie_default=False), qk_norm=True)


def _olmo_layers(fields: dict) -> dict:
    """`fields` with each layer filled in as they state it, its norms after each sublayer and its q/k
    norms over the whole projection."""
    derived = layer_specs(DecoderConfig(**fields))
    return dict(fields, layers=tuple(dataclasses.replace(spec, norms="post", mixer=dataclasses.replace(
        spec.mixer, qk_norm_over="projection")) for spec in derived))


def read_olmo2(hf: dict, max_seq_len: int | None) -> dict:
    refuse_sliding(hf)
    theta, scaling = single_rope(hf)
    return _olmo_layers(dict(_shared(hf, max_seq_len), rope_theta=theta, rope_scaling=scaling))


def _olmo3_rope(hf: dict) -> tuple[tuple, tuple]:
    """`((theta, scaling), (sliding theta, sliding scaling))`: from `rope_parameters` keyed by layer
    type, or the older `rope_theta` and `rope_scaling`, the full layers' alone (transformers rotates
    the sliding layers at 500000 then, unscaled, whatever `rope_theta` says: refused unless it says so)."""
    params = hf.get("rope_parameters")
    if params is None:
        full = single_rope(hf, default_theta=OLMO3_THETA)
        if full[0] != OLMO3_THETA:
            fail("rope_theta", f"must be {OLMO3_THETA:g}, where transformers rotates olmo3's sliding layers (or "
                 "state both in rope_parameters, per layer type)", hf["rope_theta"])
        return full, (OLMO3_THETA, None)
    if not (isinstance(params, dict) and params and set(params) <= set(HF_LAYER_TYPES)):
        fail("rope_parameters", f"must be keyed by layer type, {tuple(HF_LAYER_TYPES)} (transformers ignores a "
             "flat one for olmo3)", params)
    return tuple(rope(params.get(kind) or {}, f"rope_parameters.{kind}", hf, default_theta=OLMO3_THETA)
                 for kind in ("full_attention", "sliding_attention"))


def read_olmo3(hf: dict, max_seq_len: int | None) -> dict:
    (theta, scaling), local = _olmo3_rope(hf)
    fields = dict(_shared(hf, max_seq_len), rope_theta=theta, rope_scaling=scaling)
    types = layer_types(hf, fields["n_layer"], lambda i: "sliding" if (i + 1) % 4 else "full")
    if "sliding" in types:
        if "sliding_window" in hf and hf["sliding_window"] is None:
            fail("sliding_window", "must be a positive int where a layer_types entry is 'sliding_attention'", None)
        fields.update(layer_types=types, sliding_window=positive_int(hf, "sliding_window", default=4096))
        if local != (theta, scaling):  # the sliding layers' own RoPE: a base of their own, unscaled
            if local[1] is not None:
                fail("rope_parameters.sliding_attention.rope_type", "must be 'default', or the full layers' RoPE",
                     local[1].kind)
            fields.update(local_rope_theta=local[0])
    return _olmo_layers(fields)


def write_olmo2(config: DecoderConfig) -> dict:
    return {"hidden_act": "silu", "attention_bias": False,
            "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling)}


def write_olmo3(config: DecoderConfig) -> dict:
    c = config
    local = (c.rope_theta, c.rope_scaling) if c.local_rope_theta is None else (c.local_rope_theta, None)
    return {"hidden_act": "silu", "attention_bias": False, "sliding_window": c.sliding_window,
            "layer_types": hf_layer_types(c),
            "rope_parameters": {"full_attention": rope_parameters(c.rope_theta, c.rope_scaling),
                                "sliding_attention": rope_parameters(*local)}}


def olmo_layer(c: DecoderConfig, i: int) -> list:
    """Layer i: q/k/v/o and their norms, the norm after attention, the MLP, the norm after it."""
    hf, block, spec = f"model.layers.{i}.", f"block_{i}", layer_specs(c)[i]
    return [*attention_tensors(c.d_model, spec.mixer, hf, block),
            norm_tensor(c, hf + "post_attention_layernorm.weight", block, "attn_post_norm"),
            *mlp_tensors(c.d_model, spec.ffn, hf, block),
            norm_tensor(c, hf + "post_feedforward_layernorm.weight", block, "mlp_post_norm"),
            *attention_extras(c.d_model, spec.mixer, hf, block)]


OLMO2 = Family("olmo2", "Olmo2ForCausalLM", read_olmo2, write_olmo2, olmo_layer, {"qk_norm": (True,)})
OLMO3 = Family("olmo3", "Olmo3ForCausalLM", read_olmo3, write_olmo3, olmo_layer,
               {"qk_norm": (True,), "sliding_window": ANY, "local_rope_theta": ANY})
