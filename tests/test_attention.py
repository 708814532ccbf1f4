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


# bfloat16 keeps 8 significant bits: rounding a number x moves it by at most 2**-9 |x|.
BF16_ROUNDING = 2.0 ** -9


@pytest.mark.parametrize("platform, dtype", [("cuda", jnp.bfloat16), ("tpu", jnp.float32)])
def test_each_platforms_paths_run_in_the_kernels_interpreter_equal_the_cpus(platform, dtype, monkeypatch):
    """What the model calls on a GPU or TPU (`block_paths`, `decoding_paths`: the kernels, their
    arguments laid out as the model passes them), run here in Pallas' interpreter, equals what it
    calls on a CPU: values and gradients in blocks, and a decoding step over rows of different
    lengths, full and sliding, soft-capped. In float32 exactly but for the order of sums; in
    bfloat16 (the GPU's kernel dtype) within a few roundings of each side: the output, a convex
    combination of the values, within 8 of the largest value (4 a side, as the kernel's own test
    allows), a gradient within 16 of the largest."""
    for module in (triton_attention, mosaic_attention):
        monkeypatch.setattr(module, "flash_attention", functools.partial(module.flash_attention, interpret=True))
    monkeypatch.setattr(attention, "decode_attention", functools.partial(decode_attention, interpret=True))
    q, k, v = (a.astype(dtype) for a in _qkv(5, batch=2, T=40, S=40, n_head=4, n_kv=2, head_dim=128))
    positions = jnp.tile(jnp.arange(40), (2, 1))
    exact = dtype == jnp.float32
    out_atol = 2e-5 if exact else 8 * BF16_ROUNDING * float(jnp.abs(v.astype(jnp.float32)).max())
    grad_atol = 2e-5 if exact else 16 * BF16_ROUNDING

    def close(got, want, atol):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol)

    for window in (FULL_WINDOW, 9):
        args = (positions, positions, jnp.int32(window))
        paths = block_paths(128, q.dtype, softcap=30.0)
        assert paths[platform] is not paths["default"]  # (a kernel takes heads of 128 in this dtype)
        kernel, vjp_kernel = jax.vjp(lambda q, k, v, f=paths[platform], a=args: f(q, k, v, *a), q, k, v)
        cpu, vjp_cpu = jax.vjp(lambda q, k, v, f=paths["default"], a=args: f(q, k, v, *a), q, k, v)
        close(kernel, cpu, out_atol)
        for got, want in zip(vjp_kernel(kernel), vjp_cpu(kernel)):
            close(got, want, grad_atol * float(jnp.abs(want.astype(jnp.float32)).max()))
        one = q[:, :1].repeat(2, axis=0)  # 4 rows of one new token, at positions 0, 20, 39 and 7
        cache_k, cache_v = k.repeat(2, axis=0), v.repeat(2, axis=0)
        step = (one, cache_k, cache_v, jnp.array([0, 20, 39, 7]), jnp.int32(window))
        paths = decoding_paths(128, q.dtype, softcap=30.0)
        close(paths[platform](*step), paths["default"](*step), out_atol)


def test_a_gpu_attends_in_blocks_with_its_kernel_in_bfloat16_alone():
    """In float32 the Triton kernels were several times slower than the `jnp` blocks on a GPU
    (`attention.KERNEL_DTYPES`): there the model attends with the `jnp` blocks; a TPU's kernel
    takes both."""
    for dtype, cuda_kernel in ((jnp.float32, False), (jnp.bfloat16, True)):
        paths = block_paths(128, dtype)
        assert (paths["cuda"] is not paths["default"]) == cuda_kernel
        assert paths["tpu"] is not paths["default"]
    narrow = block_paths(100, jnp.bfloat16)  # (a head the kernel does not take)
    assert narrow["cuda"] is narrow["default"]
