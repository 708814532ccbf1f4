"""The `config.json` of published checkpoints, as they ship on the Hugging Face hub, and tiny copies of them.

The conversion tests build tiny random checkpoints that keep every architectural field of a shipped config
(RoPE scaling dicts, soft-caps, sliding windows and their layer pattern, head_dim decoupled from
hidden_size / heads, tied heads, token-id lists, ...) and shrink only the sizes, so that a loader is tested
on what the hub really serves rather than on a config written for the test. `SHIPPED[name]` is the file
verbatim (JSON null/true/false as None/True/False); `tiny(name, **overrides)` is its shrunk copy.

Sources (the hub itself was not reachable from where this was written): each dict was checked against at
least one verbatim copy of the hub file (a `huggingface-cli`/`curl` dump, a cached snapshot, or a vendored
preset such as mlc-ai/mlc-llm `model_preset.py`, TensorRT-LLM's Phi-3 test, alibaba/MNN's llmexport). A
value that could not be confirmed says so on its line. Nothing here touches the network.
"""

import copy

from tests.families.shipped_hybrid import SHIPPED_HYBRID
from tests.families.shipped_moe import SHIPPED_MOE

REPOS = {
    "Llama-3.2-1B": "meta-llama/Llama-3.2-1B",
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "Qwen3-0.6B": "Qwen/Qwen3-0.6B",
    "Mistral-7B-v0.1": "mistralai/Mistral-7B-v0.1",
    "gemma-2b": "google/gemma-2b",
    "gemma-2-2b": "google/gemma-2-2b",
    "gemma-3-1b-it": "google/gemma-3-1b-it",
    "Phi-3-mini-4k-instruct": "microsoft/Phi-3-mini-4k-instruct",
    "Qwen2.5-0.5B": "Qwen/Qwen2.5-0.5B",
    "SmolLM2-135M": "HuggingFaceTB/SmolLM2-135M",
    "SmolLM3-3B": "HuggingFaceTB/SmolLM3-3B",
    "OLMo-2-1124-7B": "allenai/OLMo-2-1124-7B",
    "Olmo-3-1025-7B": "allenai/Olmo-3-1025-7B",
    # Mixtures of experts (their config.json in shipped_moe.py)
    "Qwen3-30B-A3B": "Qwen/Qwen3-30B-A3B",
    "Qwen3-235B-A22B": "Qwen/Qwen3-235B-A22B",
    "Mixtral-8x7B-v0.1": "mistralai/Mixtral-8x7B-v0.1",
    "Mixtral-8x22B-v0.1": "mistralai/Mixtral-8x22B-v0.1",
    "OLMoE-1B-7B-0924": "allenai/OLMoE-1B-7B-0924",
    "Qwen1.5-MoE-A2.7B": "Qwen/Qwen1.5-MoE-A2.7B",
    "Qwen2-57B-A14B": "Qwen/Qwen2-57B-A14B",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    # Gemma 4: the hub's config.json is the image-text model's; these are its text_config
    "gemma-4-E2B-it": "google/gemma-4-E2B-it",
    "gemma-4-26B-A4B-it": "google/gemma-4-26B-A4B-it",
}

