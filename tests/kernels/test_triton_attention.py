"""The Triton flash-attention kernels (`jaxformer.kernels.triton_attention`) against the dense
reference, `attention.dot_product_attention`: outputs and gradients, run in Pallas's interpreter on
the CPU; and their lowering for CUDA, exported without a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_shapes import attention_shapes

from jaxformer.attention import FULL_WINDOW, dot_product_attention
from jaxformer.kernels.triton_attention import flash_attention, supports

# The custom call that carries a compiled Triton kernel in an exported module.
TRITON_CALL = "__gpu$xla.gpu.triton"
# bfloat16 keeps 8 significant bits: rounding a number x moves it by at most 2**-9 |x|.
BF16_ROUNDING = 2.0 ** -9


def _inputs(seed, batch, T, S, n_head, n_kv, head_dim, left_pad, dtype=jnp.float32):
    """Random q, k, v and the positions of a batch whose row b is left-padded with `left_pad[b]`
    empty key slots (position -1); the T queries are the last T slots (after `S - T` cached keys),
    so a query in the padding has position -1 and sees no key."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    # Scores of standard deviation ~4 (|q|, |k| ~ 2 sqrt(head_dim), scale 1 / sqrt(head_dim)): a
    # peaked softmax, and a softcap of 2 that bites.
    q = jax.random.normal(kq, (batch, T, n_head, head_dim)) * 2
    k = jax.random.normal(kk, (batch, S, n_kv, head_dim)) * 2
    v = jax.random.normal(kv, (batch, S, n_kv, head_dim))
    slots = jnp.arange(S)[None] - jnp.asarray(left_pad)[:, None]  # [batch, S]
    k_pos = jnp.where(slots < 0, -1, slots).astype(jnp.int32)
    q_pos = k_pos[:, S - T:]
    return (q.astype(dtype), k.astype(dtype), v.astype(dtype)), q_pos, k_pos


def _mask(q_pos, k_pos, window):
    """bool `[batch, T, S]`, the semantics' visibility written out."""
    key, query = k_pos[:, None, :], q_pos[:, :, None]
    return (key >= 0) & (key <= query) & (key > query - window)


@functools.partial(jax.jit, static_argnames=("softcap", "block_q", "block_k"))
def _flash(q, k, v, q_pos, k_pos, window, d_out, sinks, *, softcap, block_q, block_k):
    """The kernels' output and `(dq, dk, dv, dsinks)` for the cotangent `d_out` (dsinks None
    without sinks), one compiled program."""
    out, vjp = jax.vjp(lambda q, k, v, sinks: flash_attention(q, k, v, q_pos, k_pos, window, softcap=softcap,
                                                              sinks=sinks, block_q=block_q, block_k=block_k,
                                                              interpret=True), q, k, v, sinks)
    return out, vjp(d_out)


@functools.partial(jax.jit, static_argnames=("softcap",))
def _dense(q, k, v, mask, d_out, sinks, *, softcap):
    """The reference's output and `(dq, dk, dv, dsinks)` for the cotangent `d_out`."""
    out, vjp = jax.vjp(lambda q, k, v, sinks: dot_product_attention(q, k, v, mask, softcap=softcap, sinks=sinks)[0],
                       q, k, v, sinks)
    return out, vjp(d_out)


def _compare(inputs, q_pos, k_pos, window, softcap, block_q, block_k, out_atol, grad_atol, sinks=None):
    """Checks the kernels against the reference, with `sinks` where given (and their gradient);
    `grad_atol` is relative to each gradient's largest entry.

    The kernels get a cotangent that is random on every row, the reference the same one zeroed on
    the rows that see no key: the kernels must give those rows exactly 0 and pass no gradient
    from them, so the gradients must still agree (the reference gives such rows the mean of v).
    """
    q, k, v = inputs
    window = jnp.int32(window)
    mask = _mask(q_pos, k_pos, window)
    seen = np.asarray(mask.any(-1))[:, :, None, None]  # [batch, T, 1, 1]: the row sees a key
    assert seen.any() and not seen.all()  # every case has both kinds of rows (`padded` empty ones)
    d_out = jax.random.normal(jax.random.key(7), q.shape).astype(q.dtype)
    out, grads = _flash(q, k, v, q_pos, k_pos, window, d_out, sinks, softcap=softcap, block_q=block_q,
                        block_k=block_k)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)  # the reference runs in float32 on the same numbers
    want, want_grads = _dense(f32(q), f32(k), f32(v), mask, jnp.where(seen, f32(d_out), 0.0), sinks, softcap=softcap)
    assert out.dtype == q.dtype and [g.dtype for g in grads[:3]] == [q.dtype] * 3
    np.testing.assert_array_equal(np.where(seen, 0.0, f32(out)), 0.0)  # a row that sees nothing: 0
    np.testing.assert_allclose(np.where(seen, f32(out), 0.0), np.where(seen, want, 0.0), atol=out_atol, rtol=0)
    for name, got, expected in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        if expected is not None:
            np.testing.assert_allclose(f32(got), expected, atol=grad_atol * float(np.abs(expected).max()), rtol=0,
                                       err_msg=name)


