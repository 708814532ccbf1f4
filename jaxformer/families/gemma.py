"""Gemma 1, 2 and 3 (`gemma`, `gemma2`, `gemma3_text`).

All three: RMSNorm scaling by `1 + weight` in float32, GeGLU with tanh GELU, embeddings
times `sqrt(d_model)`, a tied head. Gemma 2 adds scores scaled by `query_pre_attn_scalar`,
soft-capped scores and logits, a norm after each sublayer (`x + norm(f(norm(x)))`), and
alternating sliding (even layers) and full layers. Gemma 3 drops the score cap, adds q/k
norms, and slides five layers of six, rotating them at its local base frequency.
"""

from __future__ import annotations

from jaxformer.config import DecoderConfig
from jaxformer.families.common import (
    ANY,
    Family,
    attention_extras,
    attention_tensors,
    decoder_fields,
    fail,
    field,
    flag,
    hf_layer_types,
    layer_types,
    mlp_tensors,
    norm_tensor,
    positive_int,
    refuse_sliding,
    rope,
    rope_parameters,
    single_rope,
)
from jaxformer.families.llama import llama_layer
from jaxformer.layers import layer_specs
from jaxformer.validation import finite_float

GEMMA_FEATURES = {"norm_plus_one": (True,), "mlp_activation": ("gelu_tanh",), "embed_scale": (True,)}
GELU_TANH = ("gelu_pytorch_tanh", "gelu")  # Gemma 1 ships "gelu", which transformers reads as the tanh form


def _activation(hf: dict, key: str, accepted: tuple[str, ...]) -> None:
    value = hf.get(key)
    if value is not None and value not in accepted:
        fail(key, f"must be one of {accepted} (GeGLU with tanh GELU)", value)


def _shared(hf: dict, max_seq_len: int | None) -> dict:
    return dict(decoder_fields(hf, max_seq_len=max_seq_len, tie_default=True), norm_plus_one=True,
                mlp_activation="gelu_tanh", embed_scale=True)


def read_gemma(hf: dict, max_seq_len: int | None) -> dict:
    _activation(hf, "hidden_act", GELU_TANH)
    refuse_sliding(hf)
    theta, scaling = single_rope(hf)
    return dict(_shared(hf, max_seq_len), rope_theta=theta, rope_scaling=scaling)


def _cap(hf: dict, key: str, default: float | None) -> float | None:
    """A soft-cap: absent takes transformers' default, null none."""
    if key not in hf:
        return default
    return field(hf, key, finite_float, "a finite number > 0 or null", default=None)


def _windowed(hf: dict, fields: dict, pattern: int) -> dict:
    """Layers sliding over `sliding_window` (default 4096) as `layer_types` says, or as
    `(i + 1) % pattern != 0` when it is absent."""
    types = layer_types(hf, fields["n_layer"], lambda i: "sliding" if (i + 1) % pattern else "full")
    if "sliding" not in types:
        return fields
    return dict(fields, layer_types=types, sliding_window=positive_int(hf, "sliding_window", default=4096))


def _gemma2_style(hf: dict, max_seq_len: int | None) -> dict:
    """What Gemma 2 and 3 share: the activation field, the score scale, the final cap, post-norms."""
    _activation(hf, "hidden_activation", ("gelu_pytorch_tanh",))
    return dict(_shared(hf, max_seq_len), post_norms=True,
                query_pre_attn_scalar=field(hf, "query_pre_attn_scalar", finite_float, "a finite number > 0",
                                            default=256))


def read_gemma2(hf: dict, max_seq_len: int | None) -> dict:
    theta, scaling = single_rope(hf)
    fields = dict(_gemma2_style(hf, max_seq_len), rope_theta=theta, rope_scaling=scaling,
                  attn_logit_softcap=_cap(hf, "attn_logit_softcapping", 50.0),
                  final_logit_softcap=_cap(hf, "final_logit_softcapping", 30.0))
    return _windowed(hf, fields, 2)


