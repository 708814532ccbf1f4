"""Attention in blocks equals the dense attention, values and gradients, on every feature the
decoder uses; and its memory grows linearly in the length, where the dense one's grows as its square."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import with_sinks

from jaxformer import Decoder, DecoderConfig
from jaxformer.attention import FULL_WINDOW, Visibility, attend, dot_product_attention
from jaxformer.blockwise import blockwise_attention, visible


def _qkv(seed, batch, T, S, n_head, n_kv, head_dim, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (batch, T, n_head, head_dim), dtype) * 2,
            jax.random.normal(kk, (batch, S, n_kv, head_dim), dtype) * 2,
            jax.random.normal(kv, (batch, S, n_kv, head_dim), dtype))


# (T, S, n_head, n_kv, window, softcap, layout): layout "causal" queries are the last T of S
# keys; "padded" row 0 is left-padded (its first 9 slots empty, a query of it sees nothing)
# and row 1 starts later; "offset" queries come after S cached keys.
CASES = {
    "causal, GQA": (40, 40, 4, 2, FULL_WINDOW, None, "causal"),
    "causal, MHA": (40, 40, 2, 2, FULL_WINDOW, None, "causal"),
    "sliding window": (40, 40, 4, 1, 7, None, "causal"),
    "softcap": (40, 40, 4, 2, FULL_WINDOW, 5.0, "causal"),
    "sliding and softcap": (33, 50, 6, 2, 11, 3.0, "causal"),
    "padded rows": (30, 45, 4, 2, FULL_WINDOW, None, "padded"),
    "queries after a cache": (5, 37, 4, 2, FULL_WINDOW, None, "offset"),
}


def _positions(T, S, layout):
    if layout == "causal":
        return jnp.tile(jnp.arange(S - T, S), (2, 1)), jnp.tile(jnp.arange(S), (2, 1))
    if layout == "padded":
        k_pos = jnp.stack([jnp.where(jnp.arange(S) < 9, -1, jnp.arange(S) - 9), jnp.arange(S)])
        q_pos = jnp.stack([jnp.arange(T) - 9 + S - T, jnp.arange(T) + 3])  # row 0's first queries: padding too
        return q_pos.at[0, 0].set(-5), k_pos
    return jnp.tile(jnp.arange(S, S + T), (2, 1)), jnp.tile(jnp.arange(S), (2, 1))


# One program per case's shapes for both computations and their VJPs: run eagerly, each
# operation of the dense reference and of both backward passes would compile on its own.
@functools.partial(jax.jit, static_argnames="softcap")
def _dense_and_blocks(q, k, v, q_pos, k_pos, window, cotangent, softcap, sinks=None):
    """The dense attention (0 for a query that sees nothing) and the blocks' (blocks of 8 queries
    and 16 keys: T and S are not whole blocks), with `sinks` where given, and the gradients of each
    w.r.t. q, k, v and the sinks (None without) at `cotangent`: `(want, got, dense_grads, blocks_grads)`."""
    mask = visible(q_pos, k_pos, window)  # [2, T, S]
    sees = mask.any(-1)  # [2, T]

    def dense(q, k, v, sinks):
        out = dot_product_attention(q, k, v, mask, softcap=softcap, sinks=sinks)[0]
        return jnp.where(sees[..., None, None], out, 0)

    def blocks(q, k, v, sinks):
        return blockwise_attention(q, k, v, q_pos, k_pos, window, softcap=softcap, sinks=sinks, block_q=8, block_k=16)

    want, dense_vjp = jax.vjp(dense, q, k, v, sinks)
    got, blocks_vjp = jax.vjp(blocks, q, k, v, sinks)
    return want, got, dense_vjp(cotangent), blocks_vjp(cotangent)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_blocks_equal_dense_attention_values_and_gradients(case, sinks):
    """... and with gpt-oss's sinks (a logit per query head, of the scores' size), their gradient
    too: the blocks' own backward (`blockwise.sink_grads`) against autodiff of the dense softmax."""
    T, S, n_head, n_kv, window, softcap, layout = CASES[case]
    q, k, v = _qkv(0, 2, T, S, n_head, n_kv, 8)
    q_pos, k_pos = _positions(T, S, layout)
    if layout == "offset":  # the queries' own keys are not among these: let them see the last 20 cached ones
        q_pos, window = q_pos - 1, 20
    window = jnp.int32(window)
    sees = visible(q_pos, k_pos, window).any(-1)  # [2, T]
    if layout == "padded":
        assert not sees[0, 0] and sees.sum() > T  # a query that sees nothing, and ones that see
    cotangent = jax.random.normal(jax.random.key(1), q.shape) * sees[..., None, None]  # (the output's shape)
    sinks = 3 * jax.random.normal(jax.random.key(2), (n_head,)) if sinks else None  # (scores ~4 here)
    with jax.default_matmul_precision("highest"):
        want, got, dense_grads, blocks_grads = _dense_and_blocks(q, k, v, q_pos, k_pos, window, cotangent, softcap,
                                                                 sinks)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)  # (a query that sees nothing: 0 in both)
    for name, g, w in zip(["dq", "dk", "dv", "dsinks"], blocks_grads, dense_grads):
        if w is not None:
            np.testing.assert_allclose(g, w, atol=1e-5 * float(jnp.abs(w).max()), err_msg=name)
    if sinks is not None:  # (not a gradient too small for the comparison to catch a 0)
        assert float(jnp.abs(dense_grads[3]).max()) > 1e-2


