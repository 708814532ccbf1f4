"""A tiny Llama checkpoint folder with a byte-level BPE tokenizer, made by transformers
(the peers extra) the way `save_pretrained` writes a real one."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# A few KB of English and Chinese (the 2017 paper's title among them), so that the BPE
# merges learn words and whole characters while rarer characters stay split into bytes.
CORPUS = "\n".join([
    "Attention is all you need. The Transformer reads a whole sentence at once.",
    "注意力就是你所需要的一切。变换器一次读入整个句子。",
    "The cat sat on the mat, and the dog sat on the log.",
    "今天天气很好，我们去公园散步吧。明天也许会下雨。",
    "Keys and values are cached, so each new token costs one step.",
    "机器学习模型需要数据、算力和耐心。",
] * 12)
SPECIAL = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def bpe_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """A byte-level BPE tokenizer that frames every text as `<s> text`, as Llama's do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def save_tiny_llama(path: str, *, chat_template: bool = True, seed: int = 0, n_layer: int = 2) -> None:
    """A random Llama (weights scaled up so greedy choices are far from ties) and its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = bpe_tokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=96, initializer_range=0.4, tie_word_embeddings=False,
                         bos_token_id=backend.token_to_id("<s>"), eos_token_id=backend.token_to_id("</s>"),
                         pad_token_id=backend.token_to_id("<pad>"))
    LlamaForCausalLM(config).eval().save_pretrained(path)


def set_eos(path: str, eos_ids: list[int]) -> None:
    """Makes `eos_ids` the ids that stop generation (`generation_config.json`)."""
    file = os.path.join(path, "generation_config.json")
    with open(file) as f:
        config = json.load(f)
    config["eos_token_id"] = eos_ids
    with open(file, "w") as f:
        json.dump(config, f)


def save_random_checkpoint(path, experts: bool = False, shipped: str | None = None, seed: int = 0) -> None:
    """A random Llama-shaped checkpoint folder written by jaxformer (2 layers of 32, small
    weights drawn from `seed`), with `bpe_tokenizer` and `CHAT_TEMPLATE`: what fine-tuning tests adapt. With
    `experts`, a Qwen3-MoE of the same shape: each feed-forward 4 experts of 16, 2 a token.
    With `shipped`, that shipped config's family at `tests/families/shipped.py`'s tiny sizes
    (e.g. "DeepSeek-V3": latent attention; "Qwen3-Next-80B-A3B-Instruct": a Gated DeltaNet hybrid)."""
    import dataclasses

    from conftest import random_params

    from jaxformer import DecoderConfig
    from jaxformer.convert import save_hf
    from jaxformer.convert.hf import config_from_hf
    from jaxformer.experts import ExpertsSpec
    from jaxformer.layers import layer_specs
    from jaxformer.text import Tokenizer as Framed
    from jaxformer.text import save_tokenizer

    tokenizer = Framed(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
                       chat_template=CHAT_TEMPLATE)
    config = DecoderConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                           max_seq_len=64)
    if shipped is not None:
        from tests.families.shipped import tiny

        hf = tiny(shipped, vocab_size=tokenizer.vocab_size)
        hf.pop("quantization_config", None)  # (DeepSeek-V3's FP8: these random weights are float32's)
        config = config_from_hf(hf, max_seq_len=64)
    elif experts:
        config = config.replace(qk_norm=True, hf_model_type="qwen3_moe")
        config = config.replace(layers=tuple(dataclasses.replace(spec, ffn=ExpertsSpec(4, 2, 16))
                                             for spec in layer_specs(config)))
    save_hf(config, random_params(config, seed=seed, scale=0.1), str(path), bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    save_tokenizer(tokenizer, str(path))


def save_adapted_checkpoint(root, config, tokenizer, text: str, *, scale: float) -> None:
    """Under `root`: a random checkpoint of `config` (`base`: `random_params(config, seed=0, scale=scale)`),
    a random LoRA adapter for it in peft's format (`adapter`: rank 4, alpha 8, on q, v and down), the two
    merged (`merged`), each checkpoint with `tokenizer`; and `text.txt` holding `text`."""
    import jax
    from conftest import random_params

    from jaxformer.convert import save_hf
    from jaxformer.convert.peft import save_peft
    from jaxformer.lora import LoraConfig, init_lora, merge
    from jaxformer.text import save_tokenizer

    params = random_params(config, seed=0, scale=scale)
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
    adapters = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(1), x.shape),
                            init_lora(params, lora, jax.random.key(0)))
    for name, weights in (("base", params), ("merged", merge(params, adapters, lora))):
        save_hf(config, weights, str(root / name), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id)
        save_tokenizer(tokenizer, str(root / name))
    save_peft(config, adapters, lora, str(root / "adapter"))
    (root / "text.txt").write_text(text)
