"""Dropout: each element kept with probability `1 - rate` and scaled by `1 / (1 - rate)`, so
the expected output is the input; off (the identity) when deterministic.

The mask compares raw random bits with a threshold: element i is dropped when its 32
random bits, read as an unsigned integer, are below `round(rate * 2**32)`, a probability
of `rate` to within 2**-33. A float uniform draw (`jax.random.bernoulli`) costs about three
times as much on a CPU (the bits turned into floats first), and the masks' random bits
are a large part of a small model's training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """`[*shape]` bool: True where an element is kept, each with probability `1 - rate`."""
    threshold = min(round(rate * 2**32), 2**32 - 1)  # (rate < 1)
    return jax.random.bits(key, shape, jnp.uint32) >= jnp.uint32(threshold)


class Dropout(nn.Module):
    """`x * keep / (1 - rate)`, `keep = keep_mask(make_rng("dropout"), rate, x.shape)`.

    Attributes:
      rate: the probability of dropping an element, in [0, 1).
    """

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0:
            return x
        keep = keep_mask(self.make_rng("dropout"), self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0).astype(x.dtype)