SHIPPED = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,  # the base model ships one id; the -Instruct variant ships [128001, 128008, 128009]
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,  # base model; Llama-3.1-8B-Instruct ships [128001, 128008, 128009]
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {  # this key order is the file's
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,  # not hidden_size / heads (64)
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.34.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "gemma-2b": {
        "architectures": ["GemmaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "head_dim": 256,
        "hidden_act": "gelu",  # legacy value: GemmaConfig rewrites it to "gelu_pytorch_tanh"
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 16384,
        "max_position_embeddings": 8192,
        "model_type": "gemma",
        "num_attention_heads": 8,
        "num_hidden_layers": 18,
        "num_key_value_heads": 1,  # multi-query attention
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.38.0.dev0",
        "use_cache": True,
        "vocab_size": 256000,
    },
    "gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,  # base model; gemma-2-2b-it ships [1, 107]
        "final_logit_softcapping": 30.0,
        "head_dim": 256,  # not hidden_size / heads (288)
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "initializer_range": 0.02,
        "intermediate_size": 9216,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "torch_dtype": "float32",  # the base 2b ships float32 weights (the -it and 9b/27b ship bfloat16)
        "transformers_version": "4.42.4",
        "use_cache": True,
        "vocab_size": 256000,
    },
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 256,  # not hidden_size / heads (288)
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "initializer_range": 0.02,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,  # multi-query attention
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",  # unconfirmed: mlc-llm's copy says this, another copy says 4.52.4
        "use_cache": True,
        "vocab_size": 262144,
    },
    "Phi-3-mini-4k-instruct": {
        "_name_or_path": "Phi-3-mini-4k-instruct",
        "architectures": ["Phi3ForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config",
            "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
        },
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 4096,
        "model_type": "phi3",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,  # multi-head attention, no grouping
        "original_max_position_embeddings": 4096,
        "pad_token_id": 32000,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2",
        "use_cache": True,
        "attention_bias": False,  # this key comes after use_cache in the file
        "vocab_size": 32064,
    },
    "Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,  # inert: use_sliding_window is false
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536,
        "is_llama_config": True,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "vocab_size": 49152,
    },
    # No verbatim copy of this file was found: its fields are those several partial copies agree on (the shapes,
    # the NoPE list, rope_theta, the token ids), and the lines marked unconfirmed are as the file is recalled.
    "SmolLM3-3B": {
        "architectures": ["SmolLM3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": 128012,  # the instruct model's <|im_end|>; SmolLM3-3B-Base ships 128001
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "layer_types": ["full_attention"] * 36,  # unconfirmed: written out, as transformers >= 4.54 saves it
        "max_position_embeddings": 65536,
        "max_window_layers": 28,  # unconfirmed (inert: use_sliding_window is false)
        "mlp_bias": False,
        "model_type": "smollm3",
        "no_rope_layer_interval": 4,
        "no_rope_layers": [1, 1, 1, 0] * 9,  # every fourth layer NoPE: 3, 7, ..., 35
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 4,
        "pad_token_id": 128004,
        "pretraining_tp": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 5000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0.dev0",  # unconfirmed
        "use_cache": False,  # unconfirmed
        "use_sliding_window": False,
        "vocab_size": 128256,
    },
    # Checked against a mirror of the file (Megatron-Bridge's tests), the Instruct model's verbatim file (the same
    # fields) and a line-numbered account of this one (23 fields, rope_scaling among them).
    "OLMo-2-1124-7B": {
        "architectures": ["Olmo2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": 100257,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "olmo2",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,  # multi-head attention, no grouping
        "pad_token_id": 100277,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 500000,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",  # unconfirmed: the hub lists its weights as F32; the mirror says bfloat16
        "transformers_version": "4.47.0.dev0",  # unconfirmed: the Instruct model's
        "use_cache": True,
        "vocab_size": 100352,
    },
    # No verbatim copy of this file was found: the shapes, layer_types, the window and the RoPE block (YaRN on the
    # full layers alone) are those of several partial copies (prime-rl's and a tiny-model script aligned with
    # Olmo-3-7B-Think's file, whose RoPE block is the same); the lines marked unconfirmed are as the file is recalled.
    "Olmo-3-1025-7B": {
        "architectures": ["Olmo3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": 100257,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 11008,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 8,
        "max_position_embeddings": 65536,
        "model_type": "olmo3",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,  # multi-head attention (the 32B groups its heads)
        "pad_token_id": 100277,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "attention_factor": 1.2079441541679836,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "yarn",
        },
        "rope_theta": 500000,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",  # unconfirmed
        "use_cache": True,  # unconfirmed
        "vocab_size": 100278,
    },
}

SHIPPED.update(SHIPPED_MOE)
SHIPPED.update(SHIPPED_HYBRID)

# Gemma 4's checkpoints are image-text models (`Gemma4ForConditionalGeneration`, model_type "gemma4"); each
# dict is the `text_config` of its config.json, the text model, as transformers 5.5 writes it (its keys
# sorted). The top level besides it (`audio_config`, `vision_config`, the image/audio token ids,
# `tie_word_embeddings: true`) is the towers', which jaxformer does not read.
_GEMMA4_LAYERS = {"gemma-4-E2B-it": ["sliding_attention"] * 4 + ["full_attention"],
                  "gemma-4-26B-A4B-it": ["sliding_attention"] * 5 + ["full_attention"]}
_GEMMA4_ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
SHIPPED.update({
    # Sources: mlc-ai-style generate-configs.py's TEXT_CONFIG for the E2B (every field; it has an older
    # `expert_intermediate_size: None` where 5.5 writes the three MoE fields null); the same values in a Swift
    # port's E2B test (Gemma4Swift), a Rust server's "real E2B config" test, vllm-metal's and a Go port's.
    "gemma-4-E2B-it": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": False,
        "bos_token_id": 2,
        "dtype": "bfloat16",
        "enable_moe_block": False,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1536,
        "hidden_size_per_layer_input": 256,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "layer_types": _GEMMA4_LAYERS["gemma-4-E2B-it"] * 7,
        "max_position_embeddings": 131072,
        "model_type": "gemma4_text",
        "moe_intermediate_size": None,  # (null as the dense models' 5.5 dumps have it; not confirmed for the E2B)
        "num_attention_heads": 8,
        "num_experts": None,  # (as above)
        "num_global_key_value_heads": None,  # (null in two E2B copies; absent in others: the same to transformers)
        "num_hidden_layers": 35,
        "num_key_value_heads": 1,
        "num_kv_shared_layers": 20,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _GEMMA4_ROPE,
        "sliding_window": 512,
        "tie_word_embeddings": True,
        "top_k_experts": None,  # (as above)
        "use_bidirectional_attention": None,  # (null in the TEXT_CONFIG copy; the 26B and 31B ship "vision")
        "use_cache": True,
        "use_double_wide_mlp": True,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
    },
    # Sources: a transformers 5.5.0.dev0 config.json dump of a derivative of this checkpoint (every key, in
    # this order; its num_experts pruned to 98), and for the values Gemma4Swift's 26B-A4B test, a Rust
    # server's 26B-A4B test, vllm-metal's (num_global_key_value_heads 2) and an MLX engine's geometry check
    # (128 experts, 8 a token, 704 wide, use_bidirectional_attention "vision").
    "gemma-4-26B-A4B-it": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attention_k_eq_v": True,
        "bos_token_id": 2,
        "dtype": "bfloat16",
        "enable_moe_block": True,
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "global_head_dim": 512,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2816,
        "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02,
        "intermediate_size": 2112,
        "layer_types": _GEMMA4_LAYERS["gemma-4-26B-A4B-it"] * 5,
        "max_position_embeddings": 262144,
        "model_type": "gemma4_text",
        "moe_intermediate_size": 704,
        "num_attention_heads": 16,
        "num_experts": 128,
        "num_global_key_value_heads": 2,
        "num_hidden_layers": 30,
        "num_key_value_heads": 8,
        "num_kv_shared_layers": 0,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_parameters": _GEMMA4_ROPE,
        "sliding_window": 1024,
        "tie_word_embeddings": True,
        "top_k_experts": 8,
        "use_bidirectional_attention": "vision",
        "use_cache": True,
        "use_double_wide_mlp": False,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
    },
})

