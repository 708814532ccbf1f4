"""Llama (2 and 3.x), Mistral and Qwen2/2.5: one layout of tensors; Mistral adds a sliding
window on every layer, Qwen2 biases on q, k and v and a window from layer
`max_window_layers` on."""

from __future__ import annotations

from jaxformer.config import DecoderConfig
from jaxformer.families.common import (
    ANY,
    DEFAULT_ROPE_THETA,
    Family,
    attention_extras,
    attention_tensors,
    decoder_fields,
    fail,
    flag,
    hf_layer_types,
    layer_types,
    norm_tensor,
    positive_int,
    refuse_set,
    refuse_sliding,
    rope_parameters,
    single_rope,
)
from jaxformer.families.moe import QWEN_NAMES, ffn_tensors
from jaxformer.layers import layer_specs


def read_llama(hf: dict, max_seq_len: int | None, *, default_theta: float = DEFAULT_ROPE_THETA) -> dict:
    """Llama's fields: Llama's SwiGLU without biases, one RoPE (llama3 scaling and the rest) whose
    base is `default_theta` where config.json names none."""
    refuse_set(hf, "hidden_act", "silu", "the SwiGLU gate must be silu")
    for name in ("attention_bias", "mlp_bias"):  # they also add an o_proj / MLP bias
        if flag(hf, name, False):
            fail(name, "must be false (only Qwen2's q/k/v biases are supported)", hf[name])
    theta, scaling = single_rope(hf, default_theta=default_theta)
    return dict(decoder_fields(hf, max_seq_len=max_seq_len, tie_default=False), rope_theta=theta, rope_scaling=scaling)


def write_rope(config: DecoderConfig) -> dict:
    return {"hidden_act": "silu", "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling)}


def write_llama(config: DecoderConfig) -> dict:
    return {**write_rope(config), "attention_bias": False, "mlp_bias": False}


def window_everywhere(hf: dict, fields: dict) -> dict:
    """`fields` with `sliding_window` (null: none) on every layer, as Mistral and Phi-3 apply it."""
    window = positive_int(hf, "sliding_window", default=None)
    if window is None:
        return fields
    return dict(fields, sliding_window=window, layer_types=("sliding",) * fields["n_layer"])


def write_window_everywhere(config: DecoderConfig) -> dict:
    """`sliding_window` for a format that applies it to every layer, or null."""
    if len(set(config.attention_types)) > 1:
        raise ValueError(f"config.layer_types={config.layer_types!r}: this format slides every layer or none")
    return {"sliding_window": config.sliding_window}


def read_mistral(hf: dict, max_seq_len: int | None) -> dict:
    return window_everywhere(hf, read_llama(hf, max_seq_len))


def read_qwen2(hf: dict, max_seq_len: int | None) -> dict:
    """Qwen2's: q/k/v biases; with `use_sliding_window`, `layer_types` (default: layers from
    `max_window_layers` on) slide over `sliding_window`."""
    fields = dict(read_llama(hf, max_seq_len), qkv_bias=True)
    return dict(fields, **qwen_window(hf, fields["n_layer"]))


def qwen_window(hf: dict, n_layer: int) -> dict:
    """Qwen2's and Qwen3's window fields: none unless `use_sliding_window`."""
    window = positive_int(hf, "sliding_window", default=None) if flag(hf, "use_sliding_window", False) else None
    first = positive_int(hf, "max_window_layers", default=28) if window is not None else None
    types = layer_types(hf, n_layer, lambda i: "sliding" if window is not None and i >= first else "full")
    if window is None or "sliding" not in types:
        return {}
    return {"sliding_window": window, "layer_types": types}


def write_qwen_window(config: DecoderConfig) -> dict:
    sliding = config.sliding_window is not None
    return {"use_sliding_window": sliding, "sliding_window": config.sliding_window, "max_window_layers": config.n_layer,
            "layer_types": hf_layer_types(config)}


def llama_layer(c: DecoderConfig, i: int, names: dict = QWEN_NAMES) -> list:
    """Layer i: pre-attention and pre-MLP norms, q/k/v/o, gate/up/down or a layer of experts (by their
    checkpoint `names`), and Qwen2's biases, Qwen3's q/k norms."""
    hf, block, spec = f"model.layers.{i}.", f"block_{i}", layer_specs(c)[i]
    return [norm_tensor(c, hf + "input_layernorm.weight", block, "attn_norm"),
            *attention_tensors(c.d_model, spec.mixer, hf, block),
            norm_tensor(c, hf + "post_attention_layernorm.weight", block, "mlp_norm"),
            *ffn_tensors(c.d_model, spec.ffn, hf, block, names), *attention_extras(c.d_model, spec.mixer, hf, block)]


def read_plain_llama(hf: dict, max_seq_len: int | None) -> dict:
    refuse_sliding(hf)
    return read_llama(hf, max_seq_len)


LLAMA = Family("llama", "LlamaForCausalLM", read_plain_llama, write_llama, llama_layer)
MISTRAL = Family("mistral", "MistralForCausalLM", read_mistral,
                 lambda c: {**write_llama(c), **write_window_everywhere(c)}, llama_layer, {"sliding_window": ANY})
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", read_qwen2, lambda c: {**write_rope(c), **write_qwen_window(c)},
               llama_layer, {"qkv_bias": (True,), "sliding_window": ANY})
