"""Model configurations: frozen dataclasses that validate themselves.

One config is threaded through every module. Derive variants with
`dataclasses.replace(config, ...)` (or `config.replace(...)`): the new value is
validated again, so an inconsistent config can never reach a model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

ROPE_PAIRINGS = ("split_half", "interleaved")


def swiglu_hidden_dim(d_model: int) -> int:
    """The reference's SwiGLU width: 8/3 * d_model rounded to a multiple of 64.

    SwiGLU has three matrices instead of two, so 8/3 * d keeps the parameter count
    of a 4 * d two-matrix FFN (3 * d * 8d/3 == 2 * d * 4d).
    """
    return int(round(d_model * 8 / 3 / 64) * 64)


def _require(condition: bool, field: str, rule: str, value: Any) -> None:
    if not condition:
        raise ValueError(f"DecoderConfig.{field}: {rule} (got {value!r})")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The modern decoder-only Transformer (RMSNorm, RoPE, GQA, SwiGLU, KV cache).

    Defaults are the reference's. `hidden_dim=None` means `swiglu_hidden_dim(d_model)`
    (read the resolved width from `ffn_dim`), so `replace(d_model=...)` rescales it.

    Attributes:
      vocab_size: number of token ids; valid ids are `0 .. vocab_size - 1`.
      n_layer: number of pre-norm blocks.
      n_head: query heads.
      n_kv_head: key/value heads; each serves `n_head // n_kv_head` query heads (GQA).
      d_model: residual stream width; head_dim is `d_model // n_head`.
      max_seq_len: longest sequence (prompt plus generated tokens) the model accepts.
      rope_theta: RoPE base; pair i rotates by `pos * rope_theta ** (-2i / head_dim)`.
      norm_eps: RMSNorm epsilon.
      hidden_dim: SwiGLU hidden width, or None for the reference's rule.
      rope_pairing: "split_half" (channel i with i + head_dim/2: GPT-NeoX, HF Llama) or
        "interleaved" (channels 2i, 2i+1: RoFormer, Meta's original Llama).
      tie_embeddings: the output head reuses the token embedding matrix.
      dtype: activation and compute dtype (parameters are stored in float32).
    """

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int = 2
    d_model: int = 256
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    hidden_dim: int | None = None
    rope_pairing: str = "split_half"
    tie_embeddings: bool = True
    dtype: Any = jnp.float32

    def __post_init__(self):
        for field in ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "max_seq_len"):
            value = getattr(self, field)
            _require(type(value) is int and value > 0, field, "must be a positive int", value)
        _require(self.hidden_dim is None or (type(self.hidden_dim) is int and self.hidden_dim > 0),
                 "hidden_dim", "must be None or a positive int", self.hidden_dim)
        _require(self.rope_theta > 0, "rope_theta", "must be > 0", self.rope_theta)
        _require(self.norm_eps > 0, "norm_eps", "must be > 0", self.norm_eps)
        _require(self.d_model % self.n_head == 0, "d_model",
                 f"must be divisible by n_head={self.n_head}", self.d_model)
        _require(self.n_head % self.n_kv_head == 0, "n_head",
                 f"must be divisible by n_kv_head={self.n_kv_head}", self.n_head)
        _require(self.head_dim % 2 == 0, "d_model",
                 f"d_model // n_head (head_dim={self.head_dim}) must be even for RoPE pairs",
                 self.d_model)
        _require(self.rope_pairing in ROPE_PAIRINGS, "rope_pairing",
                 f"must be one of {ROPE_PAIRINGS}", self.rope_pairing)
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError:
            dtype = None
        _require(dtype is not None and jnp.issubdtype(dtype, jnp.floating), "dtype",
                 "must be a floating dtype", self.dtype)
        object.__setattr__(self, "dtype", dtype)  # normalise "bfloat16", jnp.bfloat16, ...

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden width: `hidden_dim`, or the reference's rule when it is None."""
        return self.hidden_dim if self.hidden_dim is not None else swiglu_hidden_dim(self.d_model)

    @property
    def n_rep(self) -> int:
        """Query heads per kv head."""
        return self.n_head // self.n_kv_head

    def replace(self, **changes) -> "DecoderConfig":
        return dataclasses.replace(self, **changes)
