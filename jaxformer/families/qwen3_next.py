"""Qwen3-Next (`qwen3_next`) and Qwen3.5 / 3.6, dense and mixture (`qwen3_5_text`, `qwen3_5_moe_text`):
linear-attention hybrids. Three Gated DeltaNet layers (`linear_attn`, `jaxformer.deltanet`) come
before each full-attention layer (`layer_types`, or every `full_attention_interval`-th layer), whose
attention gates each head's output (`q_proj` doubled), rotates a quarter of each head's channels
(`partial_rotary_factor`) and norms q and k per head. Every norm scales by `1 + weight`.

The feed-forwards: Qwen3-Next's are experts with a gated shared expert (as Qwen2-MoE's), dense at
`mlp_only_layers`; Qwen3.5's dense, Qwen3.5-MoE's all experts, renormalised. Qwen3-Next packs each
key head's q, k, v and z in one `in_proj_qkvz` (and its b and a in `in_proj_ba`), Qwen3.5 keeps them
apart. Qwen3.5's checkpoints ship as image-text models, read through their text model
(`jaxformer.convert.hf.TEXT_MODELS`); its RoPE's `mrope_section` splits the angles among three
position streams that text gives equal positions, so text rotates as with one. The multi-token
prediction head both ship (`mtp.*`, `mtp_num_hidden_layers`) is a draft this decoder does not run:
its tensors are left unread.
"""

from __future__ import annotations

import dataclasses

from jaxformer.attention import AttentionSpec
from jaxformer.config import DecoderConfig
from jaxformer.deltanet import GatedDeltaNetSpec
from jaxformer.families.common import (
    Family,
    Tensor,
    attention_extras,
    attention_tensors,
    decoder_fields,
    fail,
    flag,
    linear,
    norm_tensor,
    positive_int,
    rope_parameters,
    single_rope,
    vector,
)
from jaxformer.families.moe import (
    expert_count,
    experts_fields,
    ffn_tensors,
    qwen_sparse,
    read_experts,
    write_qwen_sparse,
)
from jaxformer.layers import LayerSpec, layer_specs
from jaxformer.validation import finite_float

HYBRID_TYPES = ("linear_attention", "full_attention")


def multi_token_prediction(config: DecoderConfig, key: str) -> bool:
    """Whether `key` is a tensor of the multi-token prediction head (`mtp.*`), which is not read."""
    return key.startswith("mtp.")


def _rope(hf: dict) -> tuple[float, object, float]:
    """`(theta, scaling, partial_rotary_factor)`: the factor from `rope_parameters` or the top level
    (transformers' default 0.25), the rest as every family's single RoPE."""
    params = dict(hf.get("rope_parameters") or {})
    factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    if finite_float(factor) is None or not 0 < finite_float(factor) <= 1:
        fail("partial_rotary_factor", "must be a number in (0, 1]", factor)
    section = params.pop("mrope_section", None)  # (text's three position streams are equal: one RoPE)
    if section is not None and not (isinstance(section, list) and all(isinstance(n, int) and n > 0 for n in section)):
        fail("rope_parameters.mrope_section", "must list positive ints", section)
    params.pop("mrope_interleaved", None)
    rest = {k: v for k, v in hf.items() if k != "partial_rotary_factor"}
    theta, scaling = single_rope({**rest, "rope_parameters": params} if params else rest)
    return theta, scaling, float(factor)


def _kinds(hf: dict, n_layer: int) -> list[str]:
    """Each layer's `layer_types` entry, or every `full_attention_interval`-th (default 4) full."""
    given = hf.get("layer_types")
    if given is None:
        interval = positive_int(hf, "full_attention_interval", default=4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layer)]
    if not (isinstance(given, list) and len(given) == n_layer and all(t in HYBRID_TYPES for t in given)):
        fail("layer_types", f"must list {n_layer} (num_hidden_layers) entries of {HYBRID_TYPES}", given)
    return given


