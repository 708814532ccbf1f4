"""What a row's cache holds a token and a layer at a long context, from the shapes alone (nothing
is allocated): DeepSeek-V3's latent cache against its heads expanded as a GQA cache would keep them,
and Qwen3.5-9B's hybrid cache (24 Gated DeltaNet layers' states, 8 full-attention layers' keys and
values) against the same shape with every layer full attention.

    python -m benchmarks.cache_bytes [--context 32768] [--dtype bfloat16]

The configs are the shipped config.json's architecture fields, read by `jaxformer.convert.config_from_hf`;
the cache's bytes are `KVCache.create`'s (under `jax.eval_shape`: shapes, no memory), checked against
`jaxformer.memory.cache_entry_bytes` of each layer's `cache_entry`, which also sizes the caches too
large to create here (DeepSeek-V3 expanded: 164 GB a row at 32k).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxformer import KVCache
from jaxformer.convert import config_from_hf
from jaxformer.memory import cache_entry_bytes

# The architecture fields of deepseek-ai/DeepSeek-V3's config.json (its FP8 quantization_config left out).
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
# The text model of Qwen/Qwen3.5-9B's config.json (an image-text checkpoint: its `text_config`).
QWEN3_5_9B = {
    "model_type": "qwen3_5_text", "attention_bias": False, "attn_output_gate": True, "full_attention_interval": 4,
    "head_dim": 256, "hidden_size": 4096, "intermediate_size": 12288, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 32, "rms_norm_eps": 1e-06,
    "vocab_size": 248320, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}


def created_bytes(config, context: int) -> int:
    """The bytes `KVCache.create` gives one row of `context` positions (shapes only)."""
    cache = jax.eval_shape(lambda: KVCache.create(config, 1, context))
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache.layers))


def entry_bytes(entries, context: int, itemsize: int) -> int:
    """The bytes of one row whose layers keep `entries` (`DecoderConfig.cache_entries`' form)."""
    return sum(cache_entry_bytes(entry, context, itemsize) for entry in entries)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768, help="positions a row holds")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="the cache's dtype")
    args = parser.parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    T, item = args.context, dtype.itemsize

    deepseek = config_from_hf(DEEPSEEK_V3, max_seq_len=T, dtype=dtype)
    latent = created_bytes(deepseek, T)
    assert latent == entry_bytes(deepseek.cache_entries, T, item)
    mla = deepseek.layers[0].mixer  # every layer's: heads, the RoPE and plain channels of q and k, v's
    expanded = [("full", ((mla.n_head, mla.qk_nope_head_dim + mla.qk_rope_head_dim), (mla.n_head, mla.v_head_dim)))]
    expanded = entry_bytes(expanded * deepseek.n_layer, T, item)
    per = T * deepseek.n_layer
    print(f"DeepSeek-V3, {T:,} positions, {args.dtype}: latent {latent / per:,.0f} B a token and layer "
          f"({latent / per / item:,.0f} numbers), heads expanded {expanded / per:,.0f} B "
          f"({expanded / per / item:,.0f}): {expanded / latent:.1f}x; a row {latent / 1e9:.2f} GB against "
          f"{expanded / 1e9:.1f} GB")

    qwen = config_from_hf(QWEN3_5_9B, max_seq_len=T, dtype=dtype)
    hybrid = created_bytes(qwen, T)
    assert hybrid == entry_bytes(qwen.cache_entries, T, item)
    full = next(spec for spec in qwen.layers if spec.mixer.attention_type == "full")
    every_full = qwen.replace(layers=(full,) * qwen.n_layer)
    all_full = created_bytes(every_full, T)
    states = sum(cache_entry_bytes(e, T, item) for e in qwen.cache_entries if e[0] == "linear")
    per = T * qwen.n_layer
    print(f"Qwen3.5-9B, {T:,} positions, {args.dtype}: hybrid {hybrid / per:,.0f} B a token and layer "
          f"({sum(e[0] == 'linear' for e in qwen.cache_entries)} linear layers' states, {states / 1e6:.1f} MB a row "
          f"at any length, and {sum(e[0] == 'full' for e in qwen.cache_entries)} full layers' keys), every layer "
          f"full {all_full / per:,.0f} B: {all_full / hybrid:.1f}x; a row {hybrid / 1e9:.2f} GB against "
          f"{all_full / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
