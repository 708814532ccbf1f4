"""Mixtral (8x7B, 8x22B): Mistral's attention, every feed-forward `num_local_experts` experts of
`intermediate_size` (`block_sparse_moe.experts.{e}.w1` the gate, `w3` up, `w2` down), routed by
a softmax's top k renormalised, the router `block_sparse_moe.gate`."""

from __future__ import annotations

import functools

from jaxformer.config import DecoderConfig
from jaxformer.families.common import ANY, Family
from jaxformer.families.llama import llama_layer, read_mistral, write_llama, write_window_everywhere
from jaxformer.families.moe import expert_count, experts_fields, read_experts, refuse_jitter, with_experts

NAMES = {"router": "block_sparse_moe.gate", "experts": "block_sparse_moe.experts",
         "w_gate": "w1", "w_up": "w3", "w_down": "w2"}


def read_mixtral(hf: dict, max_seq_len: int | None) -> dict:
    refuse_jitter(hf)
    fields = read_mistral(hf, max_seq_len)
    experts = read_experts(hf, expert_count(hf, "num_local_experts", "num_experts"), "intermediate_size",
                           normalize=True)
    return with_experts(fields, experts, [True] * fields["n_layer"])


def write_mixtral(config: DecoderConfig) -> dict:
    """Mistral's fields; `intermediate_size` is the experts' width."""
    return {**write_llama(config), **write_window_everywhere(config), "router_jitter_noise": 0.0,
            **experts_fields(config, "num_local_experts", "intermediate_size", lambda spec: {})}


MIXTRAL = Family("mixtral", "MixtralForCausalLM", read_mixtral, write_mixtral,
                 functools.partial(llama_layer, names=NAMES), {"sliding_window": ANY})
