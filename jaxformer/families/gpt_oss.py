"""gpt-oss (20b, 120b), in bfloat16: every layer attention with sinks (`self_attn.sinks`, a
logit per query head in the softmax's denominator) and biases on q, k, v and o, sliding over
128 positions and full by turns (`layer_types`), YaRN; every feed-forward experts routed by
the top k of the router's logits (with a bias) and a softmax over those k, each expert's
products with biases and the clamped SwiGLU `(clip(up, -L, L) + 1) * g sigmoid(1.702 g)`, `g =
min(gate, L)`. The experts are stored stacked: `mlp.experts.gate_up_proj` `[E, d_model, 2F]`,
the gate at even columns and up at odd, `down_proj` `[E, F, d_model]`, and their biases.

The checkpoints openai ships hold the experts in MXFP4 (`quantization_config`), read as shipped
(`jaxformer.convert.hf`, `jaxformer.quantized.from_mxfp4`)."""

from __future__ import annotations

import dataclasses

from jaxformer.config import DecoderConfig
from jaxformer.families.common import (
    ANY,
    Family,
    Tensor,
    attention_extras,
    attention_tensors,
    decoder_fields,
    field,
    flag,
    hf_layer_types,
    layer_types,
    linear,
    norm_tensor,
    positive_int,
    rope_parameters,
    single_rope,
    vector,
)
from jaxformer.families.moe import expert_count, experts_fields, read_experts, with_experts
from jaxformer.layers import layer_specs
from jaxformer.validation import finite_float


def read_gpt_oss(hf: dict, max_seq_len: int | None) -> dict:
    theta, scaling = single_rope(hf)
    bias = flag(hf, "attention_bias", True)
    fields = dict(decoder_fields(hf, max_seq_len=max_seq_len, tie_default=False), rope_theta=theta,
                  rope_scaling=scaling, qkv_bias=bias)
    n = fields["n_layer"]
    types = layer_types(hf, n, lambda i: "sliding" if (i + 1) % 2 else "full")  # transformers' default: even slide
    if "sliding" in types:
        fields.update(sliding_window=positive_int(hf, "sliding_window"), layer_types=types)
    limit = field(hf, "swiglu_limit", finite_float, "a finite number > 0", default=7.0)
    alpha = field(hf, "swiglu_alpha", finite_float, "a finite number > 0", default=1.702)
    experts = read_experts(hf, expert_count(hf, "num_local_experts", "num_experts"), "intermediate_size",
                           normalize=True, routing="topk_softmax", activation="clamped_swiglu", router_bias=True,
                           expert_bias=True, swiglu_limit=limit, swiglu_alpha=alpha)
    fields = with_experts(fields, experts, [True] * n)
    return dict(fields, layers=tuple(dataclasses.replace(spec, mixer=dataclasses.replace(
        spec.mixer, sinks=True, o_bias=bias)) for spec in fields["layers"]))


def write_gpt_oss(config: DecoderConfig) -> dict:
    def own(spec):
        return {"swiglu_limit": spec.swiglu_limit, "swiglu_alpha": spec.swiglu_alpha}

    return {"hidden_act": "silu", "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),
            "attention_bias": config.qkv_bias, "sliding_window": config.sliding_window,
            "layer_types": hf_layer_types(config),
            **experts_fields(config, "num_local_experts", "intermediate_size", own)}


def gpt_oss_layer(c: DecoderConfig, i: int) -> list:
    """Layer i: norms, attention (its biases and sinks), the router and its bias, and the experts'
    stacked tensors, `gate_up_proj`'s even columns the gate and odd ones up."""
    spec = layer_specs(c)[i]
    hf, block, experts = f"model.layers.{i}.", f"block_{i}", spec.ffn
    E, F, d = experts.n_experts, experts.width, c.d_model
    mlp = (block, "mlp")
    gate_up, gate_up_bias = hf + "mlp.experts.gate_up_proj", hf + "mlp.experts.gate_up_proj_bias"
    return [norm_tensor(c, hf + "input_layernorm.weight", block, "attn_norm"),
            *attention_tensors(d, spec.mixer, hf, block), *attention_extras(d, spec.mixer, hf, block),
            norm_tensor(c, hf + "post_attention_layernorm.weight", block, "mlp_norm"),
            linear(hf + "mlp.router.weight", (*mlp, "router"), (d, E), E, d),
            vector(hf + "mlp.router.bias", (*mlp, "router_bias"), E),
            Tensor(gate_up, (E, d, F), (*mlp, "w_gate"), (E, d, F), columns=(0, 2)),
            Tensor(gate_up, (E, d, F), (*mlp, "w_up"), (E, d, F), columns=(1, 2)),
            Tensor(gate_up_bias, (E, F), (*mlp, "b_gate"), (E, F), columns=(0, 2)),
            Tensor(gate_up_bias, (E, F), (*mlp, "b_up"), (E, F), columns=(1, 2)),
            Tensor(hf + "mlp.experts.down_proj", (E, F, d), (*mlp, "w_down"), (E, F, d)),
            Tensor(hf + "mlp.experts.down_proj_bias", (E, d), (*mlp, "b_down"), (E, d))]


GPT_OSS = Family("gpt_oss", "GptOssForCausalLM", read_gpt_oss, write_gpt_oss, gpt_oss_layer,
                 {"qkv_bias": ANY, "sliding_window": ANY})
