"""Qwen3-MoE (30B-A3B, 235B-A22B) and Qwen1.5/Qwen2-MoE: Qwen3's and Qwen2's attention, their
feed-forwards experts (`mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`) on every
`decoder_sparse_step`-th layer but `mlp_only_layers`, dense ones of `intermediate_size` there.
Qwen2-MoE adds a shared expert beside the routed ones, scaled by a sigmoid gate; both route by
a softmax's top k, renormalised where `norm_topk_prob` says."""

from __future__ import annotations

from jaxformer.config import DecoderConfig
from jaxformer.families.common import ANY, Family, flag, positive_int
from jaxformer.families.llama import llama_layer, read_llama, write_rope
from jaxformer.families.moe import (
    expert_count,
    experts_fields,
    qwen_sparse,
    read_experts,
    refuse_sliding_window,
    with_experts,
    write_qwen_sparse,
)


def read_qwen3_moe(hf: dict, max_seq_len: int | None) -> dict:
    refuse_sliding_window(hf)
    fields = dict(read_llama(hf, max_seq_len), qk_norm=True)
    experts = read_experts(hf, expert_count(hf, "num_experts", "num_local_experts"), "moe_intermediate_size",
                           normalize=flag(hf, "norm_topk_prob", False))
    return with_experts(fields, experts, qwen_sparse(hf, fields["n_layer"]))


def read_qwen2_moe(hf: dict, max_seq_len: int | None) -> dict:
    refuse_sliding_window(hf)
    fields = dict(read_llama(hf, max_seq_len), qkv_bias=flag(hf, "qkv_bias", True))
    experts = read_experts(hf, positive_int(hf, "num_experts"), "moe_intermediate_size",
                           normalize=flag(hf, "norm_topk_prob", False),
                           shared_width=positive_int(hf, "shared_expert_intermediate_size"), shared_gate=True)
    return with_experts(fields, experts, qwen_sparse(hf, fields["n_layer"]))


def write_qwen_moe(config: DecoderConfig) -> dict:
    """Both families' fields: Qwen3-MoE's `num_experts` as shipped (transformers 5 names it
    `num_local_experts` and reads either), Qwen2-MoE's shared expert's width."""
    def own(spec):
        shared = {} if spec.shared is None else {"shared_expert_intermediate_size": spec.shared.width}
        return {"norm_topk_prob": spec.normalize, **shared}

    qwen2 = config.hf_model_type == "qwen2_moe"
    return {**write_rope(config), "use_sliding_window": False, "sliding_window": None, **write_qwen_sparse(config),
            **experts_fields(config, "num_experts", "moe_intermediate_size", own),
            **({"qkv_bias": config.qkv_bias} if qwen2 else {"attention_bias": False})}


QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", read_qwen3_moe, write_qwen_moe, llama_layer,
                   {"qk_norm": (True,)})
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", read_qwen2_moe, write_qwen_moe, llama_layer,
                   {"qkv_bias": ANY})
