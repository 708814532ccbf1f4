"""The decode-attention kernels (`jaxformer.kernels.decode_attention`) against the library's dense attention.

The kernels run in Pallas' interpreter on the CPU; the export tests lower them for a GPU and a TPU
without one (the lowering, not the compilation by the accelerator's compiler)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.attention import FULL_WINDOW, dot_product_attention
from jaxformer.kernels.decode_attention import (
    PLATFORMS,
    _mosaic_kv_block,
    _visible_blocks,
    _visible_slots,
    decode_attention,
    supports,
)


def visible(q_pos, window, S):
    """bool `[B, S]`: slot s is visible to row b (common semantics with T = 1 and k_pos = arange(S))."""
    k_pos, q_pos = np.arange(S)[None, :], np.asarray(q_pos)[:, None]
    return (k_pos >= 0) & (k_pos <= q_pos) & (k_pos > q_pos - window)


def reference(q, k, v, q_pos, window, **scores):
    """The dense attention of `q [B, H, D]` (one token per row) over the cache `k, v [B, S, N, D]`."""
    mask = jnp.asarray(visible(q_pos, window, k.shape[1]))[:, None, :]  # [B, T = 1, S]
    with jax.default_matmul_precision("highest"):
        out, _ = dot_product_attention(q[:, None], k, v, mask, **scores)
    return out[:, 0]


def inputs(B, S, N, H, D, dtype=jnp.float32, seed=0):
    """Random `q [B, H, D]` and cache `k, v [B, S, N, D]`."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, H, D), dtype), jax.random.normal(kk, (B, S, N, D), dtype),
            jax.random.normal(kv, (B, S, N, D), dtype))