# Each case: (T, S, n_head, n_kv, left_pad, window, softcap). Blocks of 16; batch 2, head_dim 16.
# Shapes of one program are shared so that few programs are compiled (the window and positions
# are traced). Row 1 of every case is left-padded past its first query: queries that see nothing.
CASES = {
    "causal": (32, 32, 4, 4, (0, 20), FULL_WINDOW, None),  # multi-head, T and S whole blocks
    "sliding": (32, 32, 4, 4, (0, 20), 5, None),  # a window shorter than a block
    "padded": (32, 32, 4, 4, (5, 26), FULL_WINDOW, None),  # both rows padded, rows of 27 and 6 keys
    "softcap": (32, 32, 4, 4, (0, 20), FULL_WINDOW, 2.0),  # scores ~ +-4 capped to +-2
    "gqa": (32, 32, 6, 2, (0, 20), FULL_WINDOW, None),  # three query heads per kv head
    "cached": (8, 40, 4, 4, (0, 35), FULL_WINDOW, None),  # T < S: 8 queries after 32 cached keys; S padded
    "ragged": (37, 37, 6, 2, (3, 30), 9, 2.0),  # T and S padded to whole blocks, with every other feature
}


@pytest.mark.parametrize("case", CASES)
def test_float32_matches_dense(case):
    T, S, n_head, n_kv, left_pad, window, softcap = CASES[case]
    inputs, q_pos, k_pos = _inputs(0, 2, T, S, n_head, n_kv, 16, left_pad)
    # float32 rounding only (the reference runs with HIGHEST matmul precision, tests/conftest.py).
    _compare(inputs, q_pos, k_pos, window, softcap, 16, 16, out_atol=2e-5, grad_atol=2e-5)


@pytest.mark.parametrize("case", ["gqa", "ragged"])
def test_float32_with_sinks_matches_dense(case):
    """gpt-oss's sinks, a logit per query head of about the scores' size, on the GQA cases (the
    ragged one with a window, a softcap and padding): the output, and the gradients of q, k, v and
    the sinks, against the dense reference's (its autodiff) at the same float32 tolerances."""
    T, S, n_head, n_kv, left_pad, window, softcap = CASES[case]
    inputs, q_pos, k_pos = _inputs(0, 2, T, S, n_head, n_kv, 16, left_pad)
    sinks = 3 * jax.random.normal(jax.random.key(3), (n_head,))
    _compare(inputs, q_pos, k_pos, window, softcap, 16, 16, out_atol=2e-5, grad_atol=2e-5, sinks=sinks)


def test_bfloat16_within_its_rounding():
    """bfloat16 inputs with head_dim 32, GQA, a window and padding, against the float32 reference on
    the same (rounded) inputs. The kernel rounds its output to bfloat16 (up to 2**-9 of it) and,
    as the GPU's matrix units take bfloat16 operands, rounds each block's probabilities before
    `p V` and `p^T dO` and their gradient before `dS K` and `dS^T Q`: a few roundings of 2**-9 each.
    Allowed: 4 roundings of the largest output (a convex combination of the values, so at most
    their largest magnitude), 8 of the largest gradient (a gradient adds the cotangent's own
    rounding and that of dS)."""
    inputs, q_pos, k_pos = _inputs(1, 2, 32, 32, 4, 2, 32, (0, 10), jnp.bfloat16)
    largest_value = float(jnp.abs(inputs[2].astype(jnp.float32)).max())
    _compare(inputs, q_pos, k_pos, 12, None, 16, 16, out_atol=4 * BF16_ROUNDING * largest_value,
             grad_atol=8 * BF16_ROUNDING)


def test_supports_and_refusals():
    assert supports(16, jnp.float32) and supports(128, jnp.bfloat16) and supports(256, "bfloat16")
    assert not supports(8, jnp.float32) and not supports(96, jnp.float32) and not supports(512, jnp.float32)
    assert not supports(64, jnp.float16)
    (q, k, v), q_pos, k_pos = _inputs(0, 1, 16, 16, 2, 2, 16, (0,))
    with pytest.raises(ValueError, match="block sizes"):
        flash_attention(q, k, v, q_pos, k_pos, jnp.int32(4), block_q=24, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attention(q[..., :12], k[..., :12], v[..., :12], q_pos, k_pos, jnp.int32(4), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_cuda(dtype):
    """Without a GPU, `jax.export` for CUDA lowers the kernels to Triton IR: the forward kernel
    for the output, and the forward, dQ and dK/dV kernels for a gradient (GQA with a group of 3,
    a softcap, T and S padded)."""
    args = attention_shapes(2, 40, 72, 6, 2, 32, dtype)

    def forward(q, k, v, q_pos, k_pos, window):
        return flash_attention(q, k, v, q_pos, k_pos, window, softcap=30.0)

    def loss(q, k, v, q_pos, k_pos, window):
        return forward(q, k, v, q_pos, k_pos, window).astype(jnp.float32).sum()

    # A Triton kernel's custom call has no compatibility guarantee across jaxlib versions: allow it.
    export = functools.partial(jax.export.export, platforms=["cuda"],
                               disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])
    for fn, kernels in ((forward, ["flash_attention_forward"]),
                        (jax.grad(loss, argnums=(0, 1, 2)),
                         ["flash_attention_forward", "flash_attention_dq", "flash_attention_dkv"])):
        exported = export(jax.jit(fn))(*args)
        text = exported.mlir_module()
        assert exported.platforms == ("cuda",)
        assert text.count(f"stablehlo.custom_call @{TRITON_CALL}") == len(kernels)
        for kernel in kernels:
            assert f'name = "{kernel}"' in text
