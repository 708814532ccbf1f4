"""Qwen3: Qwen2's layout without biases, with an RMSNorm over each head's q and k before RoPE
(`q_norm`, `k_norm`); `head_dim` is its own field, not `hidden_size / heads`."""

from __future__ import annotations

from jaxformer.config import DecoderConfig
from jaxformer.families.common import ANY, Family
from jaxformer.families.llama import llama_layer, qwen_window, read_llama, write_qwen_window, write_rope


def read_qwen3(hf: dict, max_seq_len: int | None) -> dict:
    fields = dict(read_llama(hf, max_seq_len), qk_norm=True)  # (its attention_bias would add q/k/v/o biases)
    return dict(fields, **qwen_window(hf, fields["n_layer"]))


def write_qwen3(config: DecoderConfig) -> dict:
    return {**write_rope(config), "attention_bias": False, **write_qwen_window(config)}


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", read_qwen3, write_qwen3, llama_layer,
               {"qk_norm": (True,), "sliding_window": ANY})
