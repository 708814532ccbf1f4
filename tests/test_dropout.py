"""`jaxformer.dropout`: the mask from the key's raw bits, its rate, and the scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.dropout import Dropout, keep_mask


def test_an_element_is_dropped_when_its_32_bits_fall_below_the_rate_of_two_to_the_32():
    key = jax.random.key(7)
    bits = np.asarray(jax.random.bits(key, (4, 9), jnp.uint32), np.float64)  # the same draw, read directly
    np.testing.assert_array_equal(keep_mask(key, 0.25, (4, 9)), bits >= 0.25 * 2**32)


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
    np.testing.assert_allclose(out, np.where(keep, np.asarray(x) / 0.8, 0.0), rtol=1e-6)
    assert 0.7 < keep.mean() < 0.9
    np.testing.assert_array_equal(layer.apply({}, x, deterministic=True), x)
    np.testing.assert_array_equal(Dropout(0.0).apply({}, x, deterministic=False), x)  # no key asked for
    half = Dropout(0.5).apply({}, x.astype(jnp.bfloat16), deterministic=False, rngs={"dropout": jax.random.key(5)})
    assert half.dtype == jnp.bfloat16
