"""`jaxformer.dropout`: the mask from the key's raw bits, its rate, and the scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.dropout import Dropout, keep_mask, keep_probability


@pytest.mark.parametrize("shape", [(4, 9), (3, 2, 8), (5,), ()])
def test_an_element_is_dropped_when_its_16_bits_fall_below_the_rate_of_two_to_the_16(shape):
    """Element [..., j] reads the high (even j) or low (odd j) half of word [..., j // 2] of
    the key's 32-bit words, drawn for the last axis's pairs (an odd last axis: the last half unread)."""
    key, rate = jax.random.key(7), 0.25
    *lead, last = shape or (1,)
    words = np.asarray(jax.random.bits(key, (*lead, (last + 1) // 2), jnp.uint32))  # the same draw, read directly
    halves = np.empty((*lead, last), np.int64)
    for j in range(last):
        halves[..., j] = words[..., j // 2] >> 16 if j % 2 == 0 else words[..., j // 2] & 0xFFFF
    np.testing.assert_array_equal(keep_mask(key, rate, shape), (halves >= 0.25 * 2**16).reshape(shape))


def test_the_keep_probability_is_the_rate_to_16_bits():
    assert keep_probability(0.25) == 0.75  # 16384 / 2**16 exactly
    assert keep_probability(0.1) == 1 - 6554 / 2**16  # 6553.6 rounded
    assert abs(keep_probability(0.1) - 0.9) < 2**-17
    assert keep_probability(1 - 2**-20) == 2**-16  # (a rate below 1 always keeps something)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_the_share_dropped_is_the_rate(rate):
    """Over 10**6 elements the share dropped is within 5 standard deviations of `rate`."""
    n = 10**6
    dropped = 1 - float(keep_mask(jax.random.key(1), rate, (n,)).mean())
    assert abs(dropped - rate) < 5 * np.sqrt(rate * (1 - rate) / n), dropped


def test_kept_elements_are_scaled_so_the_mean_is_unchanged_and_evaluation_is_the_identity():
    x = jax.random.normal(jax.random.key(0), (64, 32))
    layer = Dropout(0.2)
    out = np.asarray(layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(5)}))
    keep = out != 0  # (x has no zeros)
    np.testing.assert_allclose(out, np.where(keep, np.asarray(x) / keep_probability(0.2), 0.0), rtol=1e-6)
    assert 0.7 < keep.mean() < 0.9
    np.testing.assert_array_equal(layer.apply({}, x, deterministic=True), x)
    np.testing.assert_array_equal(Dropout(0.0).apply({}, x, deterministic=False), x)  # no key asked for
    half = Dropout(0.5).apply({}, x.astype(jnp.bfloat16), deterministic=False, rngs={"dropout": jax.random.key(5)})
    assert half.dtype == jnp.bfloat16
