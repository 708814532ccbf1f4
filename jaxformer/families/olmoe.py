"""OLMoE (1B-7B): Llama's layout, RMSNorms of q and of k over the whole projection (all heads'
channels at once, `self_attn.{q,k}_norm.weight` of `n_head * head_dim` and `n_kv_head *
head_dim`), every feed-forward `num_experts` experts of `intermediate_size` routed by a
softmax's top k, not renormalised unless `norm_topk_prob`."""

from __future__ import annotations

import dataclasses

from jaxformer.config import DecoderConfig
from jaxformer.families.common import Family, fail, flag, positive_int
from jaxformer.families.llama import llama_layer, read_plain_llama, write_llama
from jaxformer.families.moe import experts_fields, read_experts, refuse_jitter, with_experts


def read_olmoe(hf: dict, max_seq_len: int | None) -> dict:
    hf = {"rms_norm_eps": 1e-05, **hf}  # transformers' OlmoeConfig default: OLMoE-1B-7B's config.json may not state it
    refuse_jitter(hf)
    if hf.get("clip_qkv") is not None:
        fail("clip_qkv", "must be null (clipping q, k and v is not implemented)", hf["clip_qkv"])
    fields = dict(read_plain_llama(hf, max_seq_len), qk_norm=True)
    experts = read_experts(hf, positive_int(hf, "num_experts"), "intermediate_size",
                           normalize=flag(hf, "norm_topk_prob", False))
    fields = with_experts(fields, experts, [True] * fields["n_layer"])
    return dict(fields, layers=tuple(dataclasses.replace(spec, mixer=dataclasses.replace(
        spec.mixer, qk_norm_over="projection")) for spec in fields["layers"]))


def write_olmoe(config: DecoderConfig) -> dict:
    """Llama's fields; `intermediate_size` is the experts' width."""
    def own(spec):
        return {"norm_topk_prob": spec.normalize}

    return {**write_llama(config), "clip_qkv": None,
            **experts_fields(config, "num_experts", "intermediate_size", own)}


OLMOE = Family("olmoe", "OlmoeForCausalLM", read_olmoe, write_olmoe, llama_layer, {"qk_norm": (True,)})
