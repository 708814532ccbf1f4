"""Attention in blocks (the online softmax of FlashAttention), written with `jnp` ops.

`attention.dot_product_attention` builds every score `[batch, heads, T, S]` at once: memory
grows as T * S. Here the queries are cut into blocks of `block_q` and the keys into blocks of
`block_k`, and a query block walks the key blocks keeping, per query row,

    m      the largest score seen so far
    denom  sum of exp(score - m) over the keys seen so far
    acc    sum of exp(score - m) * v over the keys seen so far

When a new block raises the maximum from m to m', the old sums are rescaled by exp(m - m'),
so at the end `acc / denom` is exactly `softmax(scores) @ v`, without a whole row of scores ever
existing. Only `[block_q, block_k]` scores are alive at a time: memory grows linearly in T.

The backward pass (a custom VJP) keeps only the output and each row's log-sum-exp
`lse = m + log denom` from the forward pass and recomputes each block's probabilities
`p = exp(score - lse)`; with `delta = rowsum(dO * O)`,

    dV = p^T dO      dP = dO V^T      dS = p * (dP - delta)      dQ = dS K * scale      dK = dS^T Q * scale

(with a softcap, dS is multiplied by the cap's derivative, 1 - tanh^2, first).

Attention sinks (gpt-oss): a learned logit per query head that joins each row's softmax and is
then dropped, `softmax(concat(scores, sink))[..., :-1] @ v`: a key every query sees whose value is
0. It is folded in once at the end (`fold_sink`), so `out` and `lse` include it, and the weights of
a row sum to less than 1. The backward above is then unchanged (the sink's dP is dO . 0 = 0), and
the sink's own gradient is `-sum over rows of exp(sink - lse) * delta` (`sink_grads`).

What a query may read is given by positions, not a mask (a `[T, S]` mask is itself quadratic):
key s is visible to query t iff `0 <= k_pos[s] <= q_pos[t]` and `k_pos[s] > q_pos[t] - window`.
A key block no query of the block can see is skipped, so causal attention does about half the
work. A query that sees no key gets 0.

Einsum letters as in `attention.py`: b batch, t query, s key, n kv head, g query head within
its group, k channel.
"""

import functools
import math

import jax
import jax.numpy as jnp

from jaxformer.products import precision_for

# `attention_impl="auto"` attends in blocks from this many scores per head ([T, S]) on: 1024 x 1024.
BLOCKS_FROM = 2 ** 20
BLOCK = 512  # queries and keys per block (`blockwise_attention`'s default)


def in_blocks_for(attention_impl: str, T: int, S: int) -> bool:
    """Whether `DecoderConfig.attention_impl` attends in blocks for T queries over S keys (or densely)."""
    return attention_impl == "blocks" or (attention_impl == "auto" and T * S >= BLOCKS_FROM)


def visible(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array) -> jax.Array:
    """bool `[..., T, S]`: key s is visible to query t (int positions `q_pos [..., T]` and
    `k_pos [..., S]`, negative for an empty slot; `window` int32 `[]`)."""
    key, query = k_pos[..., None, :], q_pos[..., :, None]
    return (key >= 0) & (key <= query) & (key > query - window)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                        window: jax.Array, *, scale: float | None = None, softcap: float | None = None,
                        sinks: jax.Array | None = None, block_q: int = BLOCK, block_k: int = BLOCK) -> jax.Array:
    """Attention of queries `q [batch, T, n_head, head_dim]` over keys `k` and values `v`
    `[batch, S, n_kv, head_dim]` (`n_head % n_kv == 0`), in blocks: `[batch, T, n_head, head_dim]`
    in `q`'s dtype.

    Args:
      q_pos, k_pos: int32 `[batch, T]` and `[batch, S]`, the positions (`visible`).
      window: int32 `[]`: a key at most `window - 1` positions back is visible (full
        attention: any value past the context, e.g. 2**30).
      scale: the scores' scale, `1 / sqrt(head_dim)` by default.
      softcap: the scores pass through `softcap * tanh(score / softcap)` (Gemma 2).
      sinks: float32 `[n_head]`, each query head's sink logit (gpt-oss; compared with the scores
        after the scale and softcap), or None: no sink. Differentiable.
      block_q, block_k: the block sizes (cut to T and S when they are shorter). T and S are
        padded to whole blocks: padded keys are empty slots, padded queries are dropped.
    """
    batch, T, n_head, head_dim = q.shape
    S = k.shape[1]
    block_q, block_k = min(block_q, T), min(block_k, S)
    pad_t, pad_s = -T % block_q, -S % block_k
    q = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    q_pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, pad_t)))
    k, v = (jnp.pad(a, ((0, 0), (0, pad_s), (0, 0), (0, 0))) for a in (k, v))
    k_pos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, pad_s)), constant_values=-1)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = _attention(q, k, v, q_pos, k_pos, jnp.asarray(window, jnp.int32), sink_logits(sinks, n_head), scale,
                     softcap, block_q, block_k)
    return out[:, :T]


