"""Positions: the 2017 sinusoids and rotary position embedding (RoPE); why both, docs/architecture.md.

    sinusoids (added to the embedding):  PE[pos, 2i] = sin(pos / 10000^(2i/d)),  PE[pos, 2i+1] = cos(...)
    RoPE (on q and k in every layer):    rotate channel pair i by pos * rope_theta^(-2i/head_dim)
                                         (its frequencies rescaled for a longer context by `RopeScaling`)
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxformer.config import RopeScaling


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


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None, long: bool = False
                  ) -> np.ndarray:
    """RoPE's inverse frequencies, `[head_dim // 2]` float32: pair i turns by `pos * inv_freq[i]`.

    Args:
      head_dim: channels per head (even).
      theta: the base; unscaled, `inv_freq[i] = theta ** (-2i / head_dim)`.
      scaling: a `RopeScaling` (`config.RopeScaling`) of those frequencies, or None.
      long: "longrope" only: the frequencies of a call that reaches past the trained
        context (`long_factor`), else those within it (`short_factor`); see `rope_frequencies`.

    Returns:
      The frequencies, computed in float32 step by step as Hugging Face computes them
      (docs/architecture.md, "RoPE scaling", says how close that is).
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    powers = (np.float64(theta) ** exponent).astype(np.float32)  # [d/2], theta^(2i/d)
    inv_freq = np.float32(1.0) / powers
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":  # positions divided by factor: angle = (pos / factor) * inv_freq
        return inv_freq / np.float32(scaling.factor)
    if scaling.kind == "yarn":
        return _yarn_inv_freq(powers, theta, scaling)
    if scaling.kind == "longrope":  # each wavelength stretched by its own searched factor
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float32)
        return np.float32(1.0) / (factors * powers)
    if scaling.kind == "proportional":  # the first pairs at the whole head's frequencies, the rest unturned
        turning = int(scaling.partial_rotary_factor * head_dim // 2)
        return np.where(np.arange(head_dim // 2) < turning, inv_freq, np.float32(0)) / np.float32(scaling.factor)
    # llama3: wavelengths past the trained context's `/ low_freq_factor` are stretched by
    # `factor`; those below its `/ high_freq_factor` (local detail) are kept; in between,
    # a blend that is linear in (context / wavelength).
    context, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = np.float32(2 * np.pi) / inv_freq  # [d/2]
    stretched = np.where(wavelength > context / low, inv_freq / np.float32(scaling.factor), inv_freq)
    smooth = (np.float32(context) / wavelength - np.float32(low)) / np.float32(high - low)  # 0 .. 1 in between
    blended = (1 - smooth) * stretched / np.float32(scaling.factor) + smooth * stretched
    between = ~(wavelength < context / high) & ~(wavelength > context / low)
    return np.where(between, blended, stretched).astype(np.float32)


def _yarn_inv_freq(powers: np.ndarray, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's frequencies from pair i's `powers[i] = theta ** (2i/d)`: kept where pair i turns
    more than `beta_fast` times in the trained context, divided by `factor` where fewer
    than `beta_slow`, a linear ramp over the pairs between (transformers' steps, in float32)."""
    head_dim = 2 * powers.shape[0]
    kept, divided = np.float32(1.0) / powers, np.float32(1.0) / (np.float32(scaling.factor) * powers)

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        context = scaling.original_max_position_embeddings
        return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    beta_fast, beta_slow, truncate = scaling.ramp
    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # (a ramp of no width)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = 1 - ramp  # [d/2]: 1 for the fast pairs, 0 for the slow ones
    return (divided * (1 - keep) + kept * keep).astype(np.float32)


def rope_frequencies(position: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """`rope_inv_freq` for a call at `position` (int, any shape): LongRoPE's long or short
    set, as transformers picks it, by whether the call's last position reaches past the
    trained context, for every position of the call; the one set otherwise. (So a cache
    cannot cross that context: `KVCache.create` refuses a capacity past it.)"""
    if scaling is None or scaling.kind != "longrope":
        return rope_inv_freq(head_dim, theta, scaling)
    past = jnp.max(position) + 1 > scaling.original_max_position_embeddings
    return jnp.where(past, rope_inv_freq(head_dim, theta, scaling, long=True), rope_inv_freq(head_dim, theta, scaling))


def rope_attention_factor(scaling: RopeScaling | None) -> float:
    """The scale of RoPE's cos and sin (`RopeScaling.cos_sin_scale`): YaRN's, else 1."""
    return 1.0 if scaling is None else scaling.cos_sin_scale


def rope_cos_sin(position: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """`(scale * cos, scale * sin)` of every angle `position * inv_freq`, computed in the program.

    Args:
      position: int `[T]` or `[batch, T]`, each token's position.
      inv_freq: `[head_dim // 2]` float32, from `rope_inv_freq`.
      scale: `rope_attention_factor` (YaRN's; it scales every score by its square).

    Returns:
      `cos, sin`, each float32 `[..., T, head_dim // 2]`. The angles are float32 products,
      as Hugging Face's; XLA's float32 cos and sin are within an ulp of the exact values.
      Nothing of size `max_seq_len` is made: a 128k-context model's program holds no table.
    """
    angles = position[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., T, head_dim/2]
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * np.float32(scale), jnp.sin(angles) * np.float32(scale)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, pairing: str = "split_half") -> jax.Array:
    """Rotates each channel pair `(a, b)` to `(a cos - b sin, a sin + b cos)`.

    Args:
      x: `[batch, seq, heads, head_dim]` queries or keys.
      cos, sin: `[seq, rotary_dim // 2]` or `[batch, seq, rotary_dim // 2]`, of `x`'s positions: the
        first `rotary_dim` channels of each head turn, the rest pass as they are (partial rotary).
      pairing: "split_half" (channel i with i + rotary_dim/2) or "interleaved" (2i with 2i + 1).

    Returns:
      The rotated `x`, same shape and dtype (rotated in float32).
    """
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin, pairing), x[..., rotary:]], axis=-1)
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
