"""Phi-3: Llama's math with fused projections: `qkv_proj` holds q, k and v's rows one after
another and `gate_up_proj` gate's then up's; they are split on load and fused on save.
A `sliding_window`, when set, applies to every layer."""

from __future__ import annotations

from jaxformer.config import DecoderConfig
from jaxformer.families.common import ANY, Family, linear, norm_tensor
from jaxformer.families.llama import read_llama, window_everywhere, write_rope, write_window_everywhere
from jaxformer.layers import layer_specs


def read_phi3(hf: dict, max_seq_len: int | None) -> dict:
    """Llama's fields, a window on every layer; an older `rope_scaling` of type "su" or
    "yarn" is LongRoPE to transformers' Phi-3, and so here."""
    scaling = hf.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
        hf = {**hf, "rope_scaling": {**scaling, "rope_type": "longrope", "type": "longrope"}}
    return window_everywhere(hf, read_llama(hf, max_seq_len))


def write_phi3(config: DecoderConfig) -> dict:
    """Llama's, and LongRoPE's trained context at the top level too: transformers' Phi-3 reads
    it from there (default 4096) over the one in `rope_parameters`."""
    fields = {**write_rope(config), **write_window_everywhere(config)}
    if config.rope_scaling is not None and config.rope_scaling.original_max_position_embeddings is not None:
        fields["original_max_position_embeddings"] = config.rope_scaling.original_max_position_embeddings
    return fields


def phi3_layer(c: DecoderConfig, i: int) -> list:
    """Layer i: `qkv_proj` rows `[0, H*D)` are q, then K*D of k, then K*D of v;
    `gate_up_proj` rows `[0, F)` are the gate, `[F, 2F)` up."""
    spec = layer_specs(c)[i]
    d, F = c.d_model, spec.ffn.width
    H, K, D = spec.mixer.n_head, spec.mixer.n_kv_head, spec.mixer.head_dim
    hf, block = f"model.layers.{i}.", f"block_{i}"
    q, kv = H * D, K * D
    qkv, gate_up = hf + "self_attn.qkv_proj.weight", hf + "mlp.gate_up_proj.weight"
    return [norm_tensor(c, hf + "input_layernorm.weight", block, "attn_norm"),
            linear(qkv, (block, "attn", "wq"), (d, H, D), q, d, rows=(0, q)),
            linear(qkv, (block, "attn", "wk"), (d, K, D), kv, d, rows=(q, q + kv)),
            linear(qkv, (block, "attn", "wv"), (d, K, D), kv, d, rows=(q + kv, q + 2 * kv)),
            linear(hf + "self_attn.o_proj.weight", (block, "attn", "wo"), (H, D, d), d, q),
            norm_tensor(c, hf + "post_attention_layernorm.weight", block, "mlp_norm"),
            linear(gate_up, (block, "mlp", "w_gate"), (d, F), F, d, rows=(0, F)),
            linear(gate_up, (block, "mlp", "w_up"), (d, F), F, d, rows=(F, 2 * F)),
            linear(hf + "mlp.down_proj.weight", (block, "mlp", "w_down"), (F, d), d, F)]


PHI3 = Family("phi3", "Phi3ForCausalLM", read_phi3, write_phi3, phi3_layer, {"sliding_window": ANY})
