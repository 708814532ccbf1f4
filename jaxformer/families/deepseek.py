"""DeepSeek-V3 (and R1, Moonlight: `deepseek_v3`; Kimi K2, whose config.json says `kimi_k2`) and
DeepSeek-V2-Lite (`deepseek_v2`): every layer multi-head latent attention
(`jaxformer.latent_attention`: `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` or one `q_proj`
where `q_lora_rank` is null, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), its
RoPE over the `qk_rope_head_dim` channels (V3: interleaved pairs unless `rope_interleave` is
false; V2: always), YaRN's `mscale_all_dim` scaling the scores. The first `first_k_dense_replace`
layers' feed-forward is a gated MLP of `intermediate_size`; the others' `n_routed_experts` experts
of `moe_intermediate_size` beside `n_shared_experts` shared ones (one gated MLP that many times as
wide). V3 routes by sigmoid scores within the best `topk_group` of `n_group` groups, chosen with
`mlp.gate.e_score_correction_bias`, weighted `routed_scaling_factor` times; V2 by a softmax's
top k (`topk_method` "greedy"; V2's "group_limited_greedy" and its scaled weights are refused).

The shipped V3, R1 and K2 hold FP8 blocks with scales (`quantization_config`), read as shipped
(`jaxformer.convert.hf`, `jaxformer.quantized.from_fp8`). Not read: the multi-token prediction module
(`num_nextn_predict_layers`, the layers after the last, `model.layers.{n}.*`): read and its
tensors skipped, not used as a speculative draft; `save_hf` writes 0 of them.
"""

from __future__ import annotations

import re

from jaxformer.config import DecoderConfig
from jaxformer.experts import ExpertsSpec
from jaxformer.families.common import (
    Family,
    decoder_fields,
    fail,
    field,
    flag,
    kind_tensors,
    mlp_tensors,
    norm_tensor,
    positive_int,
    refuse_set,
    rope_parameters,
    single_rope,
    vector,
)
from jaxformer.families.moe import experts_fields, experts_tensors, read_experts
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttentionSpec
from jaxformer.layers import LayerSpec, layer_specs
from jaxformer.validation import finite_float, python_int

# The latent attention's matrices by checkpoint name (after `model.layers.{i}.`), those its spec holds.
HF_LATENT = {"wq": "self_attn.q_proj", "wq_a": "self_attn.q_a_proj", "wq_b": "self_attn.q_b_proj",
             "wkv_a": "self_attn.kv_a_proj_with_mqa", "wkv_b": "self_attn.kv_b_proj", "wo": "self_attn.o_proj"}
