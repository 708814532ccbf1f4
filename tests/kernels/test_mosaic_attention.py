"""The Pallas TPU (Mosaic) flash-attention kernels, run in Pallas's interpreter on the CPU, against
the library's dense attention: outputs and the gradients of q, k and v, feature by feature; and
the kernels lowered for a TPU (`jax.export`), forward and backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_shapes import attention_shapes

from jaxformer.attention import FULL_WINDOW, dot_product_attention
from jaxformer.kernels.mosaic_attention import flash_attention, supports


def _inputs(seed, batch, T, S, n_head, n_kv, head_dim, dtype=jnp.float32, q_scale=1.0):
    """Random q `[batch, T, n_head, head_dim]`, k and v `[batch, S, n_kv, head_dim]`, and an output
    cotangent like q."""
    kq, kk, kv, ko = jax.random.split(jax.random.key(seed), 4)
    q = q_scale * jax.random.normal(kq, (batch, T, n_head, head_dim))
    k = jax.random.normal(kk, (batch, S, n_kv, head_dim))
    v = jax.random.normal(kv, (batch, S, n_kv, head_dim))
    d_out = jax.random.normal(ko, (batch, T, n_head, head_dim))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), d_out.astype(dtype)


def _mask(q_pos, k_pos, window):
    """bool `[batch, T, S]`: key s visible to query t, the rule written out again for the reference."""
    key, query = k_pos[:, None, :], q_pos[:, :, None]
    return (key >= 0) & (key <= query) & (key > query - window)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_q", "block_k"))
def _kernel(q, k, v, q_pos, k_pos, window, d_out, sinks=None, *, scale, softcap, block_q, block_k):
    """The kernels' output and `(dq, dk, dv)` for the cotangent `d_out` (and dsinks, where `sinks`
    are given), in the interpreter."""
    def attend(q, k, v, sinks):
        return flash_attention(q, k, v, q_pos, k_pos, window, scale=scale, softcap=softcap, sinks=sinks,
                               block_q=block_q, block_k=block_k, interpret=True)

    out, vjp = jax.vjp(attend, q, k, v, sinks)
    return out, jax.tree.leaves(vjp(d_out))


@functools.partial(jax.jit, static_argnames=("scale", "softcap"))
def _dense(q, k, v, q_pos, k_pos, window, d_out, sinks=None, *, scale, softcap):
    def attend(q, k, v, sinks):
        return dot_product_attention(q, k, v, _mask(q_pos, k_pos, window), scale=scale, softcap=softcap,
                                     sinks=sinks)[0]

    out, vjp = jax.vjp(attend, q, k, v, sinks)
    return out, jax.tree.leaves(vjp(d_out))


def _reference(*args, **scores):
    """The dense attention's output and `(dq, dk, dv)` for the cotangent `d_out` (and dsinks:
    `_kernel`'s arguments), its matmuls at float32 precision on any backend."""
    with jax.default_matmul_precision("highest"):  # (part of the jit's cache key: compiled so)
        return _dense(*args, **scores)


def _positions(batch, T, S, offsets=None, pads=None):
    """q_pos `[batch, T]` and k_pos `[batch, S]`: row b's keys at positions `0, 1, ...` after
    `pads[b]` empty slots (-1, left padding), its queries the last T of them, shifted by
    `offsets[b]` (queries after the cache)."""
    offsets = [S - T] * batch if offsets is None else offsets
    pads = [0] * batch if pads is None else pads
    k_pos = np.stack([np.arange(S) - pad for pad in pads])
    q_pos = np.stack([np.arange(T) + offset - pad for offset, pad in zip(offsets, pads)])
    return jnp.asarray(q_pos, jnp.int32), jnp.asarray(np.where(k_pos < 0, -1, k_pos), jnp.int32)