def sink_logits(sinks: jax.Array | None, n_head: int) -> jax.Array:
    """float32 `[n_head]`: `sinks`, or -inf for each head without them (a sink of weight
    `exp(-inf - m) = 0`: the output and lse are exactly those without one)."""
    return jnp.full((n_head,), -jnp.inf) if sinks is None else jnp.asarray(sinks, jnp.float32)


def fold_sink(m: jax.Array, denom: jax.Array, sink: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A row's online softmax, its running max `m` and `denom`, with the sink folded in: one more
    key the row sees, of score `sink` and value 0, so that it joins the denominator alone.

    Returns:
      `(m', denom', rescale)`, the row's `acc` to be multiplied by `rescale = exp(m - m')`. A row
      that saw no key (m = -inf, denom = 0) gets denom' = 1 and acc 0 (its output 0) with a finite
      sink, and denom' = 0 without one (sink = -inf).
    """
    m_new = jnp.maximum(m, sink)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # (neither a key nor a sink: exp(-inf - 0) = 0, not nan)
    rescale = jnp.exp(m - m_safe)
    return m_new, denom * rescale + jnp.exp(sink - m_safe), rescale


def sink_grads(sinks: jax.Array, lse: jax.Array, delta: jax.Array) -> jax.Array:
    """The gradient w.r.t. the sinks `[n_head]` from each row's `lse` (the sink included) and
    `delta = rowsum(dO * O)`, float32 `[batch, n_head, T]`: softmax's backward at the sink's column,
    `p_sink * (dP_sink - delta)` with `p_sink = exp(sink - lse)` and `dP_sink = dO . 0 = 0`, summed
    over the rows a head has."""
    return -jnp.sum(jnp.exp(sinks[:, None] - lse) * delta, axis=(0, 2))


def _blocks(a: jax.Array, size: int) -> jax.Array:
    """`[batch, L, ...]` as `[L // size, batch, size, ...]`: blocks along the sequence, first."""
    return jnp.moveaxis(a.reshape(a.shape[0], a.shape[1] // size, size, *a.shape[2:]), 1, 0)


def _unblocks(a: jax.Array) -> jax.Array:
    """The inverse of `_blocks`."""
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def _scores(q_block, k_block, scale, softcap):
    """float32 `[batch, n_kv, group, block_q, block_k]` scores of a query block `[batch, block_q,
    n_kv, group, head_dim]` and a key block `[batch, block_k, n_kv, head_dim]`, and the softcap's
    `tanh` (None without one) for the backward pass."""
    s = jnp.einsum("btngk,bsnk->bngts", q_block, k_block, preferred_element_type=jnp.float32,
                   precision=precision_for(q_block.dtype)) * scale
    if softcap is None:
        return s, None
    t = jnp.tanh(s / softcap)
    return softcap * t, t


def _grouped(q: jax.Array, n_kv: int) -> jax.Array:
    """`[batch, T, n_head, head_dim]` as `[batch, T, n_kv, group, head_dim]`: query head j reads kv head j // group."""
    batch, T, n_head, head_dim = q.shape
    return q.reshape(batch, T, n_kv, n_head // n_kv, head_dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _attention(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k):
    return _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k)[0]


def _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k):
    """`(out [batch, T, n_head, head_dim], lse [batch, n_kv, group, T])`, lse +inf where a query sees
    nothing and has no sink."""
    n_kv = k.shape[2]
    keys = (_blocks(k, block_k), _blocks(v, block_k), _blocks(k_pos, block_k))
    sinks = sinks.reshape(n_kv, -1)[:, :, None]  # [n_kv, group, 1]: head n * group + g's, for every query row

    def query_block(inputs):
        q_block, q_block_pos = inputs  # [batch, block_q, n_kv, group, head_dim], [batch, block_q]
        batch, _, _, group, head_dim = q_block.shape
        rows = (batch, n_kv, group, block_q)

        def key_block(carry, inputs):
            k_block, v_block, k_block_pos = inputs
            seen = visible(q_block_pos, k_block_pos, window)[:, None, None]  # [batch, 1, 1, block_q, block_k]

            def update(carry):
                m, denom, acc = carry
                s = jnp.where(seen, _scores(q_block, k_block, scale, softcap)[0], -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))  # [batch, n_kv, group, block_q]
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # (a row that has seen nothing yet: exp(-inf) = 0)
                p = jnp.exp(s - m_safe[..., None])  # [batch, n_kv, group, block_q, block_k]
                rescale = jnp.exp(m - m_safe)  # the old sums, from max m to max m_new
                denom = denom * rescale + p.sum(-1)
                pv = jnp.einsum("bngts,bsnk->btngk", p.astype(v_block.dtype), v_block,
                                preferred_element_type=jnp.float32, precision=precision_for(v_block.dtype))
                acc = acc * jnp.moveaxis(rescale, 3, 1)[..., None] + pv  # [batch, block_q, n_kv, group, head_dim]
                return m_new, denom, acc

            return jax.lax.cond(seen.any(), update, lambda carry: carry, carry), None

        init = (jnp.full(rows, -jnp.inf), jnp.zeros(rows), jnp.zeros((batch, block_q, n_kv, group, head_dim)))
        (m, denom, acc), _ = jax.lax.scan(key_block, init, keys)
        m, denom, rescale = fold_sink(m, denom, sinks)
        acc = acc * jnp.moveaxis(rescale, 3, 1)[..., None]  # (the sink's value, 0, adds nothing to it)
        out = acc / jnp.moveaxis(jnp.where(denom > 0, denom, 1.0), 3, 1)[..., None]  # (a row that saw nothing: 0 / 1)
        lse = jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), jnp.inf)
        return out.astype(q_block.dtype), lse

    out, lse = jax.lax.map(query_block, (_blocks(_grouped(q, n_kv), block_q), _blocks(q_pos, block_q)))
    out = _unblocks(out)  # [batch, T, n_kv, group, head_dim]
    lse = jnp.moveaxis(lse, 0, 3).reshape(*lse.shape[1:4], -1)  # [batch, n_kv, group, T]
    return out.reshape(q.shape), lse


