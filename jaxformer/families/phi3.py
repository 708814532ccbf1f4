"""Phi-3: Llama's math with fused projections: `qkv_proj` holds q, k and v's rows one after
another and `gate_up_proj` gate's then up's; they are split on load and fused on save.
A `sliding_window`, when set, applies to every layer."""

from __future__ import annotations

from jaxformer.config import DecoderConfig
from jaxformer.families.common import ANY, Family, linear, norm_tensor
from jaxformer.families.llama import read_llama, window_everywhere, write_rope, write_window_everywhere


def read_phi3(hf: dict, max_seq_len: int | None) -> dict:
    return window_everywhere(hf, read_llama(hf, max_seq_len))


def write_phi3(config: DecoderConfig) -> dict:
    return {**write_rope(config), **write_window_everywhere(config)}


def phi3_layer(c: DecoderConfig, i: int) -> list:
    """Layer i: `qkv_proj` rows `[0, H*D)` are q, then K*D of k, then K*D of v;
    `gate_up_proj` rows `[0, F)` are the gate, `[F, 2F)` up."""
    d, H, K, D, F = c.d_model, c.n_head, c.n_kv_head, c.head_dim, c.ffn_dim
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
