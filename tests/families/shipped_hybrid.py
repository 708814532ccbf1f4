"""The `config.json` of published linear-attention hybrids, as `shipped.py` holds the dense ones.

Keys are in the order of the shipped file (JSON true/false/null -> True/False/None). Qwen3.5's and
Qwen3.6's ship as image-text models: the text model's fields under `text_config`, the vision tower's
under `vision_config`. Each entry is preceded by a comment naming the sources it was checked against;
values that could not be confirmed from a verbatim source are marked `# unconfirmed`.
"""

_EVERY_FOURTH_FULL = ["linear_attention"] * 3 + ["full_attention"]

SHIPPED_HYBRID = {
    # Source: a model report's verbatim dump of Qwen/Qwen3-Next-80B-A3B-Instruct/config.json (its
    # "原始 config.json" block); a C++ loader's transcription of the release agrees on every field but
    # adds "attention_bias": false, which the verbatim dump does not have.
    "Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Source: a test suite's fixture "run against the real Qwen3.5-9B config" (text_config and
    # vision_config as dicts, the outer fields around them); a CPU loader's fixture of Qwen3.5-4B
    # agrees on the shared fields. Fields that fixture does not list are marked.
    "Qwen3.5-9B": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "attention_bias": False,
            "attn_output_gate": True,
            "eos_token_id": 248044,
            "full_attention_interval": 4,
            "head_dim": 256,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "layer_types": _EVERY_FOURTH_FULL * 8,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_value_head_dim": 128,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "num_hidden_layers": 32,
            "rms_norm_eps": 1e-06,
            "vocab_size": 248320,
            "mamba_ssm_dtype": "float32",
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                                "rope_theta": 10000000, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": False,
            "max_position_embeddings": 262144,  # unconfirmed (the fixture omits it; Qwen3.6-35B-A3B's value)
            "model_type": "qwen3_5_text",  # unconfirmed (the fixture omits it; transformers' text model type)
        },
        "vision_config": {"depth": 27, "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304,
                          "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 4096, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
    },
    # Source: an inference engine's fixture "real_qwen36_35b_a3b_config_json" (the outer fields and the
    # text_config verbatim; its vision_config left out there): Qwen/Qwen3.6-35B-A3B. The vision tower's
    # fields are Qwen3.5-9B's shape (unconfirmed for this checkpoint: the loader never reads them).
    "Qwen3.6-35B-A3B": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "bos_token_id": 248044,
            "dtype": "bfloat16",
            "eos_token_id": 248044,
            "full_attention_interval": 4,
            "head_dim": 256,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "layer_types": _EVERY_FOURTH_FULL * 10,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_value_head_dim": 128,
            "max_position_embeddings": 262144,
            "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": 512,
            "num_attention_heads": 16,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 40,
            "num_key_value_heads": 2,
            "output_router_logits": False,
            "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-06,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                                "rope_theta": 10000000, "rope_type": "default"},
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": 248320,
        },
        "vision_config": {"depth": 27, "hidden_size": 1152, "in_channels": 3, "intermediate_size": 4304,  # unconfirmed
                          "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2},
    },
}