def read_hybrid(hf: dict, max_seq_len: int | None, experts=None, sparse=None) -> dict:
    """The fields of all three: each layer a Gated DeltaNet or gated attention layer, its
    feed-forward `experts` where `sparse(hf, n_layer)` says (None: dense everywhere)."""
    if flag(hf, "use_sliding_window", False):
        fail("use_sliding_window", "must be false (this family's sliding window is not implemented)", True)
    for name in ("attention_bias", "mlp_bias"):
        if flag(hf, name, False):
            fail(name, "must be false (no biases are implemented for this family)", hf[name])
    if not flag(hf, "attn_output_gate", True):
        fail("attn_output_gate", "must be true (every full-attention layer gates its heads here, as transformers'",
             False)
    if hf.get("hidden_act", "silu") != "silu":
        fail("hidden_act", "must be 'silu' (the SwiGLU gate)", hf["hidden_act"])
    theta, scaling, factor = _rope(hf)
    fields = dict(decoder_fields(hf, max_seq_len=max_seq_len, tie_default=False), rope_theta=theta,
                  rope_scaling=scaling, qk_norm=True, norm_plus_one=True)
    base = layer_specs(DecoderConfig(**fields))[0]
    full = dataclasses.replace(base.mixer, output_gate=True, partial_rotary_factor=factor)
    linear_kind = GatedDeltaNetSpec(positive_int(hf, "linear_num_key_heads", default=16),
                                    positive_int(hf, "linear_num_value_heads", default=32),
                                    positive_int(hf, "linear_key_head_dim", default=128),
                                    positive_int(hf, "linear_value_head_dim", default=128),
                                    positive_int(hf, "linear_conv_kernel_dim", default=4))
    n_layer = fields["n_layer"]
    is_sparse = [False] * n_layer if experts is None else sparse(hf, n_layer)
    layers = tuple(LayerSpec(full if kind == "full_attention" else linear_kind,
                             experts if on else base.ffn, "pre")
                   for kind, on in zip(_kinds(hf, n_layer), is_sparse))
    return dict(fields, layers=layers)


def read_qwen3_next(hf: dict, max_seq_len: int | None) -> dict:
    experts = read_experts(hf, positive_int(hf, "num_experts"), "moe_intermediate_size",
                           normalize=flag(hf, "norm_topk_prob", True),
                           shared_width=positive_int(hf, "shared_expert_intermediate_size"), shared_gate=True)
    return read_hybrid(hf, max_seq_len, experts, qwen_sparse)


def read_qwen3_5(hf: dict, max_seq_len: int | None) -> dict:
    return read_hybrid(hf, max_seq_len)


def read_qwen3_5_moe(hf: dict, max_seq_len: int | None) -> dict:
    """Every layer's feed-forward experts, always renormalised (transformers' router has no switch)."""
    hf = {"intermediate_size": hf.get("moe_intermediate_size"), **hf}  # (no dense layer: its width is unused)
    experts = read_experts(hf, expert_count(hf, "num_experts"), "moe_intermediate_size", normalize=True,
                           shared_width=positive_int(hf, "shared_expert_intermediate_size"), shared_gate=True)
    return read_hybrid(hf, max_seq_len, experts, lambda hf, n: [True] * n)


def _mixers(config: DecoderConfig) -> tuple[AttentionSpec, GatedDeltaNetSpec]:
    """The config's one full-attention spec and one Gated DeltaNet spec (config.json states one of each)."""
    specs = layer_specs(config)
    full = {s.mixer for s in specs if isinstance(s.mixer, AttentionSpec)}
    linear_kind = {s.mixer for s in specs if isinstance(s.mixer, GatedDeltaNetSpec)}
    if len(full) != 1 or len(linear_kind) != 1:
        raise ValueError(f"config.layers must hold one full-attention and one Gated DeltaNet spec for a "
                         f"{config.hf_model_type} checkpoint (got {len(full)} and {len(linear_kind)})")
    return full.pop(), linear_kind.pop()


def write_hybrid(config: DecoderConfig) -> dict:
    full, lin = _mixers(config)
    rope = {**rope_parameters(config.rope_theta, config.rope_scaling),
            "partial_rotary_factor": full.partial_rotary_factor}
    kinds = ["full_attention" if isinstance(s.mixer, AttentionSpec) else "linear_attention"
             for s in layer_specs(config)]
    return {"hidden_act": "silu", "attention_bias": False, "rope_parameters": rope,
            "partial_rotary_factor": full.partial_rotary_factor, "layer_types": kinds,
            "linear_num_key_heads": lin.n_key_head, "linear_num_value_heads": lin.n_value_head,
            "linear_key_head_dim": lin.key_dim, "linear_value_head_dim": lin.value_dim,
            "linear_conv_kernel_dim": lin.conv_kernel}


def write_qwen3_next(config: DecoderConfig) -> dict:
    def own(spec):
        return {"norm_topk_prob": spec.normalize, "shared_expert_intermediate_size": spec.shared.width}

    return {**write_hybrid(config), "use_sliding_window": False, **write_qwen_sparse(config),
            **experts_fields(config, "num_experts", "moe_intermediate_size", own)}


def write_qwen3_5_moe(config: DecoderConfig) -> dict:
    return {**write_hybrid(config),
            **experts_fields(config, "num_experts", "moe_intermediate_size",
                             lambda spec: {"shared_expert_intermediate_size": spec.shared.width})}