def test_blocks_in_bfloat16_are_as_close_as_dense_bfloat16_is():
    """bfloat16 inputs: the blocks' error against float32 is within 1.5x the dense bf16 path's own."""
    q, k, v = _qkv(2, 2, 64, 64, 4, 2, 16)
    q_pos = k_pos = jnp.tile(jnp.arange(64), (2, 1))
    window = jnp.int32(FULL_WINDOW)
    mask = visible(q_pos, k_pos, window)
    with jax.default_matmul_precision("highest"):
        exact = dot_product_attention(q, k, v, mask)[0]
    bf = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    dense = dot_product_attention(*bf, mask)[0]
    blocks = blockwise_attention(*bf, q_pos, k_pos, window, block_q=16, block_k=16)
    assert blocks.dtype == jnp.bfloat16
    dense_error = float(jnp.abs(dense.astype(jnp.float32) - exact).max())
    blocks_error = float(jnp.abs(blocks.astype(jnp.float32) - exact).max())
    assert 0 < blocks_error <= 1.5 * dense_error, (blocks_error, dense_error)


def test_attend_picks_blocks_from_the_threshold_and_dense_gives_the_weights():
    q, k, v = _qkv(3, 1, 4, 4, 2, 1, 8)
    seen = Visibility(jnp.arange(4), jnp.arange(4), jnp.int32(FULL_WINDOW))
    out, weights = attend(q, k, v, seen, kind="auto")
    assert weights.shape == (1, 2, 4, 4)
    blocks, none = attend(q, k, v, seen, kind="blocks")
    assert none is None
    np.testing.assert_allclose(blocks, out, atol=1e-6)


CONFIG = DecoderConfig(vocab_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64,
                       layer_types=("sliding", "full", "sliding"), sliding_window=6, attn_logit_softcap=20.0)


# A model's loss and its gradients, jitted: one program per model, where run eagerly each
# operation of the forward and of the backward pass would compile on its own.
@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(model, params, tokens):
    def loss(params):
        logits, _ = model.apply({"params": params}, tokens)
        return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1].max(-1)), logits

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.parametrize("scan_layers, sinks", [(False, False), (True, False), (True, True)],
                         ids=["layers", "scanned", "scanned, sinks"])
def test_a_decoder_attending_in_blocks_equals_the_dense_one_and_its_gradients(scan_layers, sinks):
    config = (with_sinks(CONFIG) if sinks else CONFIG).replace(scan_layers=scan_layers)
    tokens = jax.random.randint(jax.random.key(4), (2, 40), 0, 64)
    dense, blocks = Decoder(config.replace(attention_impl="dense")), Decoder(config.replace(attention_impl="blocks"))
    params = jax.jit(dense.init)(jax.random.key(5), tokens)["params"]  # (jitted: one compile, not one per operation)

    with jax.default_matmul_precision("highest"):
        (want_loss, want), want_grads = _loss_and_grads(dense, params, tokens)
        (got_loss, got), got_grads = _loss_and_grads(blocks, params, tokens)
    np.testing.assert_allclose(got, want, atol=2e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        w = dict(jax.tree_util.tree_leaves_with_path(want_grads))[path]
        np.testing.assert_allclose(g, w, atol=2e-5 * float(jnp.abs(w).max()) + 1e-9, err_msg=str(path))


def _train_step_temp_bytes(attention_impl: str, T: int) -> int:
    """XLA's temporary bytes for the gradient of a 1-layer, 8-head decoder's loss at length T."""
    config = DecoderConfig(vocab_size=256, n_layer=1, n_head=8, n_kv_head=8, d_model=256, max_seq_len=T,
                           attention_impl=attention_impl)
    model = Decoder(config)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]

    def loss(params, tokens):
        logits, _ = model.apply({"params": params}, tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1))

    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_in_blocks_and_as_the_square_dense():
    dense = [_train_step_temp_bytes("dense", T) for T in (1024, 2048)]
    blocks = [_train_step_temp_bytes("blocks", T) for T in (2048, 4096, 8192)]
    # The claim: dense attention's gradient keeps at least one float32 score matrix [8, T, T] (its
    # softmax's backward reads the probabilities), so its temporaries are a T^2 + b T + c with
    # a T^2 at least that matrix's bytes. How many more copies XLA keeps, and so the ratio per
    # doubling (3.9x on a CPU, 3.3x on a GPU, whose fusions keep fewer), is the compiler's buffer
    # assignment; what the claim implies on any backend is the part that is not linear:
    # temp(2T) - 2 temp(T) = 2 a T^2 - c, at least one score matrix at T (c, the buffers of a
    # size fixed in T, far below one: the weights' gradients, about 3.5 MiB here, against 32 MiB).
    scores = 8 * 1024 * 1024 * 4
    assert dense[1] - 2 * dense[0] > scores
    # Twofold once the activations [T, d] outweigh the blocks' scores [8, 512, 512] (a constant).
    assert blocks[2] / blocks[1] < 2.1
    assert blocks[0] < dense[1] / 4
