"""Positions: the 2017 sinusoids, and rotary position embedding (RoPE).

Without positions (and without a causal mask) self-attention is permutation
equivariant: shuffle the inputs and the outputs shuffle the same way.

The 2017 model adds a fixed sinusoid to each embedding (not concatenated):
    PE[pos, 2i] = sin(pos / 10000^(2i/d)),   PE[pos, 2i+1] = cos(pos / 10000^(2i/d)).
Wavelengths grow geometrically from 2 pi to about 10000 * 2 pi, a bank of clocks
running at different speeds. For a fixed offset k, PE[pos + k] is a fixed linear map
(a rotation of each (sin, cos) pair) of PE[pos], so relative offsets are easy to read.

RoPE does not add anything to the input. In every layer it rotates each pair of q/k
channels by an angle proportional to the token's position, `pos * theta_i` with
`theta_i = rope_theta ** (-2i / head_dim)`. A rotation by `m * theta` on the query and
`n * theta` on the key leaves `(m - n) * theta` in their dot product: the position
factor in the score depends only on the offset.

Two pairings are in use and differ only by a fixed permutation of the head channels:
  split_half:  channel i with channel i + head_dim/2 (GPT-NeoX, HF Llama),
  interleaved: channel 2i with channel 2i + 1 (RoFormer, Meta's original Llama).
Weights trained with one pairing need their W_Q / W_K output channels permuted
(`interleaved_to_split_half`) to be used with the other.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.lru_cache(maxsize=None)
def sinusoidal_table(max_seq_len: int, d_model: int) -> np.ndarray:
    """The paper's positional encoding: sin on even channels, cos on odd ones.

    Args:
      max_seq_len: number of positions.
      d_model: model width (even).

    Returns:
      `[max_seq_len, d_model]` float32, read-only (a constant under `jit`).
    """
    freq = 10000.0 ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)  # [d_model/2], 1/10000^(2i/d)
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), freq)  # [max_seq_len, d_model/2]
    table = np.empty((max_seq_len, d_model), np.float32)
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=64)
def rope_tables(head_dim: int, n_positions: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every rotation angle of positions `0 .. n_positions - 1`.

    A model asks for the positions it reads (a call's tokens, or its cache's capacity),
    never for a checkpoint's `max_position_embeddings`, which may be 10**12. Row `p`
    depends on `p` alone, so the rows are computed once for the next power of two of
    `n_positions` and shared by every shorter table: however many lengths are asked for,
    the tables held take a few times the largest one.

    Args:
      head_dim: channels per head (even).
      n_positions: number of positions in the table.
      theta: the RoPE base.

    Returns:
      `(cos, sin)`, each `[n_positions, head_dim // 2]` float32 (read-only numpy arrays:
      under `jit` they become constants, sliced at the cache position).
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
      cos: `[seq, head_dim // 2]` (or `[batch, seq, head_dim // 2]`), the angles of `x`'s
        positions.
      sin: same shape as `cos`.
      pairing: "split_half" or "interleaved" (see the module docstring).

    Returns:
      The rotated `x`, same shape and dtype (the rotation is computed in float32).
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
    """Channel order that turns an interleaved-RoPE head into a split-half one.

    `x_split = x_interleaved[..., perm]`: split-half channel i is interleaved channel 2i
    and split-half channel i + head_dim/2 is interleaved channel 2i + 1, so each rotation
    pair keeps its frequency. Apply it to the head_dim axis of W_Q and W_K (never W_V);
    `np.argsort(perm)` goes the other way.
    """
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
