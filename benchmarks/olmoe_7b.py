"""A checkpoint shaped like OLMoE-1B-7B, a mixture of experts, with random weights made on the
spot (nothing is downloaded): what the real-size experts benchmark and test run on.

    python -m benchmarks.olmoe_7b DIR [--seed 0] [--layers 16]

`DIR` gets the folder `save_pretrained` writes for the shipped model: its `config.json` (below:
16 layers, d_model 2048, 16 heads of 128 with q/k norms over the whole projection, every
feed-forward 64 experts of 1024 with 8 a token, vocabulary 50,304, an untied head), bfloat16
weights in shards with their index (6.92 B parameters, 1.28 B of them active a token; 13.8 GB),
and `llama_1b`'s byte-level BPE tokenizer. The weights are drawn at the shipped init scale
(normal, std 0.02; norm weights 1), one tensor at a time into the shard being written, so the
writer holds one expert's matrix, not the model. `--layers` makes a shallower model of the same
width.
"""

from __future__ import annotations

import argparse
import os

import ml_dtypes
import numpy as np

from benchmarks.llama_1b import tokenizer, write_folder_files, write_shards

# OLMoE-1B-7B-0924's config.json as published (the architecture fields).
CONFIG = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": False, "attention_dropout": 0.0,
    "clip_qkv": None, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 1024, "max_position_embeddings": 4096, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 50304,
}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape (torch's `[out, in]` for a Linear) in an OLMoE checkpoint."""
    d, f, E = config["hidden_size"], config["intermediate_size"], config["num_experts"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,),
              "lm_head.weight": (config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   **{p + f"self_attn.{x}_proj.weight": (d, d) for x in "qkvo"},
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate.weight": (E, d)}
        for e in range(E):
            shapes |= {p + f"mlp.experts.{e}.gate_proj.weight": (f, d), p + f"mlp.experts.{e}.up_proj.weight": (f, d),
                       p + f"mlp.experts.{e}.down_proj.weight": (d, f)}
    return shapes


def parameters(config: dict) -> tuple[int, int]:
    """`(all, active)`: the parameters, and those a token reads (its k experts, not all E)."""
    shapes = tensor_shapes(config)
    total = sum(int(np.prod(s)) for s in shapes.values())
    per_expert = 3 * config["hidden_size"] * config["intermediate_size"]
    idle = config["num_hidden_layers"] * (config["num_experts"] - config["num_experts_per_tok"]) * per_expert
    return total, total - idle


def write(folder: str, *, seed: int = 0, layers: int | None = None) -> str:
    """Writes the random checkpoint into `folder` (created); returns `folder`."""
    config = dict(CONFIG, num_hidden_layers=layers or CONFIG["num_hidden_layers"])
    tok = tokenizer()
    config |= {"bos_token_id": tok.token_to_id("<|begin_of_text|>"), "eos_token_id": tok.token_to_id("<|end_of_text|>")}
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(config)

    def draw(name: str) -> np.ndarray:
        shape = shapes[name]
        w = np.ones(shape, np.float32) if len(shape) == 1 else rng.standard_normal(shape, np.float32) * 0.02
        return w.astype(ml_dtypes.bfloat16)

    weight_map = write_shards(folder, {name: (shape, ml_dtypes.bfloat16) for name, shape in shapes.items()}, draw)
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())  # (bfloat16's 2 bytes a value)
    return write_folder_files(folder, config, total, weight_map, tok)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.olmoe_7b", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shipped 16")
    args = parser.parse_args(argv)
    write(args.folder, seed=args.seed, layers=args.layers)
    total, active = parameters(dict(CONFIG, num_hidden_layers=args.layers or CONFIG["num_hidden_layers"]))
    print(f"wrote {args.folder}: {total / 1e9:.2f} B parameters, {active / 1e9:.2f} B active a token")


if __name__ == "__main__":
    main()
