"""A checkpoint shaped like Llama-3.2-1B (or Llama-3.1-8B), with random weights, made on the spot
(nothing is downloaded): what the real-size benchmarks and tests run on.

    python -m benchmarks.llama_1b DIR [--seed 0] [--layers 16] [--shape 1b|8b]

`DIR` gets the folder `save_pretrained` writes for the shipped model: its `config.json` (below:
16 layers, d_model 2048, 32 query and 8 key/value heads of 64, SwiGLU 8192, vocabulary
128,256, tied embeddings, llama3 RoPE), `bfloat16` weights in two safetensors shards with
their index (1.24 B parameters, 2.47 GB), and a byte-level BPE tokenizer of a few hundred
tokens (every id it makes is in the vocabulary; the rest of the vocabulary is never
produced by it, but the model still scores and samples all 128,256). The weights are drawn
with the shipped model's init scale (normal, std 0.02; norm weights 1), so activations and
logits have a real model's scale, not its knowledge. `--layers` makes a shallower model of
the same width (a quick variant of the same shapes).

`--shape 8b` writes Llama-3.1-8B's shapes instead (`CONFIG_8B`: 32 layers, d_model 4096, 32 query
and 8 key/value heads of 128, SwiGLU 14,336, the same vocabulary, an untied head; 8.03 B
parameters, 16.1 GB in four shards). Either is written tensor by tensor (`write_shards`): one in memory
at a time.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import ml_dtypes
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxformer.convert.safetensors_file import write_safetensors

# The Llama-3.2-1B config.json as published (the architecture fields).
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
# The Llama-3.1-8B config.json as published (the architecture fields that differ).
CONFIG_8B = CONFIG | {
    "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "rope_scaling": dict(CONFIG["rope_scaling"], factor=8.0), "tie_word_embeddings": False,
}
SHARD_BYTES = 5 * 10 ** 9  # about as the hub's shards are cut
SHAPES = {"1b": (CONFIG, 2), "8b": (CONFIG_8B, 4)}  # each shape's config and its shards, as shipped
TEXT = ("Attention is all you need. The Transformer reads a whole sentence at once. Keys and values are "
        "cached, so each new token costs one step. The cat sat on the mat, and the dog sat on the log. ") * 20


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape (torch's `[out, in]` for a Linear) in a Llama checkpoint."""
    d, f, head = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
    return shapes


def tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer (ids below 400, all inside the model's vocabulary) that frames
    every text as `<|begin_of_text|> text`, as Llama 3's does."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id(special[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{special[0]} $A", special_tokens=[(special[0], bos)])
    return tok


def write(folder: str, *, seed: int = 0, layers: int | None = None, shape: str = "1b") -> str:
    """Writes the random checkpoint of `shape` ("1b", "8b") into `folder` (created); returns `folder`."""
    shipped, shards = SHAPES[shape]
    config = dict(shipped, num_hidden_layers=layers or shipped["num_hidden_layers"])
    tok = tokenizer()
    config |= {"bos_token_id": tok.token_to_id("<|begin_of_text|>"), "eos_token_id": tok.token_to_id("<|end_of_text|>")}
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(config)

    def draw(name: str) -> np.ndarray:  # norms 1, matrices N(0, 0.02^2)
        dims = shapes[name]
        w = np.ones(dims, np.float32) if len(dims) == 1 else rng.standard_normal(dims, np.float32) * 0.02
        return w.astype(ml_dtypes.bfloat16)

    total = sum(int(np.prod(s)) * 2 for s in shapes.values())  # (bfloat16's 2 bytes a value)
    weight_map = write_shards(folder, {name: (dims, ml_dtypes.bfloat16) for name, dims in shapes.items()}, draw,
                              -(-total // shards))  # (as the shipped ones are split: `shards` of about equal bytes)
    return write_folder_files(folder, config, total, weight_map, tok)


def write_shards(folder: str, tensors: dict[str, tuple[tuple[int, ...], np.dtype]],
                 draw: Callable[[str], np.ndarray], shard_bytes: int = SHARD_BYTES) -> dict[str, str]:
    """Writes `tensors` (`{name: (shape, dtype)}`, in order) into shards of about `shard_bytes` (a shard
    closed once past them), each tensor `draw(name)` in turn, one in memory at a time; returns each
    name's shard (the index's map)."""
    shards, size = [[]], 0
    for name, (shape, dtype) in tensors.items():
        if size > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += int(np.prod(shape)) * np.dtype(dtype).itemsize
    weight_map = {}
    for i, names in enumerate(shards):
        shard = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(folder, shard), [(n, *tensors[n]) for n in names], draw, {"format": "pt"})
        weight_map |= {n: shard for n in names}
    return weight_map


def write_folder_files(folder: str, config: dict, total_size: int, weight_map: dict, tok: Tokenizer) -> str:
    """A random checkpoint's files besides its shards: the index of its tensors (`weight_map`: each
    one's shard; `total_size`: their bytes), `config.json`, and `tok`'s tokenizer files; returns `folder`."""
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(folder, tok)
    return folder


def write_tokenizer(folder: str, tok: Tokenizer) -> None:
    """`tok`'s files in `folder`: `tokenizer.json` and a `tokenizer_config.json` naming its BOS and EOS."""
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|end_of_text|>"}, f, indent=2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama_1b", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shipped model's")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="Llama-3.2-1B's or Llama-3.1-8B's")
    args = parser.parse_args(argv)
    write(args.folder, seed=args.seed, layers=args.layers, shape=args.shape)
    print(f"wrote {args.folder}")


if __name__ == "__main__":
    main()
