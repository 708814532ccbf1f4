"""Dropout: each element dropped with probability `rate` (to 16 bits) and the kept ones scaled
by the inverse of the keep probability, so the expected output is the input; off (the
identity) when deterministic.

The mask compares raw random bits with a threshold, 16 bits an element: element i is dropped
when its 16 bits, read as an unsigned integer, are below `round(rate * 2**16)`, a drop
probability within 2**-17 of `rate`; the kept elements are divided by the keep probability
those 16 bits give (`keep_probability`), so the mean is the input's exactly. Why 16 bits, not
32: the masks' random bits are a large part of a small model's training step on a CPU, and
JAX's threefry computes one hash for each 32-bit word it returns, so two elements a word
halve that cost (the reversal demo's update: about 30 ms instead of 40 on a 2-core CPU). A
float uniform draw (`jax.random.bernoulli`) costs more still (the bits turned into floats
first). Two neighbours along the last axis share a word; the mask does not depend on how the
array is split over devices (tests/sharding/eight_devices.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

BITS = 16  # random bits an element reads


def _threshold(rate: float) -> int:
    """The drop threshold on an element's 16 bits: `round(rate * 2**16)`, below 2**16 (rate < 1)."""
    return min(round(rate * 2**BITS), 2**BITS - 1)


def keep_probability(rate: float) -> float:
    """The probability that `keep_mask(key, rate, shape)` keeps an element: `1 - round(rate * 2**16) / 2**16`."""
    return 1 - _threshold(rate) / 2**BITS


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """`[*shape]` bool: True where an element is kept, each with probability `keep_probability(rate)`.
    Element `[..., j]` reads the high 16 bits of word `[..., j // 2]` of `jax.random.bits(key,
    (..., ceil(last / 2)), uint32)` when j is even, its low 16 bits when j is odd."""
    *lead, last = shape or (1,)
    words = jax.random.bits(key, (*lead, (last + 1) // 2), jnp.uint32)  # [..., ceil(last / 2)]
    halves = jnp.stack([words >> 16, words & 0xFFFF], axis=-1).reshape(*lead, -1)[..., :last]  # [..., last]
    return (halves >= jnp.uint32(_threshold(rate))).reshape(shape)


def drop(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
    """`x * keep / keep_probability(rate)`, `keep = keep_mask(key, rate, x.shape)`, in x's dtype."""
    keep = keep_mask(key, rate, x.shape)
    return jnp.where(keep, x / keep_probability(rate), 0).astype(x.dtype)


class Dropout(nn.Module):
    """`drop(x, make_rng("dropout"), rate)`: inverted dropout, as torch's.

    Attributes:
      rate: the probability of dropping an element, in [0, 1).
    """

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0:
            return x
        return drop(x, self.make_rng("dropout"), self.rate)