# Each case: the shapes (batch, T, S, n_head, n_kv, head_dim), blocks, window and softcap, and
# the positions. Every feature of the semantics is on in at least one case.
CASES = {
    # Causal multi-head attention, T and S whole blocks.
    "causal-mha": dict(shape=(2, 64, 64, 2, 2, 16), blocks=(16, 32)),
    # Grouped-query attention (4 query heads on 2 kv heads), T = S = 40 not a multiple of the
    # blocks: the wrapper pads (keys as empty slots, queries dropped).
    "causal-gqa-ragged": dict(shape=(2, 40, 40, 4, 2, 16), blocks=(16, 16)),
    # A sliding window over 64 positions: a query block reads 2 or 3 of the 4 key blocks. At 18
    # (16 + 2) the first query of a block still sees the last key of the key block two back:
    # a block-skipping test one position too eager fails here.
    "sliding": dict(shape=(2, 64, 64, 4, 2, 32), blocks=(16, 16), window=18),
    # A softcap the scores reach (q scaled up: scores of several caps before capping).
    "softcap": dict(shape=(1, 48, 48, 4, 1, 16), blocks=(16, 16), softcap=2.0, q_scale=4.0, scale=0.5),
    # Rows of different lengths: row 0 left-padded by 12 empty slots, its first 12 queries at
    # negative positions see no key (output 0, no gradient); row 1 unpadded.
    "padded-rows": dict(shape=(2, 48, 48, 4, 2, 16), blocks=(16, 16), pads=[12, 0]),
    # 16 queries after the cache (T != S, S not a multiple of block_k), at positions 40.. in row
    # 0 and 17..32 in row 1, whose last query alone sees the first key of the second key block
    # (32): a block-skipping test one position too eager fails here. With a window.
    "cached-keys": dict(shape=(2, 16, 56, 4, 2, 16), blocks=(16, 32), offsets=[40, 17], window=24),
    # Attention sinks, with GQA, padded rows (blind queries: out 0 with a sink too), a window and a softcap.
    "sinks": dict(shape=(2, 48, 48, 4, 2, 16), blocks=(16, 16), pads=[12, 0], window=20, softcap=3.0, q_scale=2.0,
                  sinks=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_attention(name):
    """Outputs and gradients equal the dense attention's at float32 tolerances; a query that sees
    no key gets 0 and passes no gradient. With "sinks" (gpt-oss's, a logit per query head of about
    the scores' size), their gradient too."""
    case = CASES[name]
    batch, T, S, n_head, n_kv, head_dim = case["shape"]
    q, k, v, d_out = _inputs(0, batch, T, S, n_head, n_kv, head_dim, q_scale=case.get("q_scale", 1.0))
    q_pos, k_pos = _positions(batch, T, S, case.get("offsets"), case.get("pads"))
    window = jnp.int32(case.get("window", FULL_WINDOW))
    scores = dict(scale=case.get("scale"), softcap=case.get("softcap"))
    block_q, block_k = case["blocks"]
    sinks = 2 * jax.random.normal(jax.random.key(1), (n_head,)) if case.get("sinks") else None

    sees = _mask(q_pos, k_pos, window).any(-1)[:, :, None, None]  # [batch, T, 1, 1]
    out, grads = _kernel(q, k, v, q_pos, k_pos, window, d_out, sinks, **scores, block_q=block_q, block_k=block_k)
    # The dense attention gives a blind row the mean of v: its cotangent there is 0 (the
    # kernels got the full cotangent: a blind row must pass nothing back).
    want_out, want_grads = _reference(q, k, v, q_pos, k_pos, window, jnp.where(sees, d_out, 0), sinks, **scores)
    assert len(grads) == len(want_grads) == (3 if sinks is None else 4)

    np.testing.assert_allclose(np.where(sees, out, 0), np.where(sees, want_out, 0), atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.where(sees, 0, out), 0)  # a blind row's output
    for got, want in zip(grads, want_grads):
        # Tolerance relative to the gradient's size: each entry sums O(T) float32 products.
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_bfloat16_within_its_rounding():
    """bfloat16 q, k, v: the output and gradients, in bfloat16, against float32 attention of the
    same (bfloat16-valued) inputs. Scores and sums are float32 in the kernels (bfloat16 products
    are exact in float32), so the error is bfloat16 rounding, each rounding at most 2^-9 of what
    it rounds: the output rounds p before `p @ v` and the result, a weighted mean of v, so at
    most 2 * 2^-9 * max|v|; a gradient rounds p or dS before its matmul, O inside delta and the
    result: 2^-7 of the gradient's size covers those four."""
    batch, T, S, n_head, n_kv, head_dim = 2, 40, 40, 4, 2, 32
    q, k, v, d_out = _inputs(0, batch, T, S, n_head, n_kv, head_dim, dtype=jnp.bfloat16)
    q_pos, k_pos = _positions(batch, T, S, pads=[5, 0])
    window = jnp.int32(16)
    sees = _mask(q_pos, k_pos, window).any(-1)[:, :, None, None]
    out, grads = _kernel(q, k, v, q_pos, k_pos, window, d_out, scale=None, softcap=None, block_q=16, block_k=16)
    f32 = functools.partial(np.asarray, dtype=np.float32)
    want_out, want_grads = _reference(*(jnp.asarray(f32(a)) for a in (q, k, v)), q_pos, k_pos, window,
                                      jnp.where(sees, f32(d_out), 0), scale=None, softcap=None)

    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    np.testing.assert_allclose(np.where(sees, f32(out), 0), np.where(sees, want_out, 0),
                               atol=2 * 2 ** -9 * np.abs(f32(v)).max(), rtol=0)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(f32(got), want, atol=2 ** -7 * np.abs(want).max(), rtol=0)


def test_supports():
    """The Mosaic kernels take float32 and bfloat16 heads of 64 or a multiple of 128."""
    assert supports(128, jnp.bfloat16) and supports(256, jnp.float32) and supports(64, jnp.float32)
    assert not supports(96, jnp.float32) and not supports(128, jnp.float16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu(dtype):
    """Compiled for a TPU (not interpreted), the forward and the gradient lower to Mosaic kernels:
    one TPU custom call for the forward, three for the gradient (the forward, dK/dV and dQ), at
    the default blocks of 128 with heads of 128 and a traced window."""
    args = attention_shapes(1, 256, 384, 4, 2, 128, dtype)

    def attend(q, k, v, q_pos, k_pos, window):
        return flash_attention(q, k, v, q_pos, k_pos, window, softcap=50.0)

    def loss(q, k, v, q_pos, k_pos, window):
        return jnp.sum(attend(q, k, v, q_pos, k_pos, window).astype(jnp.float32) ** 2)

    for f, kernels in ((attend, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
        exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
        assert exported.mlir_module().count("@tpu_custom_call") == kernels
