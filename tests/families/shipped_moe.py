"""The `config.json` of published mixture-of-experts checkpoints, as `shipped.py` holds the dense ones.

Keys are in the order of the shipped file (JSON true/false/null -> True/False/None).
Each entry is preceded by a comment naming the sources it was checked against.
Values that could not be confirmed from a verbatim source are marked `# unconfirmed`.
"""

_GPT_OSS_20B_LAYER_TYPES = ["sliding_attention", "full_attention"] * 12   # 24 entries, alternating, sliding first
_GPT_OSS_120B_LAYER_TYPES = ["sliding_attention", "full_attention"] * 18  # 36 entries, alternating, sliding first

SHIPPED_MOE = {
    # Sources: alibaba/InferSim hf_configs/qwen3-30B-A3B_config.json (verbatim JSON, commit HEAD of fetched mirror);
    #          dAppCore/go-inference go/model/arch/Qwen/qwenmoe/testdata/Qwen-Qwen3-30B-A3B-config.json (verbatim,
    #          identical);
    #          a GPTQ re-save of the same config agrees on all architecture fields.
    "Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Sources: two litellm-based repos vendoring HARD_CODED_CONFIGS["Qwen/Qwen3-235B-A22B"] / model_config,
    #          identical.
    #          Cross-check: alibaba/InferSim hf_configs/qwen3-235B-A22B_config.json is the *2507* variant
    #          (max_position_embeddings 262144, rope_theta 5000000) and otherwise identical in keys/order/values.
    "Qwen3-235B-A22B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 94,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 1536,
        "norm_topk_prob": True,
        "num_attention_heads": 64,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 94,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Sources: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py entry "Mixtral-8x7B-v0.1" (verbatim, all 25 keys);
    #          AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/hf_model_configs.py mixtral_8x7b_dict
    #          (from Mixtral-8x7B-Instruct-v0.1 config.json; identical keys/order/values);
    #          scaleapi/llm-engine model-engine/tests/unit/domain/test_llm_use_cases.py (subset, agrees).
    # No router_jitter_noise key in this (Dec 2023, transformers 4.36.0.dev0) file.
    "Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    # Sources: scaleapi/llm-engine model-engine/tests/unit/domain/test_llm_use_cases.py ("mixtral-8x22b" model_config:
    #          21 keys incl. router_jitter_noise 0.0, rope_theta int 1000000, transformers_version 4.40.0.dev0, vocab
    #          32000;
    #          the same test trims output_router_logits/sliding_window/tie_word_embeddings/use_cache from its 8x7B
    #          config too);
    #          a Go test fixture "8x22b" confirms rope_theta 1000000, sliding_window null,
    #          tie_word_embeddings false, vocab 32000. (MaxText's mixtral_8x22b_dict is the *Instruct* file: vocab
    #          32768,
    #          transformers 4.38.0, no router_jitter_noise -- not this checkpoint.)
    "Mixtral-8x22B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 6144,
        "initializer_range": 0.02,
        "intermediate_size": 16384,
        "max_position_embeddings": 65536,
        "model_type": "mixtral",
        "num_attention_heads": 48,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 56,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,  # unconfirmed (trimmed in llm-engine source; saved by MixtralConfig in 4.40)
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.0.dev0",
        "use_cache": True,  # unconfirmed (trimmed in llm-engine source; saved by MixtralConfig in 4.40)
        "vocab_size": 32000,
    },
    # Sources: dAppCore/go-inference go/model/arch/allenai/olmoe/testdata/allenai-olmoe-1b-7b-0924-config.json
    #          ("Fixture source: https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json"; 28 keys);
    #          an OLMoE training-checkpoint config has the same keys/order
    #          plus "rms_norm_eps": 1e-05 (and torch_dtype float32).
    # NOTE: the fixture has NO rms_norm_eps key (and no bos_token_id); the loader in that repo defaults eps to 1e-5.
    #       Whether the hub file carries "rms_norm_eps": 1e-05 (it would sit between pad_token_id and rope_scaling)
    #       is unconfirmed; the effective value is 1e-05 either way (OlmoeConfig default).
    "OLMoE-1B-7B-0924": {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "clip_qkv": None,
        "eos_token_id": 50279,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": 50304,
    },
    # Sources: dAppCore/go-inference go/model/arch/Qwen/qwenmoe/testdata/Qwen-Qwen1.5-MoE-A2.7B-config.json
    #          ("Fixture source: https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json"), verbatim, hand
    #          order
    #          (MoE keys after vocab_size; output_router_logits is line 33, matching a repo comment citing
    #          "config.json#L33").
    #          Cross-checks: mlc-ai/mlc-llm model_preset.py "qwen2moe" (= the -Chat file: same keys/order, but eos
    #          151645
    #          and max_position_embeddings 32768); a C# test citing this config has
    #          max_position_embeddings 8192; a roofline repo uses max_model_len 8*1024, sliding_window 32*1024.
    "Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "max_position_embeddings": 8192,
        "max_window_layers": 21,
        "model_type": "qwen2_moe",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.39.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    # Sources: NVIDIA/TensorRT-LLM tests/unittest/_torch/modeling/test_modeling_qwen_moe.py QWEN2_57B_A14B_CONFIG
    #          (full 32-key dict, alphabetical as written by save_pretrained). Only one verbatim source found; key order
    #          of the hub file taken from it.
    "Qwen2-57B-A14B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "qwen2_moe",
        "moe_intermediate_size": 2560,
        "norm_topk_prob": False,
        "num_attention_heads": 28,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 20480,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Sources: dAppCore/go-inference go/model/arch/openai/gptoss/testdata/openai-gpt-oss-20b-config.json (verbatim);
    #          a repo dump of the hub files config.json + generation_config.json + index;
    #          safety-research/circuit-tracer tests/test_attributions_gpt_oss_nnsight.py gpt_oss_config (same, plus an
    #          added "_name_or_path" that is not in the hub file). All three identical.
    # (generation_config.json, not config.json, carries bos 199998 and eos [200002, 199999, 200012].)
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": _GPT_OSS_20B_LAYER_TYPES,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
    },
    # Sources: a test vendoring "https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json" as REAL
    #;
    #          AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/hf_model_configs.py gpt_oss_120b_dict
    #          ("from .../gpt-oss-120b/blob/main/config.json", quantization_config removed by them, and they add
    #          rope_theta
    #          inside rope_scaling -- both edits noted in their code); a Chinese write-up quoting both 20b and 120b
    #          config.json. Same key set/order as gpt-oss-20b.
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": _GPT_OSS_120B_LAYER_TYPES,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "num_local_experts": 128,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
    },
}