def _gemma3_rope(hf: dict) -> tuple[float, object, float]:
    """`(theta, scaling, local_theta)`: from `rope_parameters` keyed by layer type
    (transformers >= 5), or the older `rope_theta`, `rope_scaling` (full layers only) and
    `rope_local_base_freq`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(params):
        where = "rope_parameters"
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        theta, scaling = rope(full, f"{where}.full_attention", hf, default_theta=1e6)
        local_theta, local_scaling = rope(local, f"{where}.sliding_attention", hf, default_theta=1e4)
        if local_scaling is not None:
            fail(f"{where}.sliding_attention.rope_type", "must be 'default' (local layers are unscaled)",
                 local_scaling.kind)
        return theta, scaling, local_theta
    theta, scaling = single_rope(hf, default_theta=1e6)
    return theta, scaling, field(hf, "rope_local_base_freq", finite_float, "a finite number > 0", default=1e4)


def read_gemma3(hf: dict, max_seq_len: int | None) -> dict:
    if flag(hf, "use_bidirectional_attention", False):
        fail("use_bidirectional_attention", "must be false (jaxformer's decoder is causal)", True)
    # (attn_logit_softcapping is stored by transformers' Gemma 3 but never applied: it is not read here either.)
    theta, scaling, local_theta = _gemma3_rope(hf)
    pattern = positive_int(hf, "sliding_window_pattern", default=6)
    fields = dict(_gemma2_style(hf, max_seq_len), rope_theta=theta, rope_scaling=scaling, qk_norm=True,
                  final_logit_softcap=_cap(hf, "final_logit_softcapping", None))
    fields = _windowed(hf, fields, pattern)
    return dict(fields, local_rope_theta=local_theta) if "sliding_window" in fields else fields


def write_gemma(config: DecoderConfig) -> dict:
    return {"hidden_act": "gelu_pytorch_tanh", "rope_parameters": rope_parameters(config.rope_theta,
                                                                                   config.rope_scaling)}


def _write_gemma2_style(config: DecoderConfig) -> dict:
    c = config
    scalar = c.head_dim if c.query_pre_attn_scalar is None else c.query_pre_attn_scalar
    scalar = int(scalar) if float(scalar).is_integer() else scalar  # transformers wants an int where it is one
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": c.final_logit_softcap, "sliding_window": c.sliding_window,
            "layer_types": hf_layer_types(c)}


def write_gemma2(config: DecoderConfig) -> dict:
    return {**_write_gemma2_style(config), "attn_logit_softcapping": config.attn_logit_softcap,
            "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling)}


def write_gemma3(config: DecoderConfig) -> dict:
    c = config
    local = c.rope_theta if c.local_rope_theta is None else c.local_rope_theta
    if c.local_rope_theta is None and c.rope_scaling is not None and "sliding" in c.attention_types:
        raise ValueError("config.local_rope_theta=None: a gemma3_text checkpoint's sliding layers are unscaled, so "
                         "they cannot rotate with rope_scaling as the full layers do")
    return {**_write_gemma2_style(c), "attn_logit_softcapping": None,
            "rope_parameters": {"full_attention": rope_parameters(c.rope_theta, c.rope_scaling),
                                "sliding_attention": rope_parameters(local, None)}}


def gemma2_layer(c: DecoderConfig, i: int) -> list:
    """Layer i with its four norms: before and after attention, before and after the MLP (and Gemma 3's q/k norms)."""
    hf, block, spec = f"model.layers.{i}.", f"block_{i}", layer_specs(c)[i]
    return [norm_tensor(c, hf + "input_layernorm.weight", block, "attn_norm"),
            *attention_tensors(c.d_model, spec.mixer, hf, block),
            norm_tensor(c, hf + "post_attention_layernorm.weight", block, "attn_post_norm"),
            norm_tensor(c, hf + "pre_feedforward_layernorm.weight", block, "mlp_norm"),
            *mlp_tensors(c.d_model, spec.ffn, hf, block),
            norm_tensor(c, hf + "post_feedforward_layernorm.weight", block, "mlp_post_norm"),
            *attention_extras(c.d_model, spec.mixer, hf, block)]


GEMMA2_FEATURES = {**GEMMA_FEATURES, "post_norms": (True,), "query_pre_attn_scalar": ANY, "sliding_window": ANY,
                   "final_logit_softcap": ANY}
GEMMA = Family("gemma", "GemmaForCausalLM", read_gemma, write_gemma, llama_layer, GEMMA_FEATURES)
GEMMA2 = Family("gemma2", "Gemma2ForCausalLM", read_gemma2, write_gemma2, gemma2_layer,
                {**GEMMA2_FEATURES, "attn_logit_softcap": ANY})
GEMMA3 = Family("gemma3_text", "Gemma3ForCausalLM", read_gemma3, write_gemma3, gemma2_layer,
                {**GEMMA2_FEATURES, "qk_norm": (True,), "local_rope_theta": ANY})
