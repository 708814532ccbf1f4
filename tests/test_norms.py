import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.norms import LayerNorm, RMSNorm


def test_rmsnorm_matches_formula_and_is_not_centred():
    x = jax.random.normal(jax.random.key(0), (4, 7, 32)) * 3 + 1
    w = jax.random.uniform(jax.random.key(1), (32,), minval=0.5, maxval=1.5)
    y = RMSNorm(1e-6).apply({"params": {"weight": w}}, x)
    chex.assert_shape(y, x.shape)
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(w)
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=0)
    assert np.abs(np.asarray(y).mean(-1)).max() > 1e-3  # LayerNorm would give ~0


def test_rmsnorm_init_and_bf16_order():
    x = (jax.random.normal(jax.random.key(2), (3, 16)) * 5).astype(jnp.bfloat16)
    params = RMSNorm().init(jax.random.key(0), x)["params"]
    np.testing.assert_array_equal(params["weight"], np.ones(16))
    w = jnp.linspace(0.5, 2.0, 16)
    y = RMSNorm(1e-6).apply({"params": {"weight": w}}, x)
    assert y.dtype == jnp.bfloat16
    # fp32 statistics, cast back to bf16, then the weight (in bf16): the reference's order.
    x32 = x.astype(jnp.float32)
    normed = (x32 / jnp.sqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(y, normed * w.astype(jnp.bfloat16))


def test_layernorm_matches_formula_in_float64():
    x = jax.random.normal(jax.random.key(3), (4, 7, 32)) * 3 + 1
    scale = jax.random.uniform(jax.random.key(4), (32,), minval=0.5, maxval=1.5)
    bias = jax.random.normal(jax.random.key(5), (32,))
    y = LayerNorm(1e-5).apply({"params": {"scale": scale, "bias": bias}}, x)
    chex.assert_shape(y, x.shape)
    xn = np.asarray(x, np.float64)
    centred = xn - xn.mean(-1, keepdims=True)
    want = centred / np.sqrt((centred ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(scale) + np.asarray(bias)
    np.testing.assert_allclose(y, want, atol=1e-5, rtol=0)
    params = LayerNorm().init(jax.random.key(0), x)["params"]
    np.testing.assert_array_equal(params["scale"], np.ones(32))
    np.testing.assert_array_equal(params["bias"], np.zeros(32))
    assert LayerNorm().apply({"params": params}, x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
