"""FlashAttention as Pallas kernels for the TPU (the Mosaic backend), forward and backward.

The same algorithm as `jaxformer.blockwise` (read its docstring first), written for the TPU's
memory instead of with `jnp` ops. A TPU core computes on data in VMEM, a small fast memory next
to its vector and matrix units; the arrays live in HBM. A `pl.pallas_call` runs the kernel once
per point of a grid, and the `BlockSpec`s say which block of each array that point reads and
writes: Pallas copies the blocks into VMEM before the kernel runs (and the next ones while it
runs), and the output blocks back out. The grid points run one after another on a core; a grid
axis marked "parallel" may be split between cores, an "arbitrary" one runs in order, so a
kernel may carry state along it in VMEM scratch that outlives a single grid point.

Forward, grid (batch, head, query block i, key block j), j the innermost, "arbitrary" axis.
A query block keeps, per row, in VMEM scratch from its first key block (j = 0) to its last:

    m      the largest score seen so far
    denom  sum of exp(score - m) over the keys seen so far
    acc    sum of exp(score - m) * v over the keys seen so far

and at the last key block folds in the head's attention sink, if any (a key of value 0 every
query sees: `blockwise.fold_sink`), and writes `out = acc / denom` and the log-sum-exp
`lse = m + log denom`, the sink included.

Backward, from the saved lse (no `[T, S]` array is ever stored): each block recomputes its
probabilities `p = exp(score - lse)`, and with `delta = rowsum(dO * O)` (computed first)

    dV = p^T dO      dP = dO V^T      dS = p * (dP - delta)      dQ = dS K * scale      dK = dS^T Q * scale

(with a softcap, dS is multiplied by the cap's derivative 1 - tanh^2 first); the sinks'
gradient, `-sum over rows of exp(sink - lse) * delta`, is a `jnp` sum outside the kernels
(`blockwise.sink_grads`). Two kernels, so
that each output block has one grid point sequence that owns it: the dK/dV kernel walks, for
each key block, the query blocks of every query head of its group (grouped-query attention: a
kv head's gradient is the sum over the query heads that read it); the dQ kernel walks, for
each query block, the key blocks.

Which keys a query sees is given by positions (`blockwise.visible`): key s is visible to query
t iff `0 <= k_pos[s] <= q_pos[t]` and `k_pos[s] > q_pos[t] - window`. The window is a traced
scalar, so it reaches the kernels through SMEM (scalar prefetch), with each block's smallest and
largest position: from those a kernel knows, before touching a vector, that a block pair has
no visible pair at all and skips its work (causal attention does about half the work; the
skipped blocks are still copied in).

TPU layout: the last two dimensions of a block are a multiple of (8, 128) or the whole
dimension. So q, k, v are laid out `[batch, heads, T, head_dim]` (a block `[block, head_dim]`,
head_dim whole), and per-row numbers (positions, m, denom, lse, delta) are stored copied along 128
lanes (`[rows, 128]`), as is each head's sink (`[heads, 1, 128]`), each key's position along 8
sublanes (`[8, keys]`), the shapes a TPU
vector register holds without reshuffling; a kernel reads one copy (`[:, :1]`, `[:1, :]`).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxformer.blockwise import fold_sink, sink_grads, sink_logits
from jaxformer.products import precision_for

LANES = 128  # a TPU vector register is 8 sublanes x 128 lanes of 32 bits
SUBLANES = 8
# m's start: below every score, and finite, so that `m - m_new` is never `-inf - -inf` (nan).
LOWEST = float(jnp.finfo(jnp.float32).min)


def supports(head_dim: int, dtype) -> bool:
    """Whether `flash_attention`'s Mosaic kernels handle heads of `head_dim` in `dtype`.

    A block of q, k or v is `[block, head_dim]` with head_dim whole, which the layout rules
    allow for any width, but the vector registers and the matrix unit work on tiles 128 wide: a
    head of 64 fills half a tile, a multiple of 128 whole tiles; other widths are left to the
    `jnp` implementations (`attention.attend`).

    Args:
      head_dim: the width of one attention head.
      dtype: the dtype of q, k and v.

    Returns:
      True for float32 or bfloat16 with `head_dim` 64 or a multiple of 128.
    """
    return jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16) and (head_dim == 64 or head_dim % LANES == 0)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                    window: jax.Array, *, scale: float | None = None, softcap: float | None = None,
                    sinks: jax.Array | None = None, block_q: int = 128, block_k: int = 128,
                    interpret: bool = False) -> jax.Array:
    """Attention of queries `q [batch, T, n_head, head_dim]` over keys `k` and values `v`
    `[batch, S, n_kv, head_dim]` (`n_head % n_kv == 0`: query head h reads kv head
    `h // (n_head // n_kv)`), by the Pallas TPU kernels; differentiable in q, k, v and the
    sinks (the backward of q, k and v is kernels too). `supports` says which heads and dtypes
    a TPU takes.

    Args:
      q_pos, k_pos: int32 `[batch, T]` and `[batch, S]`, each query's and key's position (a
        negative key position is an empty slot, never read).
      window: int32 `[]` (may be traced): key s is visible to query t iff
        `0 <= k_pos[s] <= q_pos[t]` and `k_pos[s] > q_pos[t] - window`; full causal attention
        passes any window past the context (2**30). A query that sees no key gets 0.
      scale: the scores' scale, `1 / sqrt(head_dim)` by default.
      softcap: if given, scores pass through `softcap * tanh(score / softcap)` before the mask.
      sinks: float32 `[n_head]`, each query head's sink logit (gpt-oss: `softmax(concat(scores,
        sink))[..., :-1] @ v`), or None: no sink.
      block_q, block_k: the block sizes. T and S are padded to whole blocks (padded keys are
        empty slots, padded queries are dropped). On a TPU, block_q a multiple of 8 (16 for
        bfloat16) and block_k a multiple of 128, unless a block is the whole padded length.
      interpret: run the kernels in Pallas's interpreter (on any machine, slowly) instead of
        compiling them with Mosaic for a TPU.

    Returns:
      `[batch, T, n_head, head_dim]` in q's dtype; 0 for a query that sees no key.
    """
    batch, T, n_head, head_dim = q.shape
    S = k.shape[1]
    pad_t, pad_s = -T % block_q, -S % block_k
    # [batch, L, heads, head_dim] -> [batch, heads, L, head_dim], L padded to whole blocks.
    q = jnp.pad(q.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, pad_t), (0, 0)))
    k, v = (jnp.pad(a.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, pad_s), (0, 0))) for a in (k, v))
    # A padded query at position -1 and a padded key at -1 see nothing and are never seen.
    q_pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, pad_t)), constant_values=-1)
    k_pos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, pad_s)), constant_values=-1)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = _attention(q, k, v, q_pos, k_pos, jnp.asarray(window, jnp.int32), sink_logits(sinks, n_head), scale,
                     softcap, block_q, block_k, interpret)
    return out[:, :, :T].transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------------------------
# What every kernel computes on a (query block, key block) pair.


def _matmul(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """float32 product of 2-D `a` and `b` over axis `contract[0]` of a and `contract[1]` of b
    ((1, 0): a @ b; (1, 1): a @ b^T), at full float32 precision for float32 operands."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               preferred_element_type=jnp.float32, precision=precision_for(a.dtype))


def _scores(q: jax.Array, k: jax.Array, scale: float, softcap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """float32 scores `[block_q, block_k]` of a query block `q [block_q, head_dim]` and a key
    block `k [block_k, head_dim]`, and the softcap's `tanh` (None without one) for the backward."""
    s = _matmul(q, k, (1, 1)) * scale  # q . k for every pair
    if softcap is None:
        return s, None
    t = jnp.tanh(s / softcap)
    return softcap * t, t


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array) -> jax.Array:
    """bool `[block_q, block_k]`, key s visible to query t, from int32 `q_pos [block_q, 1]`,
    `k_pos [1, block_k]` and the scalar `window`."""
    return (k_pos >= 0) & (k_pos <= q_pos) & (k_pos > q_pos - window)


def _column(ref) -> jax.Array:
    """The per-row numbers of a `[rows, LANES]` block, each row's copied along the lanes, as a
    `[rows, 1]` column (the whole tile is read, then its first lane kept)."""
    return ref[...][:, :1]


def _may_see(window_ref, q_lo_ref, q_hi_ref, k_lo_ref, k_hi_ref, b, i, j) -> jax.Array:
    """Whether some query of block i may see some key of block j in batch row b (the SMEM tables
    of `_block_tables`). A visible pair needs a key with `0 <= key <= query <= q_hi` and
    `key > query - window >= q_lo - window`; no such key in `[k_lo, k_hi]`: nothing to do."""
    k_lo, k_hi = k_lo_ref[b, j], k_hi_ref[b, j]
    return (k_hi >= 0) & (k_lo <= q_hi_ref[b, i]) & (k_hi > q_lo_ref[b, i] - window_ref[0])


def _score_grads(q, k, v, d_out, q_pos, k_pos, lse, delta, window, scale, softcap):
    """The backward's quantities of one block pair: the forward's probabilities `p` and the
    gradient of the loss w.r.t. the raw products `q . k`, both float32 `[block_q, block_k]`.

    Args:
      q, d_out: `[block_q, head_dim]`, the queries and the output's cotangent dO.
      k, v: `[block_k, head_dim]`.
      q_pos, lse, delta: `[block_q, 1]`.
      k_pos: `[1, block_k]`.
    """
    s, t = _scores(q, k, scale, softcap)
    s = jnp.where(_visible(q_pos, k_pos, window), s, -jnp.inf)
    p = jnp.exp(s - lse)  # the forward's softmax, exactly: its row sums are exp(lse)
    d_p = _matmul(d_out, v, (1, 1))  # dP = dO V^T
    d_s = p * (d_p - delta)  # softmax's backward, row by row: dS = p * (dP - rowsum(dO * O))
    if softcap is not None:
        d_s = d_s * (1 - t * t)  # d(cap * tanh(x / cap)) / dx
    return p, d_s * scale  # scores = (q . k) * scale


# ----------------------------------------------------------------------------------------------
# The kernels. Each gets, in this order: the SMEM scalars (window and the block tables), its
# input blocks, its output blocks and its VMEM scratch.


def _forward_kernel(window_ref, q_lo_ref, q_hi_ref, k_lo_ref, k_hi_ref,  # SMEM
                    q_ref, k_ref, v_ref, q_pos_ref, k_pos_ref,  # in: [bq, D], [bk, D] x 2, [bq, LANES], [SUBLANES, bk]
                    sink_ref,  # in: [1, LANES], the head's sink (-inf: none)
                    out_ref, lse_ref,  # out: [bq, D], [bq, LANES]
                    m_ref, denom_ref, acc_ref,  # scratch: [bq, LANES] x 2, [bq, D]
                    *, scale, softcap):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)  # a new query block: nothing seen yet
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, LOWEST, jnp.float32)
        denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(_may_see(window_ref, q_lo_ref, q_hi_ref, k_lo_ref, k_hi_ref, b, i, j))
    def _step():
        s, _ = _scores(q_ref[...], k_ref[...], scale, softcap)
        # A hidden key's score is -inf: exp(-inf - m) = 0 whatever m is.
        s = jnp.where(_visible(_column(q_pos_ref), k_pos_ref[:1, :], window_ref[0]), s, -jnp.inf)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))  # [bq, LANES]
        p = jnp.exp(s - m_next[:, :1])  # [bq, bk]
        rescale = jnp.exp(m_prev - m_next)  # the old sums, from max m_prev to max m_next
        denom_ref[...] = rescale * denom_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = rescale[:, :1] * acc_ref[...] + _matmul(p.astype(v_ref.dtype), v_ref[...], (1, 0))
        m_ref[...] = m_next

    @pl.when(j == pl.num_programs(3) - 1)  # the query block's last key block: write it out
    def _finish():
        m, denom, rescale = fold_sink(m_ref[...], denom_ref[...], sink_ref[...])  # [bq, LANES] each
        # A row that saw nothing has acc = 0, and denom = 0 without a sink: dividing by 1 instead gives it
        # out = 0 (and lse = m = LOWEST, harmless: the backward masks all of its scores to -inf).
        denom = jnp.where(denom > 0, denom, 1.0)
        out_ref[...] = (acc_ref[...] * (rescale / denom)[:, :1]).astype(out_ref.dtype)
        lse_ref[...] = m + jnp.log(denom)


def _dkdv_kernel(window_ref, q_lo_ref, q_hi_ref, k_lo_ref, k_hi_ref,  # SMEM
                 q_ref, k_ref, v_ref, d_out_ref, q_pos_ref, k_pos_ref, lse_ref, delta_ref,  # in
                 d_k_ref, d_v_ref,  # out: [bk, D] x 2
                 d_k_acc, d_v_acc,  # scratch: float32 [bk, D] x 2
                 *, scale, softcap):
    # grid (batch, kv head, key block j, query head within the group g, query block i)
    b, j, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first = (g == 0) & (i == 0)
    last = (g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1)

    @pl.when(first)
    def _start():
        d_k_acc[...] = jnp.zeros(d_k_acc.shape, jnp.float32)
        d_v_acc[...] = jnp.zeros(d_v_acc.shape, jnp.float32)

    @pl.when(_may_see(window_ref, q_lo_ref, q_hi_ref, k_lo_ref, k_hi_ref, b, i, j))
    def _step():
        q, d_out = q_ref[...], d_out_ref[...]
        p, d_s = _score_grads(q, k_ref[...], v_ref[...], d_out, _column(q_pos_ref), k_pos_ref[:1, :], _column(lse_ref),
                              _column(delta_ref), window_ref[0], scale, softcap)
        d_v_acc[...] += _matmul(p.T.astype(d_out.dtype), d_out, (1, 0))  # dV = p^T dO
        d_k_acc[...] += _matmul(d_s.T.astype(q.dtype), q, (1, 0))  # dK = dS^T Q

    @pl.when(last)
    def _finish():
        d_k_ref[...] = d_k_acc[...].astype(d_k_ref.dtype)
        d_v_ref[...] = d_v_acc[...].astype(d_v_ref.dtype)


def _dq_kernel(window_ref, q_lo_ref, q_hi_ref, k_lo_ref, k_hi_ref,  # SMEM
               q_ref, k_ref, v_ref, d_out_ref, q_pos_ref, k_pos_ref, lse_ref, delta_ref,  # in
               d_q_ref,  # out: [bq, D]
               d_q_acc,  # scratch: float32 [bq, D]
               *, scale, softcap):
    # grid (batch, query head, query block i, key block j)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _start():
        d_q_acc[...] = jnp.zeros(d_q_acc.shape, jnp.float32)

    @pl.when(_may_see(window_ref, q_lo_ref, q_hi_ref, k_lo_ref, k_hi_ref, b, i, j))
    def _step():
        k = k_ref[...]
        _, d_s = _score_grads(q_ref[...], k, v_ref[...], d_out_ref[...], _column(q_pos_ref), k_pos_ref[:1, :],
                              _column(lse_ref), _column(delta_ref), window_ref[0], scale, softcap)
        d_q_acc[...] += _matmul(d_s.astype(k.dtype), k, (1, 0))  # dQ = dS K

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        d_q_ref[...] = d_q_acc[...].astype(d_q_ref.dtype)


# ----------------------------------------------------------------------------------------------
# The calls: layouts, grids and block specs.


def _block_tables(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array, block_q: int, block_k: int):
    """The SMEM scalars every kernel gets: `window` as int32 `[1]`, and int32 `[batch, blocks]`
    tables of each query block's smallest and largest position and each key block's smallest
    and largest non-empty position (a block of empty slots: largest -1, skipped)."""
    batch = q_pos.shape[0]
    q_blocks = q_pos.reshape(batch, -1, block_q)
    k_blocks = k_pos.reshape(batch, -1, block_k)
    k_lo = jnp.where(k_blocks >= 0, k_blocks, jnp.iinfo(jnp.int32).max).min(-1)
    return window.reshape(1), q_blocks.min(-1), q_blocks.max(-1), k_lo, k_blocks.max(-1)


def _lanes(rows: jax.Array) -> jax.Array:
    """`[..., T]` as `[..., T, LANES]`: each query row's number copied along the lanes."""
    return jnp.broadcast_to(rows[..., None], (*rows.shape, LANES))


def _sublanes(keys: jax.Array) -> jax.Array:
    """`[B, S]` as `[B, SUBLANES, S]`: each key's number copied along the sublanes."""
    return jnp.broadcast_to(keys[:, None], (keys.shape[0], SUBLANES, keys.shape[1]))


def _specs(block_q: int, block_k: int, head_dim: int, group: int, kv_major: bool):
    """Block specs of the query-side arrays (`[B, H, T, D]`, per-row `[B, H, T, LANES]`, q_pos
    `[B, T, LANES]`, per-head `[H, 1, LANES]`) and the key-side ones (`[B, N, S, D]`, k_pos
    `[B, SUBLANES, S]`), for the
    grid `(b, h, i, j)` (`kv_major` False) or `(b, n, j, g, i)` (True; query head `n * group + g`).
    A `None` dimension is squeezed: the kernel sees the block's last two dimensions."""
    if kv_major:
        def grid(b, n, j, g, i, *_):  # -> batch, query head, kv head, query block, key block
            return b, n * group + g, n, i, j
    else:
        def grid(b, h, i, j, *_):  # (`lax.div`, not `//`: h >= 0, so no sign fix-up is needed)
            return b, h, jax.lax.div(h, group), i, j

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda *point: index(*grid(*point)))

    return dict(
        q=spec((None, None, block_q, head_dim), lambda b, h, n, i, j: (b, h, i, 0)),
        rows=spec((None, None, block_q, LANES), lambda b, h, n, i, j: (b, h, i, 0)),
        q_pos=spec((None, block_q, LANES), lambda b, h, n, i, j: (b, i, 0)),
        head=spec((None, 1, LANES), lambda b, h, n, i, j: (h, 0, 0)),
        kv=spec((None, None, block_k, head_dim), lambda b, h, n, i, j: (b, n, j, 0)),
        k_pos=spec((None, SUBLANES, block_k), lambda b, h, n, i, j: (b, 0, j)),
    )


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, tables, inputs, interpret):
    """`pl.pallas_call` of `kernel` with the SMEM `tables` as scalar prefetch; the grid's last
    axes that carry scratch (one, or two in the dK/dV kernel) run in order ("arbitrary")."""
    walked = len(grid) - 3
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(tables), grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",) * walked),
        interpret=interpret,
    )(*tables, *inputs)


