import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import attention
from jaxformer.attention import FULL_WINDOW, block_paths, decoding_paths, dot_product_attention
from jaxformer.kernels import mosaic_attention, triton_attention
from jaxformer.kernels.decode_attention import decode_attention


def _qkv(seed, batch=2, T=5, S=7, n_head=6, n_kv=2, head_dim=8):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (batch, T, n_head, head_dim)) * 2,
            jax.random.normal(kk, (batch, S, n_kv, head_dim)) * 2,
            jax.random.normal(kv, (batch, S, n_kv, head_dim)))


def test_grouped_einsum_equals_repeated_kv():
    q, k, v = _qkv(0)
    mask = jax.random.bernoulli(jax.random.key(1), 0.7, (2, 5, 7)).at[:, :, 0].set(True)
    out, weights = dot_product_attention(q, k, v, mask)
    chex.assert_shape(out, (2, 5, 6, 8))
    chex.assert_shape(weights, (2, 6, 5, 7))
    # The slow path, in float64 numpy: repeat each kv head n_rep times, contiguously, then plain MHA.
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    mask = np.asarray(mask)
    k_rep, v_rep = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)  # [batch, S, n_head, head_dim]
    scores = np.einsum("bthd,bshd->bhts", q, k_rep) / np.sqrt(8)
    scores = np.where(mask[:, None], scores, -np.inf)
    want_w = np.exp(scores - scores.max(-1, keepdims=True))
    want_w /= want_w.sum(-1, keepdims=True)  # softmax over the keys
    want = np.einsum("bhts,bshd->bthd", want_w, v_rep)
    weights = np.asarray(weights)
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, atol=1e-6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    assert np.where(mask[:, None], 0.0, weights).max() == 0.0  # blocked keys get exactly 0


def test_matches_per_head_numpy_formula():
    q, k, v = _qkv(2, n_head=4, n_kv=4)  # plain multi-head attention
    mask = np.tril(np.ones((5, 7), bool), k=2)
    out, _ = dot_product_attention(q, k, v, jnp.asarray(mask))
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    for b in range(2):
        for h in range(4):
            s = qn[b, :, h] @ kn[b, :, h].T / np.sqrt(8)
            s[~mask] = -np.inf
            w = np.exp(s - s.max(-1, keepdims=True))
            np.testing.assert_allclose(out[b, :, h], (w / w.sum(-1, keepdims=True)) @ vn[b, :, h], atol=1e-5)


def test_fully_masked_row_is_finite():
    q, k, v = _qkv(3)
    mask = jnp.ones((5, 7), bool).at[2].set(False)
    out, weights = dot_product_attention(q, k, v, mask)
    assert bool(jnp.isfinite(out).all()) and bool(jnp.isfinite(weights).all())


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_each_platforms_paths_run_in_the_kernels_interpreter_equal_the_cpus(platform, monkeypatch):
    """What the model calls on a GPU or TPU (`block_paths`, `decoding_paths`: the kernels, their
    arguments laid out as the model passes them), run here in Pallas' interpreter, equals what it
    calls on a CPU: values and gradients in blocks, and a decoding step over rows of different
    lengths, full and sliding, soft-capped."""
    for module in (triton_attention, mosaic_attention):
        monkeypatch.setattr(module, "flash_attention", functools.partial(module.flash_attention, interpret=True))
    monkeypatch.setattr(attention, "decode_attention", functools.partial(decode_attention, interpret=True))
    q, k, v = _qkv(5, batch=2, T=40, S=40, n_head=4, n_kv=2, head_dim=128)
    positions = jnp.tile(jnp.arange(40), (2, 1))
    for window in (FULL_WINDOW, 9):
        args = (positions, positions, jnp.int32(window))
        paths = block_paths(128, q.dtype, softcap=30.0)
        assert paths[platform] is not paths["default"]  # (a kernel takes heads of 128)
        kernel, vjp_kernel = jax.vjp(lambda q, k, v: paths[platform](q, k, v, *args), q, k, v)
        cpu, vjp_cpu = jax.vjp(lambda q, k, v: paths["default"](q, k, v, *args), q, k, v)
        np.testing.assert_allclose(kernel, cpu, atol=2e-5)
        for got, want in zip(vjp_kernel(kernel), vjp_cpu(kernel)):
            np.testing.assert_allclose(got, want, atol=2e-5 * float(jnp.abs(want).max()))
        one = q[:, :1].repeat(2, axis=0)  # 4 rows of one new token, at positions 0, 20, 39 and 7
        cache_k, cache_v = k.repeat(2, axis=0), v.repeat(2, axis=0)
        step = (one, cache_k, cache_v, jnp.array([0, 20, 39, 7]), jnp.int32(window))
        paths = decoding_paths(128, q.dtype, softcap=30.0)
        np.testing.assert_allclose(paths[platform](*step), paths["default"](*step), atol=2e-5)