# The tiny sizes. num_hidden_layers: enough layers to show the layer pattern (gemma-2's 1:1 needs 2; gemma-3's
# sliding_window_pattern 6 needs one whole period, five sliding layers and then a global one).
_VOCAB, _HIDDEN, _FFN, _HEADS, _WINDOW = 128, 64, 128, 4, 8
# SmolLM3's NoPE and OLMo 3's full layers: every 4th; DeepSeek's: 1 dense layer, then 2 of experts; the hybrids':
# 3 linear layers, then 1 full; Gemma 4's E2B: two periods of its 4:1 pattern, so that its shared layers (the last
# 20 of 35: here 5 of 10) have layers of both types before them to read; the 26B one period of its 5:1.
_LAYERS = {"gemma-3-1b-it": 6, "SmolLM3-3B": 4, "Olmo-3-1025-7B": 4, "DeepSeek-V3": 3, "Kimi-K2-Instruct": 3,
           "DeepSeek-V2-Lite": 3, "Qwen3-Next-80B-A3B-Instruct": 4, "Qwen3.5-9B": 4, "Qwen3.6-35B-A3B": 4,
           "gemma-4-E2B-it": 10, "gemma-4-26B-A4B-it": 6}
# Experts: 8 of width 32 (Mixtral's and gpt-oss's `intermediate_size` is their experts' width: _FFN), k at most 3,
# a shared expert 48 wide.
_EXPERTS, _TOP_K, _EXPERT_FFN, _SHARED_FFN = 8, 3, 32, 48
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tiny(name, **overrides):
    """`SHIPPED[name]` with only its sizes shrunk; `overrides` replace keys last.

    Kept as shipped: every other field, the RoPE dicts, max_position_embeddings, the soft-caps, the token-id
    structure (a list stays a list, equal ids stay equal). Shrunk: vocab 128, hidden 64, FFN 128, 4 heads,
    sliding_window 8 where one is set, layers 2 (6 for gemma-3, 4 for SmolLM3, OLMo 3 and
    the hybrids); 8 experts of 32 (Mixtral's and gpt-oss's of 128, their FFN), 3 a token at most, a shared expert of
    48; Gated DeltaNet 2 key heads of 8 channels, each with as many value heads as shipped; an image-text
    checkpoint's text model so, its vision tower one block of 32. Properties of the
    shipped shapes are kept: KV heads 4 / 2 / 1 for multi-head / grouped / multi-query attention; head_dim 32
    where the shipped head_dim is not hidden / heads, else 16 (written only where shipped); query_pre_attn_scalar
    follows head_dim as shipped; max_window_layers, layer_types and no_rope_layers follow the new layer count.
    torch_dtype is "bfloat16" for all (gemma-2-2b ships "float32").
    The result is a fresh copy: transformers edits the RoPE dict it is given in place.
    """
    if name not in SHIPPED:
        raise KeyError(f"no shipped config {name!r}; have {sorted(SHIPPED)}")
    shipped = SHIPPED[name]
    if "text_config" in shipped:  # an image-text checkpoint: its text model shrunk, its vision tower to one block
        config = copy.deepcopy(shipped)
        config["text_config"] = _shrunk(name, shipped["text_config"], overrides)
        config["vision_config"].update(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                       out_hidden_size=_HIDDEN)
        return config
    return _shrunk(name, shipped, overrides)