def _linear_attention_tensors(d: int, s: GatedDeltaNetSpec, hf: str, block: str, fused: bool) -> list[Tensor]:
    """A Gated DeltaNet layer's `{hf}linear_attn.*` as `{block}/attn/*`: fused (Qwen3-Next) each key
    head's q, k, its value heads' v and z in one `in_proj_qkvz` and their b, a in `in_proj_ba`; else
    (Qwen3.5) `in_proj_qkv` (every head's q, then k, then v), `in_proj_z`, `in_proj_b`, `in_proj_a`."""
    Hk, Hv, Dk, Dv, K = s.n_key_head, s.n_value_head, s.key_dim, s.value_dim, s.conv_kernel
    r, stem, path = Hv // Hk, f"{hf}linear_attn.", (block, "attn")
    shapes = {"wq": (d, Hk, Dk), "wk": (d, Hk, Dk), "wv": (d, Hv, Dv), "wz": (d, Hv, Dv), "wb": (d, Hv), "wa": (d, Hv)}

    def grouped(key: str, name: str, size: int, start: int, stop: int) -> Tensor:  # rows start..stop of each group
        return Tensor(key, (Hk * (stop - start), d), (*path, name), shapes[name], transpose=True,
                      grouped=(size, start, stop))

    if fused:
        G = 2 * Dk + 2 * r * Dv  # one key head's rows of in_proj_qkvz: q, k, then its r value heads' v, z
        qkvz, ba = stem + "in_proj_qkvz.weight", stem + "in_proj_ba.weight"
        table = [grouped(qkvz, "wq", G, 0, Dk), grouped(qkvz, "wk", G, Dk, 2 * Dk),
                 grouped(qkvz, "wv", G, 2 * Dk, 2 * Dk + r * Dv), grouped(qkvz, "wz", G, 2 * Dk + r * Dv, G),
                 grouped(ba, "wb", 2 * r, 0, r), grouped(ba, "wa", 2 * r, r, 2 * r)]
    else:
        qkv, q, v = stem + "in_proj_qkv.weight", Hk * Dk, Hv * Dv
        table = [linear(qkv, (*path, "wq"), shapes["wq"], q, d, rows=(0, q)),
                 linear(qkv, (*path, "wk"), shapes["wk"], q, d, rows=(q, 2 * q)),
                 linear(qkv, (*path, "wv"), shapes["wv"], v, d, rows=(2 * q, 2 * q + v)),
                 *(linear(f"{stem}in_proj_{x}.weight", (*path, f"w{x}"), shapes[f"w{x}"], Hv * (Dv if x == "z" else 1),
                          d) for x in "zba")]
    conv, channels = stem + "conv1d.weight", s.channels  # [channels, 1, K]: q's channels, then k's, then v's
    starts = {"q": (0, Hk, Dk), "k": (Hk * Dk, Hk, Dk), "v": (2 * Hk * Dk, Hv, Dv)}
    table += [Tensor(conv, (heads * width, 1, K), (*path, f"conv_{x}"), (heads, width, K),
                     grouped=(channels, start, start + heads * width)) for x, (start, heads, width) in starts.items()]
    return table + [vector(stem + "dt_bias", (*path, "dt_bias"), Hv), vector(stem + "A_log", (*path, "a_log"), Hv),
                    vector(stem + "norm.weight", (*path, "norm", "weight"), Dv),
                    linear(stem + "out_proj.weight", (*path, "wo"), (Hv, Dv, d), d, Hv * Dv)]


def hybrid_layer(fused: bool):
    """Layer i's tensors: its norms, its mixer's (`self_attn.*` or `linear_attn.*`), its feed-forward's."""
    def tensors(c: DecoderConfig, i: int) -> list[Tensor]:
        hf, block, spec = f"model.layers.{i}.", f"block_{i}", layer_specs(c)[i]
        if isinstance(spec.mixer, AttentionSpec):
            mixer = [*attention_tensors(c.d_model, spec.mixer, hf, block),
                     *attention_extras(c.d_model, spec.mixer, hf, block)]
        else:
            mixer = _linear_attention_tensors(c.d_model, spec.mixer, hf, block, fused)
        return [norm_tensor(c, hf + "input_layernorm.weight", block, "attn_norm"), *mixer,
                norm_tensor(c, hf + "post_attention_layernorm.weight", block, "mlp_norm"),
                *ffn_tensors(c.d_model, spec.ffn, hf, block)]
    return tensors


HYBRID_FEATURES = {"qk_norm": (True,), "norm_plus_one": (True,)}
QWEN3_NEXT = Family("qwen3_next", "Qwen3NextForCausalLM", read_qwen3_next, write_qwen3_next, hybrid_layer(True),
                    HYBRID_FEATURES, ignored=multi_token_prediction)
QWEN3_5 = Family("qwen3_5_text", "Qwen3_5ForCausalLM", read_qwen3_5, write_hybrid, hybrid_layer(False),
                 HYBRID_FEATURES, ignored=multi_token_prediction)
QWEN3_5_MOE = Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", read_qwen3_5_moe, write_qwen3_5_moe,
                     hybrid_layer(False), HYBRID_FEATURES, ignored=multi_token_prediction)