# (S, N, H, D, block_k, window, scale, softcap). The rows sit at positions 0, a middle one and S - 1.
CASES = {
    "full_gqa": (64, 2, 4, 16, 16, FULL_WINDOW, None, None),
    "sliding_mha_partial_block": (72, 2, 2, 32, 32, 20, None, None),  # 72 = 2 blocks of 32 and 8 slots
    "softcap_sliding_gqa": (96, 2, 8, 16, 32, 33, 0.3, 5.0),
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", CASES)
def test_matches_dense_attention(platform, case):
    S, N, H, D, block_k, window, scale, softcap = CASES[case]
    q, k, v = inputs(3, S, N, H, D)
    q_pos = jnp.array([0, S // 2 + 3, S - 1], jnp.int32)
    out = decode_attention(q, k, v, q_pos, jnp.int32(window), scale=scale, softcap=softcap, block_k=block_k,
                           platform=platform, interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(out, reference(q, k, v, q_pos, window, scale=scale, softcap=softcap),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("sinks", [None, jnp.array([1.0, -2.0, 0.5, 3.0])], ids=["", "sinks"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_reads_only_the_visible_slots(platform, sinks):
    """Every slot outside a row's window is NaN: the output is finite and the clean cache's. A row at a
    negative position (idle) sees no slot and gets 0, with a sink (gpt-oss's) too."""
    S, N, H, D, window = 72, 2, 4, 16, 20
    q, k, v = inputs(4, S, N, H, D, seed=1)
    q_pos = jnp.array([0, 37, S - 1, -1], jnp.int32)
    seen = jnp.asarray(visible(q_pos, window, S))[:, :, None, None]  # [B, S, 1, 1]
    k_nan, v_nan = jnp.where(seen, k, jnp.nan), jnp.where(seen, v, jnp.nan)
    out = decode_attention(q, k_nan, v_nan, q_pos, jnp.int32(window), sinks=sinks, block_k=16, platform=platform,
                           interpret=True)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:3], reference(q, k, v, q_pos, window, sinks=sinks)[:3], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[3], 0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_bfloat16(platform):
    """bfloat16 q, k, v against float32 attention on the same (upcast) values. The scores are exact (a
    product of two bfloat16 is exact in float32, summed in float32); what rounds is each weight, cast to
    bfloat16 to meet v (relative error <= 2**-9; the weights sum to 1, so the output moves by at most
    2**-9 * max|v|), and the output, rounded to bfloat16 (at most 2**-9 * |out| <= 2**-9 * max|v|):
    together at most 2**-8 * max|v|."""
    S, N, H, D, window = 64, 2, 8, 32, 40
    q, k, v = inputs(3, S, N, H, D, jnp.bfloat16, seed=2)
    q_pos = jnp.array([0, 29, S - 1], jnp.int32)
    out = decode_attention(q, k, v, q_pos, jnp.int32(window), block_k=16, platform=platform, interpret=True)
    assert out.dtype == jnp.bfloat16
    up = [a.astype(jnp.float32) for a in (q, k, v)]
    bound = 2.0 ** -8 * float(jnp.abs(up[2]).max())
    # (The 1% over the bound leaves room for the float32 reference's own rounding, ~1e-7 relative.)
    np.testing.assert_allclose(out.astype(jnp.float32), reference(*up, q_pos, window), atol=bound * 1.01, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, FULL_WINDOW])
def test_visible_blocks_are_the_blocks_with_a_visible_slot(window):
    """The Triton loop bounds (and the Mosaic compute condition) `[first, end)` are exactly the key blocks
    holding a visible slot, for every position in the cache and idle (negative) ones."""
    S, block_k = 72, 16
    q_pos = np.arange(-2, S)
    lo, hi = _visible_slots(jnp.asarray(q_pos), window, S)
    first, end = np.asarray(_visible_blocks(lo, hi, S, block_k))
    for b, row in enumerate(visible(q_pos, window, S)):
        assert set(range(first[b], end[b])) == set(np.flatnonzero(row) // block_k)
        assert 0 <= first[b] < -(-S // block_k)


@pytest.mark.parametrize("window", [1, 17, 40, FULL_WINDOW])
def test_mosaic_fetches_each_visible_block_once_and_no_other(window):
    """Along the key-block axis the Mosaic index map of K and V gives the row's visible blocks, in order,
    each once (in one run of equal indices: a repeated index is not fetched again), and no other block; a
    row that sees nothing fetches block 0 only."""
    S, block_k = 72, 16
    n_blocks = -(-S // block_k)
    for q_pos in range(-1, S):
        indices = np.asarray(_mosaic_kv_block(0, jnp.arange(n_blocks), np.array([q_pos]), np.array([window]),
                                              S=S, block_k=block_k))
        runs = [int(i) for n, i in enumerate(indices) if n == 0 or i != indices[n - 1]]
        wanted = sorted(set(np.flatnonzero(visible([q_pos], window, S)[0]) // block_k)) or [0]
        assert runs == wanted


def test_supports():
    assert supports(128, jnp.bfloat16, "triton") and supports(16, jnp.float32, "triton")
    assert not supports(96, jnp.float32, "triton") and not supports(8, jnp.float32, "triton")
    assert supports(128, jnp.float32, "mosaic") and supports(256, jnp.bfloat16, "mosaic")
    assert not supports(64, jnp.float32, "mosaic")
    assert not supports(128, jnp.float16, "triton") and not supports(128, jnp.float16, "mosaic")


@pytest.mark.parametrize("platform, target, block_k", [("triton", "__gpu$xla.gpu.triton", 128),
                                                       ("mosaic", "tpu_custom_call", 256)])
def test_exports_for_its_accelerator(platform, target, block_k):
    """At a real size (head_dim 128), the kernel lowers for its accelerator into that backend's custom call."""
    B, S, N, H, D = 4, 2048, 8, 32, 128
    cache = jax.ShapeDtypeStruct((B, S, N, D), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((B, H, D), jnp.bfloat16), cache, cache, jax.ShapeDtypeStruct((B,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32))
    f = functools.partial(decode_attention, softcap=50.0, block_k=block_k, platform=platform)
    # The Triton call carries its kernel as Triton IR, which has no compatibility guarantee across releases;
    # export refuses it unless told.
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(target)] if platform == "triton" else []
    exported = jax.export.export(jax.jit(f), platforms=[{"triton": "cuda", "mosaic": "tpu"}[platform]],
                                 disabled_checks=unchecked)(*args)
    assert f"stablehlo.custom_call @{target}(" in exported.mlir_module()
    assert exported.out_avals[0].shape == (B, H, D) and exported.out_avals[0].dtype == jnp.bfloat16