NAMES = {"router": "mlp.gate", "experts": "mlp.experts", "shared": "mlp.shared_experts", "shared_gate": None,
         "w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def count(hf: dict, key: str, default: int) -> int:
    """An int >= 0 field (0 allowed, unlike `positive_int`)."""
    value = hf.get(key)
    if value is None:
        return default
    if python_int(value) is None or python_int(value) < 0:
        fail(key, "must be an int >= 0", value)
    return python_int(value)


def _refusals(hf: dict, v3: bool) -> None:
    refuse_set(hf, "hidden_act", "silu", "the SwiGLU gate must be silu")
    if flag(hf, "attention_bias", False):
        fail("attention_bias", "must be false (the latent projections' biases are not implemented)", True)
    refuse_set(hf, "moe_layer_freq", 1, "every layer from first_k_dense_replace on is experts (transformers' rule)")
    refuse_set(hf, "scoring_func", "sigmoid" if v3 else "softmax", "the router's scores as transformers computes them")
    refuse_set(hf, "topk_method", "noaux_tc" if v3 else "greedy",
               "the router's choice as transformers computes it" + ("" if v3 else " (group_limited_greedy, "
                                                                     "DeepSeek-V2's, is not implemented)"))


def _latent(hf: dict, theta: float, scaling, pairing: str) -> LatentAttentionSpec:
    q_lora_rank = hf.get("q_lora_rank")
    return LatentAttentionSpec(
        n_head=positive_int(hf, "num_attention_heads"),
        q_lora_rank=None if q_lora_rank is None else positive_int(hf, "q_lora_rank"),
        kv_lora_rank=positive_int(hf, "kv_lora_rank"), qk_nope_head_dim=positive_int(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=positive_int(hf, "qk_rope_head_dim"), v_head_dim=positive_int(hf, "v_head_dim"),
        rope_theta=theta, rope_scaling=scaling, rope_pairing=pairing)


def _experts(hf: dict, v3: bool) -> ExpertsSpec:
    shared = positive_int(hf, "n_shared_experts") * positive_int(hf, "moe_intermediate_size")
    n_experts = positive_int(hf, "n_routed_experts")
    if v3:
        scale = field(hf, "routed_scaling_factor", finite_float, "a finite number > 0", default=1.0)
        return read_experts(hf, n_experts, "moe_intermediate_size", normalize=flag(hf, "norm_topk_prob", False),
                            routing="sigmoid_grouped", n_group=positive_int(hf, "n_group", default=1),
                            topk_group=positive_int(hf, "topk_group", default=1), routed_scale=scale,
                            shared_width=shared)
    refuse_set(hf, "routed_scaling_factor", 1.0, "a softmax router's weights scaled are not implemented")
    # (transformers' V2 router never renormalises, whatever norm_topk_prob says; DeepSeek's own code does)
    refuse_set(hf, "norm_topk_prob", False, "transformers' DeepseekV2 ignores it and DeepSeek's code does not")
    return read_experts(hf, n_experts, "moe_intermediate_size", normalize=False, shared_width=shared)


def read_deepseek(hf: dict, max_seq_len: int | None, v3: bool = True) -> dict:
    """DeepSeek-V3's fields (V2's with `v3=False`): every layer's `LayerSpec` filled in."""
    _refusals(hf, v3)
    count(hf, "num_nextn_predict_layers", 0)  # (read: its tensors, the layers past the last, are skipped)
    theta, scaling = single_rope(hf)
    interleaved = flag(hf, "rope_interleave", True) if v3 else True  # (V2's complex pairs: always interleaved)
    pairing = "interleaved" if interleaved else "split_half"
    # (`head_dim` is transformers' qk_rope_head_dim: the latent spec states every width itself)
    fields = dict(decoder_fields({k: v for k, v in hf.items() if k != "head_dim"}, max_seq_len=max_seq_len,
                                 tie_default=False),
                  rope_theta=theta, rope_scaling=scaling, rope_pairing=pairing)
    n_layer = fields["n_layer"]
    dense_layers = count(hf, "first_k_dense_replace", 3 if v3 else 0)
    if dense_layers > n_layer:
        fail("first_k_dense_replace", f"must be at most num_hidden_layers={n_layer}", dense_layers)
    mixer = _latent(hf, theta, scaling, pairing)
    dense, experts = GatedMLPSpec(fields["d_ff"]), _experts(hf, v3) if dense_layers < n_layer else None
    return dict(fields, layers=tuple(LayerSpec(mixer, dense if i < dense_layers else experts) for i in range(n_layer)))


def read_deepseek_v2(hf: dict, max_seq_len: int | None) -> dict:
    return read_deepseek(hf, max_seq_len, v3=False)


def latent_of(config: DecoderConfig) -> LatentAttentionSpec:
    """The one `LatentAttentionSpec` of every layer (config.json states one for all); a ValueError otherwise."""
    specs = {spec.mixer for spec in layer_specs(config)}
    if len(specs) != 1 or not isinstance(next(iter(specs)), LatentAttentionSpec):
        raise ValueError(f"config.layers must hold one LatentAttentionSpec for every layer, as a "
                         f"{config.hf_model_type} config.json states it")
    return specs.pop()


def write_deepseek(config: DecoderConfig) -> dict:
    """Both families' fields. The dense layers must come first; the shared experts' width a multiple
    of the experts'; V2's RoPE interleaved (it has no other)."""
    mixer, specs = latent_of(config), layer_specs(config)
    dense = [isinstance(spec.ffn, GatedMLPSpec) for spec in specs]
    first = dense.index(False) if False in dense else len(dense)
    if any(dense[first:]):
        raise ValueError("config.layers: a deepseek checkpoint's dense layers are its first ones "
                         "(first_k_dense_replace), then every layer is experts")
    v3 = config.hf_model_type != "deepseek_v2"
    if not v3 and mixer.rope_pairing != "interleaved":
        raise ValueError("config.rope_pairing must be 'interleaved' for a deepseek_v2 checkpoint (its only pairing)")

    def own(spec: ExpertsSpec) -> dict:
        if spec.shared_width is None or spec.shared_width % spec.width:
            raise ValueError(f"config.layers: a deepseek checkpoint's shared experts are n_shared_experts times the "
                             f"experts' width {spec.width} (got {spec.shared_width})")
        routing = (dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=spec.n_group,
                        topk_group=spec.topk_group, norm_topk_prob=spec.normalize) if v3 else
                   dict(scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False))
        return {"n_shared_experts": spec.shared_width // spec.width, "routed_scaling_factor": spec.routed_scale,
                "moe_layer_freq": 1, **routing}

    experts = experts_fields(config, "n_routed_experts", "moe_intermediate_size", own) if first < len(dense) else {}
    return {"hidden_act": "silu", "rope_parameters": rope_parameters(mixer.rope_theta, mixer.rope_scaling),
            **({"rope_interleave": mixer.rope_pairing == "interleaved"} if v3 else {}),
            "attention_bias": False, "q_lora_rank": mixer.q_lora_rank, "kv_lora_rank": mixer.kv_lora_rank,
            "qk_nope_head_dim": mixer.qk_nope_head_dim, "qk_rope_head_dim": mixer.qk_rope_head_dim,
            "v_head_dim": mixer.v_head_dim, "head_dim": mixer.qk_rope_head_dim, "first_k_dense_replace": first,
            "num_nextn_predict_layers": 0, **experts}


def deepseek_layer(c: DecoderConfig, i: int) -> list:
    """Layer i: its norms, the latent attention's matrices and norms, a gated MLP or the experts
    (their router, correction bias and shared experts)."""
    hf, block, spec = f"model.layers.{i}.", f"block_{i}", layer_specs(c)[i]
    weights, mixer = spec.mixer.weights(c.d_model), spec.mixer
    table = [norm_tensor(c, hf + "input_layernorm.weight", block, "attn_norm"),
             *kind_tensors(weights, {k: v for k, v in HF_LATENT.items() if k in weights}, hf, (block, "attn")),
             vector(hf + "self_attn.kv_a_layernorm.weight", (block, "attn", "kv_a_norm", "weight"), mixer.kv_lora_rank),
             norm_tensor(c, hf + "post_attention_layernorm.weight", block, "mlp_norm")]
    if mixer.q_lora_rank is not None:
        table.append(vector(hf + "self_attn.q_a_layernorm.weight", (block, "attn", "q_a_norm", "weight"),
                            mixer.q_lora_rank))
    if isinstance(spec.ffn, ExpertsSpec):
        return table + experts_tensors(c.d_model, spec.ffn, hf, block, NAMES)
    return table + mlp_tensors(c.d_model, spec.ffn, hf, block)


def prediction_layers(config: DecoderConfig, key: str) -> bool:
    """Whether `key` is a tensor of the multi-token prediction module: the layers past the last
    (`model.layers.{n_layer + j}.*`, `num_nextn_predict_layers` of them), skipped."""
    found = re.match(r"model\.layers\.(\d+)\.", key)
    return found is not None and int(found.group(1)) >= config.n_layer


def _family(model_type: str, read) -> Family:
    architecture = "DeepseekV2ForCausalLM" if model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"
    return Family(model_type, architecture, read, write_deepseek, deepseek_layer,
                  pairings=("interleaved",) if model_type == "deepseek_v2" else ("interleaved", "split_half"),
                  ignored=prediction_layers)


DEEPSEEK_V3 = _family("deepseek_v3", read_deepseek)
KIMI_K2 = _family("kimi_k2", read_deepseek)  # (Kimi K2's config.json: DeepSeek-V3's fields under its own name)
DEEPSEEK_V2 = _family("deepseek_v2", read_deepseek_v2)
