"""FlashAttention as Pallas kernels for NVIDIA GPUs (the Triton backend): forward and backward.

The same algorithm as `jaxformer.blockwise` (read its docstring first), written as GPU kernels:
each program of a `pl.pallas_call` grid owns one block of rows and keeps it in registers and
shared memory while it walks the other sequence in blocks, so no `[T, S]` score matrix ever
reaches the GPU's main memory.

Forward, one program per (batch row, query head, query block), walking the key blocks with
an online softmax; per query row it keeps

    m      the largest score seen so far
    denom  sum of exp(score - m) over the keys seen so far
    acc    sum of exp(score - m) * v over the keys seen so far

and rescales the sums by exp(m - m') when the maximum rises to m'. It folds in the head's
attention sink, if any (a key of value 0 every query sees: `blockwise.fold_sink`), and writes
`out = acc / denom` and the log-sum-exp `lse = m + log(denom)` of each row, the sink included.

Backward, from `lse`, the output O and its cotangent dO, with `delta = rowsum(dO * O)` computed
first: each block's probabilities are recomputed as `p = exp(score - lse)`, and

    dV = p^T dO      dP = dO V^T      dS = p * (dP - delta)      dQ = dS K * scale      dK = dS^T Q * scale

(with a softcap, dS is multiplied by the cap's derivative, 1 - tanh^2, first). Two kernels share
that block math: one program per (batch row, query head, query block) walks the key blocks and
sums dQ; one per (batch row, kv head, key block) walks the query blocks of every query head
reading that kv head (grouped-query attention) and sums dK and dV. Neither writes to memory
another program writes, so no atomics are needed. The sinks' gradient, `-sum over rows of
exp(sink - lse) * delta`, is a `jnp` sum outside the kernels (`blockwise.sink_grads`).

Which keys a query reads is given by positions (`blockwise.visible`): key s is visible to query
t iff `0 <= k_pos[s] <= q_pos[t]` and `k_pos[s] > q_pos[t] - window`. A pair of blocks with no
visible (query, key) pair is skipped (`lax.cond`): causal attention does about half the matrix
products, and a sliding window's products grow with the window, not the context (only the cheap
visibility test runs on every pair). A query that sees no key gets 0 and passes no gradient.

Triton's constraints: every block a kernel loads or multiplies has power-of-two sides, and its
matrix products need sides of at least 16 (`supports`). On a CPU the kernels run with
`interpret=True` (slowly: it is for tests).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxformer.blockwise import fold_sink, sink_grads, sink_logits, visible
from jaxformer.products import precision_for

# Triton multiplies matrices whose sides are at least this long.
MIN_BLOCK = 16
# Wider heads would not fit a query block, its accumulator and a key block in registers.
MAX_HEAD_DIM = 256


def supports(head_dim: int, dtype) -> bool:
    """Whether `flash_attention` handles heads of `head_dim` channels in `dtype`: a power of two
    from 16 to 256, float32 or bfloat16 (the model falls back to `jnp` attention otherwise)."""
    power_of_two = head_dim & (head_dim - 1) == 0
    return power_of_two and MIN_BLOCK <= head_dim <= MAX_HEAD_DIM and jnp.dtype(dtype) in (jnp.float32,
                                                                                           jnp.bfloat16)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                    window: jax.Array, *, scale: float | None = None, softcap: float | None = None,
                    sinks: jax.Array | None = None, block_q: int = 64, block_k: int = 64,
                    interpret: bool = False) -> jax.Array:
    """Attention of queries `q [batch, T, n_head, head_dim]` over keys `k` and values `v`
    `[batch, S, n_kv, head_dim]` (`n_head % n_kv == 0`; query head h reads kv head
    `h // (n_head // n_kv)`), with Pallas kernels: `[batch, T, n_head, head_dim]` in `q`'s dtype.
    Differentiable with respect to q, k, v and the sinks.

    Args:
      q_pos, k_pos: int32 `[batch, T]` and `[batch, S]`, each query's and each key's position
        (a negative key position: an empty slot, never read).
      window: int32 `[]` (traced): a key at most `window - 1` positions back is visible (full
        attention: any value past the context, e.g. 2**30).
      scale: the scores' scale, `1 / sqrt(head_dim)` by default.
      softcap: the scores pass through `softcap * tanh(score / softcap)` (Gemma 2) before the mask.
      sinks: float32 `[n_head]`, each query head's sink logit (gpt-oss: `softmax(concat(scores,
        sink))[..., :-1] @ v`), or None: no sink.
      block_q, block_k: the block sizes, powers of two from 16 (cut to the next power of two
        from 16 above T or S when that is shorter). T and S are padded to whole blocks: padded
        keys are empty slots, padded queries see nothing and are dropped.
      interpret: run the kernels in Pallas's interpreter (any backend; for tests on a CPU).

    Raises:
      ValueError: for a head width or dtype `supports` refuses, or a block size that is not a
        power of two from 16.
    """
    batch, T, n_head, head_dim = q.shape
    S = k.shape[1]
    if not supports(head_dim, q.dtype):
        raise ValueError(f"flash_attention takes head_dim a power of two in [{MIN_BLOCK}, {MAX_HEAD_DIM}] and "
                         f"float32 or bfloat16, not {head_dim} and {q.dtype}")
    for block in (block_q, block_k):
        if block < MIN_BLOCK or block & (block - 1):
            raise ValueError(f"block sizes must be powers of two from {MIN_BLOCK}, not {block}")
    # A short sequence (one query while decoding) gets a small block rather than a mostly padded one.
    block_q = min(block_q, max(MIN_BLOCK, pl.next_power_of_2(T)))
    block_k = min(block_k, max(MIN_BLOCK, pl.next_power_of_2(S)))
    pad_t, pad_s = -T % block_q, -S % block_k
    q = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    # A padded query gets position -1: it sees no key, so its blocks are skipped.
    q_pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, pad_t)), constant_values=-1)
    k, v = (jnp.pad(a, ((0, 0), (0, pad_s), (0, 0), (0, 0))) for a in (k, v))
    k_pos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, pad_s)), constant_values=-1)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    window = jnp.asarray(window, jnp.int32).reshape(1)  # a kernel reads it from memory, as window_ref[0]
    out = _attention(q, k, v, q_pos, k_pos, window, sink_logits(sinks, n_head), scale, softcap, block_q, block_k,
                     interpret)
    return out[:, :T]


def _scores(q: jax.Array, k: jax.Array, scale: float, softcap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """float32 `[block_q, block_k]` scores of a query block `q [block_q, head_dim]` and a key
    block `k [block_k, head_dim]`, and the softcap's `tanh` (None without one) for the backward."""
    s = jnp.einsum("tk,sk->ts", q, k, preferred_element_type=jnp.float32, precision=precision_for(q.dtype)) * scale
    if softcap is None:
        return s, None
    t = jnp.tanh(s / softcap)
    return softcap * t, t


def _any(seen: jax.Array) -> jax.Array:
    """bool `[]`: whether any entry of the bool `seen` is set (as an int max: Triton has no `or` reduction)."""
    return jnp.max(seen.astype(jnp.int32)) > 0


def _forward_kernel(window_ref, sink_ref, q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref, out_ref, lse_ref, *, scale,
                    softcap, block_k):
    """One query block of one query head over every key block of its kv head.

    Refs: `window_ref` int32 `[1]`; `sink_ref` float32 `[]`, the head's sink (-inf: none); `q_ref
    [block_q, head_dim]`; `k_ref, v_ref [S, head_dim]`; `q_pos_ref` int32 `[block_q]`; `k_pos_ref`
    int32 `[S]`. Writes `out_ref [block_q, head_dim]` and `lse_ref` float32 `[block_q]` (+inf for a
    query that sees no key and has no sink).
    """
    q, q_pos, window = q_ref[...], q_pos_ref[...], window_ref[0]
    block_q, head_dim = q.shape

    def key_block(j, carry):
        keys = pl.ds(j * block_k, block_k)
        seen = visible(q_pos, k_pos_ref[keys], window)  # [block_q, block_k]

        def update(carry):
            m, denom, acc = carry
            s = jnp.where(seen, _scores(q, k_ref[keys, :], scale, softcap)[0], -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))  # [block_q]
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # (a row that has seen nothing yet: exp(-inf) = 0)
            p = jnp.exp(s - m_safe[:, None])  # [block_q, block_k]
            rescale = jnp.exp(m - m_safe)  # the old sums, from max m to max m_new
            denom = denom * rescale + p.sum(-1)
            v = v_ref[keys, :]
            pv = jnp.einsum("ts,sk->tk", p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                            precision=precision_for(v.dtype))
            return m_new, denom, acc * rescale[:, None] + pv

        return jax.lax.cond(_any(seen), update, lambda carry: carry, carry)

    init = (jnp.full((block_q,), -jnp.inf), jnp.zeros((block_q,)), jnp.zeros((block_q, head_dim)))
    m, denom, acc = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, key_block, init)
    m, denom, rescale = fold_sink(m, denom, sink_ref[...])
    # A row that saw a key or has a sink has denom >= 1 (its largest logit contributes exp(0)); else 0.
    saw = denom > 0
    denom = jnp.where(saw, denom, 1.0)  # (a row that saw nothing: 0 / 1)
    out_ref[...] = (acc * (rescale / denom)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(saw, m + jnp.log(denom), jnp.inf)  # exp(score - inf) = 0: no probability anywhere


def _block_grads(q, k, v, d_out, lse, delta, seen, scale, softcap):
    """The backward's math on one (query block, key block) pair of one query head.

    Args: `q, d_out [block_q, head_dim]`; `k, v [block_k, head_dim]`; float32 `lse, delta
    [block_q]`; bool `seen [block_q, block_k]`.

    Returns:
      float32 `(p, d_s)`, `[block_q, block_k]` each: the forward's probabilities and the gradient
      of the loss with respect to the products `q . k` (scale and softcap included), so that
      `dQ = d_s K`, `dK = d_s^T Q` and `dV = p^T dO`.
    """
    s, t = _scores(q, k, scale, softcap)
    p = jnp.where(seen, jnp.exp(s - lse[:, None]), 0.0)  # the forward's softmax, from its log-sum-exp
    d_p = jnp.einsum("tk,sk->ts", d_out, v, preferred_element_type=jnp.float32, precision=precision_for(v.dtype))
    d_s = p * (d_p - delta[:, None])  # softmax's backward: p * (dP - rowsum(dP * p)), rowsum(dP * p) = delta
    if softcap is not None:
        d_s = d_s * (1 - t * t)  # d(cap * tanh(x / cap)) / dx
    return p, d_s * scale


def _dq_kernel(window_ref, q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, d_q_ref, *,
               scale, softcap, block_k):
    """dQ of one query block of one query head, summed over every key block of its kv head.

    Refs as `_forward_kernel`'s, with `d_out_ref [block_q, head_dim]`, `lse_ref, delta_ref`
    float32 `[block_q]`; writes `d_q_ref [block_q, head_dim]`.
    """
    q, d_out, lse, delta = q_ref[...], d_out_ref[...], lse_ref[...], delta_ref[...]
    q_pos, window = q_pos_ref[...], window_ref[0]

    def key_block(j, d_q):
        keys = pl.ds(j * block_k, block_k)
        seen = visible(q_pos, k_pos_ref[keys], window)

        def update(d_q):
            k = k_ref[keys, :]
            _, d_s = _block_grads(q, k, v_ref[keys, :], d_out, lse, delta, seen, scale, softcap)
            return d_q + jnp.einsum("ts,sk->tk", d_s.astype(k.dtype), k, preferred_element_type=jnp.float32,
                                    precision=precision_for(k.dtype))  # dQ += dS K

        return jax.lax.cond(_any(seen), update, lambda d_q: d_q, d_q)

    d_q = jax.lax.fori_loop(0, k_ref.shape[0] // block_k, key_block, jnp.zeros(q.shape, jnp.float32))
    d_q_ref[...] = d_q.astype(d_q_ref.dtype)


def _dkv_kernel(window_ref, q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_pos_ref, k_pos_ref, d_k_ref,
                d_v_ref, *, scale, softcap, block_q):
    """dK and dV of one key block of one kv head, summed over every query block of every query
    head in its group (grouped-query attention: a kv head's gradient sums over the heads reading it).

    Refs: `window_ref` int32 `[1]`; `q_ref, d_out_ref [T, group, head_dim]`; `k_ref, v_ref
    [block_k, head_dim]`; `lse_ref, delta_ref` float32 `[group, T]`; `q_pos_ref` int32 `[T]`;
    `k_pos_ref` int32 `[block_k]`. Writes `d_k_ref, d_v_ref [block_k, head_dim]`.
    """
    k, v, k_pos, window = k_ref[...], v_ref[...], k_pos_ref[...], window_ref[0]
    T, group, _ = q_ref.shape

    def query_block(i, carry):
        queries = pl.ds(i * block_q, block_q)
        seen = visible(q_pos_ref[queries], k_pos, window)  # [block_q, block_k], the same for every head of the group

        def query_head(g, carry):  # the group's g-th query head: head n * group + g
            d_k, d_v = carry
            q, d_out = q_ref[queries, g, :], d_out_ref[queries, g, :]  # [block_q, head_dim]
            p, d_s = _block_grads(q, k, v, d_out, lse_ref[g, queries], delta_ref[g, queries], seen, scale, softcap)
            d_v = d_v + jnp.einsum("ts,tk->sk", p.astype(d_out.dtype), d_out, preferred_element_type=jnp.float32,
                                   precision=precision_for(d_out.dtype))  # dV += p^T dO
            d_k = d_k + jnp.einsum("ts,tk->sk", d_s.astype(q.dtype), q, preferred_element_type=jnp.float32,
                                   precision=precision_for(q.dtype))  # dK += dS^T Q
            return d_k, d_v

        def every_head(carry):
            return jax.lax.fori_loop(0, group, query_head, carry)

        return jax.lax.cond(_any(seen), every_head, lambda carry: carry, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    d_k, d_v = jax.lax.fori_loop(0, T // block_q, query_block, (zeros, zeros))
    d_k_ref[...] = d_k.astype(d_k_ref.dtype)
    d_v_ref[...] = d_v.astype(d_v_ref.dtype)


# Launch settings for the GPU (ignored when interpreting): 4 warps per program, a 2-stage
# software pipeline for the loads of the next block.
_COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=2)


def _window_spec() -> pl.BlockSpec:
    """Every program reads the whole `[1]` window."""
    return pl.BlockSpec((1,), lambda *_: (0,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _attention(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret):
    return _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret)[0]


def _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret):
    """`(out [batch, T, n_head, head_dim], lse float32 [batch, n_head, T])`, T and S whole blocks."""
    batch, T, n_head, head_dim = q.shape
    S, n_kv = k.shape[1], k.shape[2]
    group = n_head // n_kv
    # Program (b, h, i): batch row b, query head h, query block i. `None` drops an axis from the block.
    query_rows = pl.BlockSpec((None, block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    whole_kv_head = pl.BlockSpec((None, S, None, head_dim), lambda b, h, i: (b, 0, h // group, 0))
    kernel = functools.partial(_forward_kernel, scale=scale, softcap=softcap, block_k=block_k)
    return pl.pallas_call(
        kernel,
        grid=(batch, n_head, T // block_q),
        in_specs=[_window_spec(), pl.BlockSpec((None,), lambda b, h, i: (h,)),  # sinks[h]
                  query_rows, whole_kv_head, whole_kv_head,
                  pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),  # q_pos
                  pl.BlockSpec((None, S), lambda b, h, i: (b, 0))],  # k_pos
        out_specs=[query_rows, pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))],  # out, lse
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, n_head, T), jnp.float32)],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name="flash_attention_forward",
    )(window, sinks, q, k, v, q_pos, k_pos)


def _attention_fwd(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret):
    out, lse = _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret)
    return out, (q, k, v, q_pos, k_pos, window, sinks, out, lse)


def _attention_bwd(scale, softcap, block_q, block_k, interpret, residuals, d_out):
    q, k, v, q_pos, k_pos, window, sinks, out, lse = residuals
    batch, T, n_head, head_dim = q.shape
    S, n_kv = k.shape[1], k.shape[2]
    group = n_head // n_kv
    # delta_t = sum_k dO[t, k] O[t, k] = sum_s p[t, s] dP[t, s] (O = p V, dP = dO V^T), float32 [batch, n_head, T].
    delta = jnp.einsum("bthk,bthk->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    inputs = (window, q, k, v, d_out, lse, delta, q_pos, k_pos)

    # dQ: program (b, h, i) as in the forward pass.
    query_rows = pl.BlockSpec((None, block_q, None, head_dim), lambda b, h, i: (b, i, h, 0))
    whole_kv_head = pl.BlockSpec((None, S, None, head_dim), lambda b, h, i: (b, 0, h // group, 0))
    row_stats = pl.BlockSpec((None, None, block_q), lambda b, h, i: (b, h, i))  # lse, delta
    d_q = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, softcap=softcap, block_k=block_k),
        grid=(batch, n_head, T // block_q),
        in_specs=[_window_spec(), query_rows, whole_kv_head, whole_kv_head, query_rows, row_stats, row_stats,
                  pl.BlockSpec((None, block_q), lambda b, h, i: (b, i)),  # q_pos
                  pl.BlockSpec((None, S), lambda b, h, i: (b, 0))],  # k_pos
        out_specs=query_rows,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name="flash_attention_dq",
    )(*inputs)

    # dK, dV: program (b, n, j): batch row b, kv head n, key block j; it reads the n-th group of
    # `group` query heads (block n of size `group` along the head axis).
    key_rows = pl.BlockSpec((None, block_k, None, head_dim), lambda b, n, j: (b, j, n, 0))
    whole_group = pl.BlockSpec((None, T, group, head_dim), lambda b, n, j: (b, 0, n, 0))
    group_stats = pl.BlockSpec((None, group, T), lambda b, n, j: (b, n, 0))  # lse, delta
    d_k, d_v = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, softcap=softcap, block_q=block_q),
        grid=(batch, n_kv, S // block_k),
        in_specs=[_window_spec(), whole_group, key_rows, key_rows, whole_group, group_stats, group_stats,
                  pl.BlockSpec((None, T), lambda b, n, j: (b, 0)),  # q_pos
                  pl.BlockSpec((None, block_k), lambda b, n, j: (b, j))],  # k_pos
        out_specs=[key_rows, key_rows],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_COMPILER_PARAMS,
        interpret=interpret,
        name="flash_attention_dkv",
    )(*inputs)
    return d_q, d_k, d_v, None, None, None, sink_grads(sinks, lse, delta)


_attention.defvjp(_attention_fwd, _attention_bwd)