def _shrunk(name, shipped, overrides):
    """`tiny`'s copy of one model's `shipped` fields."""
    config = copy.deepcopy(shipped)
    layers = overrides.get("num_hidden_layers", _LAYERS.get(name, 2))
    vocab = overrides.get("vocab_size", _VOCAB)
    config.update(vocab_size=vocab, hidden_size=_HIDDEN, intermediate_size=_FFN, num_hidden_layers=layers,
                  num_attention_heads=_HEADS, torch_dtype="bfloat16")

    heads, kv_heads = shipped["num_attention_heads"], shipped.get("num_key_value_heads")
    if kv_heads is not None:
        config["num_key_value_heads"] = _HEADS if kv_heads == heads else 1 if kv_heads == 1 else 2
    square = shipped["hidden_size"] // heads
    head_dim = shipped.get("head_dim", square)
    tiny_head_dim = _HIDDEN // _HEADS if head_dim == square else 2 * (_HIDDEN // _HEADS)
    if "head_dim" in shipped:
        config["head_dim"] = tiny_head_dim
    if shipped.get("query_pre_attn_scalar") is not None:
        scalar = shipped["query_pre_attn_scalar"]
        config["query_pre_attn_scalar"] = tiny_head_dim if scalar == head_dim else _HIDDEN // _HEADS

    if shipped.get("sliding_window") is not None:
        config["sliding_window"] = _WINDOW
    for key, size in (("num_experts", _EXPERTS), ("num_local_experts", _EXPERTS),
                      ("moe_intermediate_size", _EXPERT_FFN), ("shared_expert_intermediate_size", _SHARED_FFN)):
        if shipped.get(key) is not None:
            config[key] = size
    for key in ("num_experts_per_tok", "experts_per_token", "top_k_experts"):  # top-k below the count
        if shipped.get(key) is not None:
            config[key] = min(shipped[key], _TOP_K)
    if "linear_num_key_heads" in shipped:  # Gated DeltaNet: 2 key heads, as many value heads each as shipped
        per_key = shipped["linear_num_value_heads"] // shipped["linear_num_key_heads"]
        config.update(linear_num_key_heads=2, linear_num_value_heads=2 * per_key, linear_key_head_dim=8,
                      linear_value_head_dim=8)
    # DeepSeek's latent attention and experts: latent widths 16 (the query's 24, or none as shipped), 8 + 8 channels
    # of q and k (plain and RoPE) and 12 of v; 8 routed experts in 4 groups of 2, the best 2 chosen, where the
    # shipped config groups them (else one group); one dense layer first.
    for key, size in (("kv_lora_rank", 16), ("q_lora_rank", 24), ("qk_nope_head_dim", 8), ("qk_rope_head_dim", 8),
                      ("v_head_dim", 12), ("n_routed_experts", _EXPERTS)):
        if shipped.get(key) is not None:
            config[key] = size
    if shipped.get("n_group", 1) > 1:
        config.update(n_group=4, topk_group=2)
    if "first_k_dense_replace" in shipped:
        config["first_k_dense_replace"] = min(shipped["first_k_dense_replace"], 1)
    if shipped.get("global_head_dim") is not None:  # Gemma 4's global layers: as many times wider as shipped
        config["global_head_dim"] = tiny_head_dim * shipped["global_head_dim"] // head_dim
    if shipped.get("num_global_key_value_heads") is not None:  # fewer than the sliding layers' 2, as shipped
        config["num_global_key_value_heads"] = 1
    if shipped.get("hidden_size_per_layer_input"):  # Gemma 4's per-layer inputs, 8 wide over the tiny vocabulary
        config.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab)
    if shipped.get("num_kv_shared_layers"):  # the same share of the layers reads earlier ones' keys and values
        config["num_kv_shared_layers"] = shipped["num_kv_shared_layers"] * layers // shipped["num_hidden_layers"]
    if "max_window_layers" in shipped:  # the first max_window_layers layers never slide (Qwen2/3)
        shipped_layers, window_layers = shipped["num_hidden_layers"], shipped["max_window_layers"]
        shrunk = window_layers * layers // shipped_layers
        config["max_window_layers"] = layers if window_layers >= shipped_layers else shrunk
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists: the shipped pattern over the new layer count
        if shipped.get(key) is not None:
            pattern = shipped[key]
            config[key] = [pattern[i % len(pattern)] for i in range(layers)]

    ids = sorted({i for key in _TOKEN_KEYS for i in _as_list(shipped.get(key))})
    small = {i: i if i < vocab else i % vocab for i in ids}
    if len(set(small.values())) != len(ids):
        raise ValueError(f"{name}: token ids {ids} collide below vocab_size {vocab}")
    for key in _TOKEN_KEYS:
        value = shipped.get(key)
        if value is not None:
            config[key] = [small[i] for i in value] if isinstance(value, list) else small[value]

    config.update(copy.deepcopy(overrides))  # (a fresh copy: the caller's lists and dicts stay its own)
    return config


def _as_list(value):
    return [] if value is None else value if isinstance(value, list) else [value]


def scaled_up(model, seed: int):
    """A transformers model of a `tiny` config with weights far from ties, so that float32
    rounding cannot turn a greedy choice and a wrong detail moves the logits by far more than
    the tolerance: matrices and biases at std 0.25, norm weights around their identity
    (Gemma's around 0: it scales by 1 + weight), and Gemma's embeddings, which it multiplies
    by sqrt(d_model), at 0.4 / sqrt(d_model) (at 0.25 its greedy continuations repeat one token)."""
    import torch  # (the peers extra; this module's dicts need no torch)

    text = model.config.get_text_config()  # (an image-text model's: its text model's config)
    gemma = "gemma" in text.model_type
    plus_one = gemma and text.model_type != "gemma4_text"  # (Gemma 4's norms scale by the weight itself)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn_like(p) + (0.0 if plus_one else 1.0))
            elif gemma and "embed_tokens" in name:
                p.copy_(0.4 / text.hidden_size ** 0.5 * torch.randn_like(p))
            else:
                p.copy_(0.25 * torch.randn_like(p))
        for name, b in model.named_buffers():  # Gemma 4's scalar per layer, stored in its checkpoints
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
    return model
