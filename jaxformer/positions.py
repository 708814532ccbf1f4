"""Positions: the 2017 sinusoids and rotary position embedding (RoPE); why both, docs/architecture.md.

    sinusoids (added to the embedding):  PE[pos, 2i] = sin(pos / 10000^(2i/d)),  PE[pos, 2i+1] = cos(...)
    RoPE (on q and k in every layer):    rotate channel pair i by pos * rope_theta^(-2i/head_dim)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=None)
def sinusoidal_table(max_seq_len: int, d_model: int) -> np.ndarray:
    """The paper's positional encoding, `[max_seq_len, d_model]` float32 (d_model even), read-only:
    sin on even channels, cos on odd ones."""
    freq = 10000.0 ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # [d_model/2], 1/10000^(2i/d)
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), freq)  # [max_seq_len, d_model/2]
    table = np.empty((max_seq_len, d_model), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=64)
def rope_tables(head_dim: int, n_positions: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """`(cos, sin)` of every angle of positions `0 .. n_positions - 1`, each `[n_positions,
    head_dim // 2]` float32, read-only, for an even `head_dim` and the base `theta`.

    Rows are computed for the next power of two of `n_positions` and shared by every shorter
    table, so asking for many lengths holds a few times the largest one.
    """
    cos, sin = _rope_rows(head_dim, 1 << max(n_positions - 1, 0).bit_length(), theta)
    return cos[:n_positions], sin[:n_positions]  # read-only views


@functools.lru_cache(maxsize=8)
def _rope_rows(head_dim: int, n_positions: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """`rope_tables` computed: `(cos, sin)`, each `[n_positions, head_dim // 2]` float32, read-only."""
    # inv_freq_i = theta^(-2i/d), i = 0 .. d/2 - 1, and the angles pos * inv_freq, both
    # rounded to float32 as the reference, Meta's Llama and Hugging Face compute them: a
    # checkpoint was trained with exactly these angles. (Exact float64 angles drift from
    # them by ~4e-6 rad near position 100, which moves a sharp model's logits by ~1e-4.)
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float64(theta) ** exponent).astype(np.float32)  # [d/2]
    angles = np.outer(np.arange(n_positions, dtype=np.float32), inv_freq)  # [n_positions, d/2] float32
    angles = angles.astype(np.float64)  # cos and sin of those angles, correctly rounded
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos.flags.writeable = sin.flags.writeable = False  # shared by every caller of the cache
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, pairing: str = "split_half") -> jax.Array:
    """Rotates each channel pair `(a, b)` to `(a cos - b sin, a sin + b cos)`.

    Args:
      x: `[batch, seq, heads, head_dim]` queries or keys.
      cos, sin: `[seq, head_dim // 2]` or `[batch, seq, head_dim // 2]`, of `x`'s positions.
      pairing: "split_half" (channel i with i + head_dim/2) or "interleaved" (2i with 2i + 1).

    Returns:
      The rotated `x`, same shape and dtype (rotated in float32).
    """
    x32 = x.astype(jnp.float32)
    cos, sin = cos[..., None, :], sin[..., None, :]  # [..., seq, 1, head_dim/2]: same for every head
    if pairing == "split_half":
        a, b = jnp.split(x32, 2, axis=-1)  # [batch, seq, heads, head_dim/2] each
        rotated = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    elif pairing == "interleaved":
        a, b = x32[..., 0::2], x32[..., 1::2]
        rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)
    else:
        raise ValueError(f"pairing must be 'split_half' or 'interleaved', got {pairing!r}")
    return rotated.astype(x.dtype)


def interleaved_to_split_half(head_dim: int) -> np.ndarray:
    """The channel order `perm`, `[head_dim]`, with `x_split_half = x_interleaved[..., perm]`.

    Split-half channel i is interleaved channel 2i, and i + head_dim/2 is 2i + 1, so each
    pair keeps its frequency. It applies to W_Q and W_K's head_dim axis, never W_V's;
    `np.argsort(perm)` goes back.
    """
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