def _attention_fwd(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k):
    out, lse = _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k)
    return out, (q, k, v, q_pos, k_pos, window, sinks, out, lse)


def _attention_bwd(scale, softcap, block_q, block_k, residuals, d_out):
    q, k, v, q_pos, k_pos, window, sinks, out, lse = residuals
    batch, T, n_kv = q.shape[0], q.shape[1], k.shape[2]
    q, d_out, out = (_grouped(a, n_kv) for a in (q, d_out, out))  # [batch, T, n_kv, group, head_dim]
    delta = jnp.einsum("btngk,btngk->bngt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    d_sinks = sink_grads(sinks, lse.reshape(batch, -1, T), delta.reshape(batch, -1, T))  # (head n * group + g)
    lse_blocks = jnp.moveaxis(lse.reshape(*lse.shape[:3], -1, block_q), 3, 0)  # [blocks, batch, n_kv, group, block_q]
    delta_blocks = jnp.moveaxis(delta.reshape(*delta.shape[:3], -1, block_q), 3, 0)
    queries = (_blocks(q, block_q), _blocks(q_pos, block_q), _blocks(d_out, block_q), lse_blocks, delta_blocks)

    def key_block(d_q, inputs):  # d_q: float32 [q blocks, batch, block_q, n_kv, group, head_dim]
        k_block, v_block, k_block_pos = inputs

        def query_block(carry, inputs):
            q_block, q_block_pos, d_out_block, lse_block, delta_block = inputs
            seen = visible(q_block_pos, k_block_pos, window)[:, None, None]  # [batch, 1, 1, block_q, block_k]

            def grads(carry):
                d_k, d_v = carry
                s, t = _scores(q_block, k_block, scale, softcap)
                p = jnp.where(seen, jnp.exp(s - lse_block[..., None]), 0.0)  # the forward's probabilities
                d_v = d_v + jnp.einsum("bngts,btngk->bsnk", p.astype(v_block.dtype), d_out_block,
                                       preferred_element_type=jnp.float32, precision=precision_for(v_block.dtype))
                d_p = jnp.einsum("btngk,bsnk->bngts", d_out_block, v_block, preferred_element_type=jnp.float32,
                                 precision=precision_for(v_block.dtype))
                d_s = p * (d_p - delta_block[..., None])  # softmax's backward, row by row
                if softcap is not None:
                    d_s = d_s * (1 - t * t)  # d(cap * tanh(x / cap)) / dx
                d_s = (d_s * scale).astype(q_block.dtype)
                d_q_block = jnp.einsum("bngts,bsnk->btngk", d_s, k_block, preferred_element_type=jnp.float32,
                                       precision=precision_for(q_block.dtype))
                d_k = d_k + jnp.einsum("bngts,btngk->bsnk", d_s, q_block, preferred_element_type=jnp.float32,
                                       precision=precision_for(q_block.dtype))
                return (d_k, d_v), d_q_block

            def skip(carry):
                return carry, jnp.zeros(q_block.shape, jnp.float32)

            return jax.lax.cond(seen.any(), grads, skip, carry)

        zeros = jnp.zeros(k_block.shape, jnp.float32)
        (d_k, d_v), d_q_blocks = jax.lax.scan(query_block, (zeros, zeros), queries)
        return d_q + d_q_blocks, (d_k, d_v)

    d_q = jnp.zeros((q.shape[1] // block_q, q.shape[0], block_q, *q.shape[2:]), jnp.float32)
    d_q, (d_k, d_v) = jax.lax.scan(key_block, d_q, (_blocks(k, block_k), _blocks(v, block_k),
                                                     _blocks(k_pos, block_k)))
    d_q = _unblocks(d_q).reshape(q.shape[0], q.shape[1], -1, q.shape[-1])
    return (d_q.astype(q.dtype), _unblocks(d_k).astype(k.dtype), _unblocks(d_v).astype(v.dtype), None, None, None,
            d_sinks)


_attention.defvjp(_attention_fwd, _attention_bwd)
