import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import RopeScaling
from jaxformer.positions import (
    apply_rope,
    interleaved_to_split_half,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)

HEAD_DIM = 32


def rope_tables(head_dim: int, n_positions: int, theta: float):
    """`(cos, sin)` of positions `0 .. n_positions - 1`, each `[n_positions, head_dim // 2]`."""
    return rope_cos_sin(jnp.arange(n_positions), rope_inv_freq(head_dim, theta))


def _score(q, k, i, j, pairing, cos, sin):
    qi = apply_rope(q, cos[i:i + 1], sin[i:i + 1], pairing)
    kj = apply_rope(k, cos[j:j + 1], sin[j:j + 1], pairing)
    return float(jnp.sum(qi * kj))


def test_angles_match_formula():
    """theta^(-2i/d) and pos * inv_freq rounded to float32 (as the PyTorch reference, Meta
    and Hugging Face compute them), then cos and sin, within 2 ulps: XLA:CPU's float32 cos and
    sin are within 1 of the exact value, a GPU's (CUDA's cosf and sinf) within 2."""
    cos, sin = rope_tables(HEAD_DIM, 64, 10000.0)
    chex.assert_shape([cos, sin], (64, HEAD_DIM // 2))
    inv_freq = np.float32(1) / np.float32(10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    angles32 = np.arange(64, dtype=np.float32)[:, None] * inv_freq[None, :]  # float32 products
    for got, want in ((cos, np.cos(angles32.astype(np.float64))), (sin, np.sin(angles32.astype(np.float64)))):
        ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)  # float32's step at each value
        assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 2 * ulp)
    # Within float32 rounding of the exact angles: at most a few ulps of the largest angle, 63.
    exact = np.arange(64)[:, None] / 10000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    np.testing.assert_allclose(cos, np.cos(exact), rtol=0, atol=2 * 63 * 2.0 ** -23)
    np.testing.assert_allclose(sin, np.sin(exact), rtol=0, atol=2 * 63 * 2.0 ** -23)
    # Per row (a cache's positions): row b's angles are those of its positions.
    position = jnp.asarray([[3, 4, 5], [40, 41, 42]])
    row_cos, row_sin = rope_cos_sin(position, rope_inv_freq(HEAD_DIM, 10000.0))
    chex.assert_shape([row_cos, row_sin], (2, 3, HEAD_DIM // 2))
    np.testing.assert_array_equal(row_cos, np.asarray(cos)[np.asarray(position)])
    np.testing.assert_array_equal(row_sin, np.asarray(sin)[np.asarray(position)])


def test_linear_scaling_divides_every_frequency():
    plain = rope_inv_freq(HEAD_DIM, 10000.0)
    np.testing.assert_array_equal(rope_inv_freq(HEAD_DIM, 10000.0, RopeScaling("linear", 4.0)), plain / np.float32(4))


def test_proportional_rope_turns_its_first_pairs_at_the_whole_heads_frequencies_and_no_others():
    """Gemma 4's global layers: of a 512-wide head, pairs 0 .. 63 (a quarter) turn by `theta ** (-2i / 512)`
    (float64 formula), the other 192 not at all; a factor divides them all."""
    scaling = RopeScaling("proportional", 1.0, partial_rotary_factor=0.25)
    want = np.where(np.arange(256) < 64, 1e6 ** (-2 * np.arange(256) / 512), 0.0)
    np.testing.assert_allclose(rope_inv_freq(512, 1e6, scaling), want, rtol=2e-7, atol=0)
    np.testing.assert_array_equal(rope_inv_freq(512, 1e6, scaling.replace(factor=8.0)),
                                  rope_inv_freq(512, 1e6, scaling) / np.float32(8))


def test_llama3_scaling_keeps_short_wavelengths_stretches_long_ones_and_blends_between():
    """Llama 3.1's rule, written out per frequency in float64: wavelength 2 pi / f below
    context / high_freq_factor kept, above context / low_freq_factor divided by factor,
    between them (1 - s) f / factor + s f with s = (context / wavelength - low) / (high - low)."""
    head_dim, theta = 128, 500000.0
    scaling = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    plain = rope_inv_freq(head_dim, theta).astype(np.float64)
    got = rope_inv_freq(head_dim, theta, scaling)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    wavelength = 2 * np.pi / plain
    s = (8192 / wavelength - 1.0) / (4.0 - 1.0)
    want = np.where(wavelength < 8192 / 4.0, plain, np.where(wavelength > 8192 / 1.0, plain / 8.0,
                                                                (1 - s) * plain / 8.0 + s * plain))
    np.testing.assert_allclose(got, want, rtol=3e-7)  # float32 steps against float64
    kept, stretched = wavelength < 2048, wavelength > 8192
    assert kept.sum() > 10 and stretched.sum() > 10 and (~kept & ~stretched).sum() >= 3  # every branch is taken


@pytest.mark.parametrize("pairing", ["split_half", "interleaved"])
def test_rope_is_relative_and_identity_at_zero(pairing):
    cos, sin = rope_tables(HEAD_DIM, 64, 10000.0)
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, HEAD_DIM))
    a, b, c = (_score(q, k, i, j, pairing, cos, sin) for i, j in [(5, 2), (20, 17), (20, 10)])
    assert abs(a - b) < 1e-4
    assert abs(a - c) > 1e-3
    np.testing.assert_allclose(apply_rope(q, cos[:1], sin[:1], pairing), q, atol=1e-6)


@pytest.mark.parametrize("pairing", ["split_half", "interleaved"])
def test_rope_matches_rotation_matrices(pairing):
    """Each pair (a, b) is rotated by R(m theta_i) = [[cos, -sin], [sin, cos]]."""
    x = jax.random.normal(jax.random.key(1), (2, 5, 3, 8))  # [batch, seq, heads, head_dim]
    cos, sin = rope_tables(8, 16, 10000.0)
    got = apply_rope(x, cos[3:8], sin[3:8], pairing)
    chex.assert_shape(got, x.shape)
    assert got.dtype == x.dtype
    got = np.asarray(got)
    xn = np.asarray(x)
    pairs = [(i, i + 4) for i in range(4)] if pairing == "split_half" else [(2 * i, 2 * i + 1) for i in range(4)]
    for t in range(5):
        for i, (ia, ib) in enumerate(pairs):
            angle = (3 + t) * 10000.0 ** (-2 * i / 8)
            R = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
            want = np.einsum("ij,bhj->bhi", R, np.stack([xn[:, t, :, ia], xn[:, t, :, ib]], -1))
            np.testing.assert_allclose(got[:, t, :, ia], want[..., 0], atol=1e-5)
            np.testing.assert_allclose(got[:, t, :, ib], want[..., 1], atol=1e-5)


def test_pairings_agree_only_after_permuting_channels():
    cos, sin = rope_tables(HEAD_DIM, 64, 10000.0)
    q = jax.random.normal(jax.random.key(2), (1, 24, 2, HEAD_DIM))
    k = jax.random.normal(jax.random.key(3), (1, 24, 2, HEAD_DIM))
    perm = interleaved_to_split_half(HEAD_DIM)

    def scores(q, k, pairing):
        qr, kr = apply_rope(q, cos[:24], sin[:24], pairing), apply_rope(k, cos[:24], sin[:24], pairing)
        return np.asarray(jnp.einsum("bthd,bshd->bhts", qr, kr))

    interleaved = scores(q, k, "interleaved")
    np.testing.assert_allclose(scores(q[..., perm], k[..., perm], "split_half"), interleaved, atol=1e-4)
    assert np.abs(scores(q, k, "split_half") - interleaved).max() > 1e-1  # unpermuted: different
    # The inverse permutation goes back.
    split = scores(q, k, "split_half")
    inv = np.argsort(perm)
    np.testing.assert_allclose(scores(q[..., inv], k[..., inv], "interleaved"), split, atol=1e-4)


@pytest.mark.parametrize("pairing", ["split_half", "interleaved"])
def test_per_row_angles_equal_rowwise_application(pairing):
    """cos/sin may carry a batch axis (each row at its own positions)."""
    cos, sin = rope_tables(8, 32, 10000.0)
    x = jax.random.normal(jax.random.key(4), (2, 3, 5, 8))  # [batch, seq, heads, head_dim]
    starts = (4, 11)
    batched_cos = jnp.stack([cos[s:s + 3] for s in starts])  # [batch, seq, head_dim/2]
    batched_sin = jnp.stack([sin[s:s + 3] for s in starts])
    got = apply_rope(x, batched_cos, batched_sin, pairing)
    chex.assert_shape(got, (2, 3, 5, 8))
    for b, s in enumerate(starts):
        np.testing.assert_array_equal(got[b], apply_rope(x[b:b + 1], cos[s:s + 3], sin[s:s + 3], pairing)[0])


def test_bad_pairing():
    cos, sin = rope_tables(8, 4, 10000.0)
    with pytest.raises(ValueError, match="pairing"):
        apply_rope(jnp.zeros((1, 4, 1, 8)), cos, sin, "adjacent")


def test_yarn_ramps_from_kept_to_divided_and_scales_cos_and_sin():
    """YaRN written out in float64: with L the trained context, the ramp over pair i runs
    from floor(d ln(L / (32 * 2 pi)) / (2 ln theta)) to ceil(d ln(L / (2 pi)) / (2 ln theta));
    fast pairs (before it) kept, slow ones (after) divided by factor; cos and sin times
    0.1 ln(factor) + 1."""
    head_dim, theta, context, factor = 128, 1e6, 32768, 4.0
    scaling = RopeScaling("yarn", factor, context)
    plain = rope_inv_freq(head_dim, theta).astype(np.float64)
    low = math.floor(head_dim * math.log(context / (32 * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(head_dim * math.log(context / (2 * math.pi)) / (2 * math.log(theta)))
    ramp = np.clip((np.arange(head_dim // 2) - low) / (high - low), 0, 1)
    want = plain / factor * ramp + plain * (1 - ramp)
    np.testing.assert_allclose(rope_inv_freq(head_dim, theta, scaling), want, rtol=3e-7)
    assert (ramp == 0).sum() > 5 and (ramp == 1).sum() > 5 and ((ramp > 0) & (ramp < 1)).sum() > 5
    assert rope_attention_factor(scaling) == 0.1 * math.log(factor) + 1
    cos, sin = rope_cos_sin(jnp.arange(8), rope_inv_freq(head_dim, theta, scaling), rope_attention_factor(scaling))
    plain_cos, plain_sin = rope_cos_sin(jnp.arange(8), rope_inv_freq(head_dim, theta, scaling))
    np.testing.assert_allclose(cos, plain_cos * (0.1 * math.log(factor) + 1), rtol=1e-6)
    np.testing.assert_allclose(sin, plain_sin * (0.1 * math.log(factor) + 1), rtol=1e-6)
