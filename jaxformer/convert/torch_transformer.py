"""Load the weights of PyTorch's `torch.nn.Transformer` into a `VanillaTransformer`.

The same layers, stored differently: every torch `Linear` is `[out, in]`, and the packed
`in_proj_weight` stacks W_Q, W_K, W_V by head. The name table, and what the config must
match by hand, are in docs/parity.md ("PyTorch nn.Transformer").
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import VanillaConfig


def _to_numpy(value) -> np.ndarray:
    """A torch tensor (any device or float dtype) or array-like, as float32 numpy."""
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().float().numpy()
    return np.asarray(value, np.float32)


def _attention_shapes(prefix: str, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.in_proj_weight": (3 * d, d), f"{prefix}.in_proj_bias": (3 * d,),
            f"{prefix}.out_proj.weight": (d, d), f"{prefix}.out_proj.bias": (d,)}


def _ffn_shapes(prefix: str, d: int, d_ff: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.linear1.weight": (d_ff, d), f"{prefix}.linear1.bias": (d_ff,),
            f"{prefix}.linear2.weight": (d, d_ff), f"{prefix}.linear2.bias": (d,)}


def _norm_shapes(prefix: str, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (d,), f"{prefix}.bias": (d,)}


def _expected_shapes(config: VanillaConfig) -> dict[str, tuple[int, ...]]:
    """Every key of `nn.Transformer(...).state_dict()` for `config`, with its torch shape."""
    d, d_ff = config.d_model, config.d_ff
    shapes = {}
    for i in range(config.n_layer):
        enc, dec = f"encoder.layers.{i}", f"decoder.layers.{i}"
        shapes |= _attention_shapes(f"{enc}.self_attn", d) | _ffn_shapes(enc, d, d_ff)
        shapes |= _norm_shapes(f"{enc}.norm1", d) | _norm_shapes(f"{enc}.norm2", d)
        shapes |= _attention_shapes(f"{dec}.self_attn", d) | _attention_shapes(f"{dec}.multihead_attn", d)
        shapes |= _ffn_shapes(dec, d, d_ff)
        for norm in ("norm1", "norm2", "norm3"):
            shapes |= _norm_shapes(f"{dec}.{norm}", d)
    return shapes | _norm_shapes("encoder.norm", d) | _norm_shapes("decoder.norm", d)


def _check_shape(name: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if array.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {array.shape}")
    return array


def _check_layer_counts(state_dict, config: VanillaConfig) -> None:
    for stack in ("encoder", "decoder"):
        indices = {m.group(1) for key in state_dict if (m := re.match(rf"{stack}\.layers\.(\d+)\.", key))}
        if len(indices) != config.n_layer:
            raise ValueError(f"the state dict has {len(indices)} {stack} layers ('{stack}.layers.<i>.*' keys), "
                             f"config.n_layer is {config.n_layer}")


def _check_keys(state_dict, expected) -> None:
    missing, unknown = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unknown:
        raise ValueError(f"the state dict does not match nn.Transformer's keys: missing {missing}, unknown {unknown}")


def _attention(sd, prefix: str, config: VanillaConfig) -> dict[str, np.ndarray]:
    """torch's packed `MultiheadAttention` -> jaxformer's `MultiHeadAttention`."""
    d, H, D = config.d_model, config.n_head, config.head_dim
    w_in = sd[f"{prefix}.in_proj_weight"].reshape(3, H, D, d)  # [Q/K/V, n_head, head_dim, d_model]
    return {
        "w_qkv": w_in.transpose(3, 0, 1, 2),  # [d_model, 3, n_head, head_dim]
        "b_qkv": sd[f"{prefix}.in_proj_bias"].reshape(3, H, D),  # [3, n_head, head_dim]
        "w_o": sd[f"{prefix}.out_proj.weight"].T.reshape(H, D, d),  # [n_head, head_dim, d_model]
        "b_o": sd[f"{prefix}.out_proj.bias"],  # [d_model]
    }


def _ffn(sd, prefix: str) -> dict[str, np.ndarray]:
    return {"w1": sd[f"{prefix}.linear1.weight"].T, "b1": sd[f"{prefix}.linear1.bias"],  # [d_model, d_ff]
            "w2": sd[f"{prefix}.linear2.weight"].T, "b2": sd[f"{prefix}.linear2.bias"]}  # [d_ff, d_model]


def _norm(sd, prefix: str) -> dict[str, np.ndarray]:
    return {"scale": sd[f"{prefix}.weight"], "bias": sd[f"{prefix}.bias"]}


def _encoder_layer(sd, prefix: str, config: VanillaConfig) -> dict:
    return {"self_attn": _attention(sd, f"{prefix}.self_attn", config),
            "attn_residual": {"norm": _norm(sd, f"{prefix}.norm1")},
            "ffn": _ffn(sd, prefix),
            "ffn_residual": {"norm": _norm(sd, f"{prefix}.norm2")}}


def _decoder_layer(sd, prefix: str, config: VanillaConfig) -> dict:
    return {"self_attn": _attention(sd, f"{prefix}.self_attn", config),
            "self_residual": {"norm": _norm(sd, f"{prefix}.norm1")},
            "cross_attn": _attention(sd, f"{prefix}.multihead_attn", config),
            "cross_residual": {"norm": _norm(sd, f"{prefix}.norm2")},
            "ffn": _ffn(sd, prefix),
            "ffn_residual": {"norm": _norm(sd, f"{prefix}.norm3")}}


def _embeddings(config: VanillaConfig, src_embedding, tgt_embedding, out_proj_weight, out_proj_bias) -> dict:
    """The embedding and output parameters, from torch's `nn.Embedding` / `nn.Linear` layouts."""
    c = config
    if out_proj_bias is None:
        out_bias = np.zeros((c.tgt_vocab_size,), np.float32)
    else:
        out_bias = _check_shape("out_proj_bias", _to_numpy(out_proj_bias), (c.tgt_vocab_size,))
    src = _check_shape("src_embedding", _to_numpy(src_embedding), (c.src_vocab_size, c.d_model))
    if c.tie_embeddings:  # one matrix embeds both sides and is the output projection
        if tgt_embedding is not None or out_proj_weight is not None:
            raise ValueError("config.tie_embeddings is True: pass only src_embedding (it is also the target "
                             "embedding and the output projection), not tgt_embedding or out_proj_weight")
        return {"embed": src, "out_bias": out_bias}
    if tgt_embedding is None or out_proj_weight is None:
        raise ValueError("config.tie_embeddings is False: pass src_embedding, tgt_embedding and out_proj_weight")
    out_w = _check_shape("out_proj_weight", _to_numpy(out_proj_weight), (c.tgt_vocab_size, c.d_model))
    return {"src_embed": src,
            "tgt_embed": _check_shape("tgt_embedding", _to_numpy(tgt_embedding), (c.tgt_vocab_size, c.d_model)),
            "out_proj": out_w.T,  # [d_model, tgt_vocab_size]
            "out_bias": out_bias}