def _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret):
    """`(out [B, H, T, D], lse float32 [B, H, T])` of the padded, head-major arrays and the sinks `[H]`."""
    batch, n_head, T, head_dim = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    specs = _specs(block_q, block_k, head_dim, n_head // n_kv, kv_major=False)
    out, lse = _call(
        functools.partial(_forward_kernel, scale=scale, softcap=softcap),
        grid=(batch, n_head, T // block_q, S // block_k),
        in_specs=[specs["q"], specs["kv"], specs["kv"], specs["q_pos"], specs["k_pos"], specs["head"]],
        out_specs=[specs["q"], specs["rows"]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, n_head, T, LANES), jnp.float32)],
        scratch=[pltpu.VMEM((block_q, LANES), jnp.float32), pltpu.VMEM((block_q, LANES), jnp.float32),
                 pltpu.VMEM((block_q, head_dim), jnp.float32)],
        tables=_block_tables(q_pos, k_pos, window, block_q, block_k),
        inputs=(q, k, v, _lanes(q_pos), _sublanes(k_pos), _lanes(sinks[:, None])),
        interpret=interpret,
    )
    return out, lse[..., 0]


def _backward(q, k, v, q_pos, k_pos, window, sinks, out, lse, d_out, scale, softcap, block_q, block_k, interpret):
    """`(dq, dk, dv, dsinks)` of the padded, head-major arrays and the sinks, from the forward's `out` and `lse`."""
    batch, n_head, T, head_dim = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    group = n_head // n_kv
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # rowsum(dO * O): [B, H, T]
    tables = _block_tables(q_pos, k_pos, window, block_q, block_k)
    inputs = (q, k, v, d_out, _lanes(q_pos), _sublanes(k_pos), _lanes(lse), _lanes(delta))

    def in_specs(specs):  # in the order of `inputs`
        return [specs["q"], specs["kv"], specs["kv"], specs["q"], specs["q_pos"], specs["k_pos"], specs["rows"],
                specs["rows"]]

    by_key = _specs(block_q, block_k, head_dim, group, kv_major=True)
    d_k, d_v = _call(
        functools.partial(_dkdv_kernel, scale=scale, softcap=softcap),
        grid=(batch, n_kv, S // block_k, group, T // block_q),
        in_specs=in_specs(by_key),
        out_specs=[by_key["kv"], by_key["kv"]],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch=[pltpu.VMEM((block_k, head_dim), jnp.float32), pltpu.VMEM((block_k, head_dim), jnp.float32)],
        tables=tables, inputs=inputs, interpret=interpret,
    )
    by_query = _specs(block_q, block_k, head_dim, group, kv_major=False)
    d_q = _call(
        functools.partial(_dq_kernel, scale=scale, softcap=softcap),
        grid=(batch, n_head, T // block_q, S // block_k),
        in_specs=in_specs(by_query),
        out_specs=by_query["q"],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch=[pltpu.VMEM((block_q, head_dim), jnp.float32)],
        tables=tables, inputs=inputs, interpret=interpret,
    )
    return d_q, d_k, d_v, sink_grads(sinks, lse, delta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11))
def _attention(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret):
    return _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret)[0]


def _attention_fwd(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret):
    out, lse = _forward(q, k, v, q_pos, k_pos, window, sinks, scale, softcap, block_q, block_k, interpret)
    return out, (q, k, v, q_pos, k_pos, window, sinks, out, lse)


def _attention_bwd(scale, softcap, block_q, block_k, interpret, residuals, d_out):
    q, k, v, q_pos, k_pos, window, sinks, out, lse = residuals
    d_q, d_k, d_v, d_sinks = _backward(q, k, v, q_pos, k_pos, window, sinks, out, lse, d_out, scale, softcap,
                                       block_q, block_k, interpret)
    return d_q, d_k, d_v, None, None, None, d_sinks  # positions and window: integers, no gradient


_attention.defvjp(_attention_fwd, _attention_bwd)