def from_torch_transformer(state_dict, config: VanillaConfig, *, src_embedding, tgt_embedding=None,
                           out_proj_weight=None, out_proj_bias=None) -> dict:
    """`VanillaTransformer` parameters from a `torch.nn.Transformer` state dict.

    Args:
      state_dict: `nn.Transformer(...).state_dict()`, keys as torch names them (strip any
        prefix of an enclosing module first); values torch tensors or arrays.
      config: a `VanillaConfig` matching the torch model, `final_norm=True`; `n_head`,
        `norm_first` and `norm_eps` (torch's `layer_norm_eps`) are unchecked, since the
        weights cannot show them.
      src_embedding: `[src_vocab_size, d_model]`, the source `nn.Embedding.weight`; with
        `config.tie_embeddings` also the target embedding and the output projection.
      tgt_embedding: `[tgt_vocab_size, d_model]` target embedding (untied only).
      out_proj_weight: `[tgt_vocab_size, d_model]` output `nn.Linear.weight` (untied only).
      out_proj_bias: `[tgt_vocab_size]` output bias; None for zeros.

    Returns:
      The `params` tree of `VanillaTransformer(config)`, float32 jax arrays.

    Raises:
      TypeError: `config` is not a `VanillaConfig`.
      ValueError: `config.has_final_norm` is False; the layer counts differ from
        `config.n_layer`; keys are missing or unknown; a shape does not match the config;
        the embedding arguments do not fit `config.tie_embeddings`.
    """
    if not isinstance(config, VanillaConfig):
        raise TypeError(f"config must be a VanillaConfig, got {type(config).__name__}")
    if not config.has_final_norm:
        raise ValueError("nn.Transformer ends both stacks in a LayerNorm (encoder.norm, decoder.norm): "
                         "set VanillaConfig.final_norm=True")
    _check_layer_counts(state_dict, config)
    shapes = _expected_shapes(config)
    _check_keys(state_dict, shapes)
    sd = {key: _check_shape(key, _to_numpy(value), shapes[key]) for key, value in state_dict.items()}

    params = _embeddings(config, src_embedding, tgt_embedding, out_proj_weight, out_proj_bias)
    for i in range(config.n_layer):
        params[f"encoder_layers_{i}"] = _encoder_layer(sd, f"encoder.layers.{i}", config)
        params[f"decoder_layers_{i}"] = _decoder_layer(sd, f"decoder.layers.{i}", config)
    params["encoder_norm"] = _norm(sd, "encoder.norm")
    params["decoder_norm"] = _norm(sd, "decoder.norm")
    return jax.tree.map(jnp.asarray, params)
