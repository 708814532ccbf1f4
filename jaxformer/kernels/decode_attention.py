"""Decode attention as Pallas kernels: one new token per row, each row reading only its filled cache.

While decoding, every row of the batch adds one token. The KV cache of a layer is `k, v [B, S, N, D]`,
slot s holding position s (S is the capacity); row b's new token sits at position `q_pos[b]`, and its own
key and value are already written at slot `q_pos[b]`. Row b's query may read the slots

    s in (q_pos[b] - window, q_pos[b]]  and  0 <= s < S

(`window` a traced int32, e.g. 2**30 for a full layer): a contiguous run `[lo, hi]` of slots. Dense
attention scores all S slots of every row; these kernels walk only the key blocks of `block_k` slots that
hold a visible slot, so a short row costs little even in a long cache. Within a block the slots outside
`[lo, hi]` are masked out (their content is never used: it may be anything, NaN included).

Over the blocks, the softmax is computed online (as in `jaxformer.blockwise`), keeping per query head

    m      the largest score seen so far
    denom  sum of exp(score - m) over the slots seen so far
    acc    sum of exp(score - m) * v over the slots seen so far

and rescaling `denom` and `acc` by `exp(m - m')` whenever a block raises the maximum to m'. At the end
`out = acc / denom` is exactly `softmax(scores) @ v` (0 for a row that sees no slot). A query head's
attention sink (gpt-oss), a logit that joins the softmax as one more slot of value 0, is folded in there,
after the last block (`blockwise.fold_sink`): `softmax(concat(scores, sink))[..., :-1] @ v`. A score is
`(q . k) * scale`, then `softcap * tanh(score / softcap)` if a softcap is given; all of it in float32
(float32 products at float32 precision, `products.precision_for`).

Grouped-query attention: query head h reads kv head `h // G`, `G = H // N`; the G query heads of a kv head
are computed together, so each block of K and V is read from memory once for the whole group.

Two versions of the same computation:

- Triton (GPUs): a program per (row, kv head), looping over the row's visible key blocks with loop bounds
  computed in the kernel from `q_pos` and `window`. Loads are masked, so slots outside `[lo, hi]` are not
  even read.
- Mosaic (TPUs): grid (row, key block), the key-block axis sequential, with `q_pos` and `window` prefetched
  into scalar memory. The index map of K and V clamps the block index into the row's visible blocks: a
  block index equal to the previous step's is not fetched again, so no block outside the visible range is
  copied to VMEM, and `pl.when` skips the compute of those steps. m, denom and acc live in VMEM scratch
  across the steps. (A step covers all kv heads: a TPU block's last two dimensions must be whole or
  multiples of (8, 128), and one kv head of `[B, S, N, D]` would be a block `(block_k, 1, D)`, whose `N`
  dimension is neither. The cache is not transposed for the kernel, which would copy it at every step.)
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxformer.blockwise import fold_sink, sink_logits
from jaxformer.products import precision_for

PLATFORMS = ("triton", "mosaic")
# Default key-block sizes: Triton keeps a [block_k, D] tile of K and of V in registers; a Mosaic step
# copies a [block_k, N, D] block of each into VMEM, and a multiple of 128 fills the TPU's lanes.
DEFAULT_BLOCK_K = {"triton": 64, "mosaic": 256}
# Triton's matrix product needs at least 16 rows: a smaller group of query heads is padded to 16.
_TRITON_MIN_ROWS = 16


def supports(head_dim: int, dtype, platform: str) -> bool:
    """Whether `decode_attention` on `platform` ("triton" or "mosaic") compiles for heads of `head_dim`
    channels in `dtype`; where it does not, attend with `jnp` instead.

    Triton's tensors have power-of-two sizes and its matrix products at least 16 on each side: a head_dim a
    power of two from 16 to 256 (the kernel holds a [block_k, head_dim] tile of K and of V at once). A TPU
    lays the last dimension on its 128 lanes: a head_dim that is a multiple of 128. Both take float32 and
    bfloat16.
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return False
    if platform == "triton":
        return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
    if platform == "mosaic":
        return head_dim % 128 == 0
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "block_k", "platform", "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, window: jax.Array, *,
                     scale: float | None = None, softcap: float | None = None, sinks: jax.Array | None = None,
                     block_k: int | None = None, platform: str = "triton", interpret: bool = False) -> jax.Array:
    """Attention of one new token per row over the visible slots of its row's KV cache, as a Pallas kernel.

    Args:
      q: `[B, H, D]`, each row's query (one token), float32 or bfloat16.
      k, v: `[B, S, N, D]` the cache, slot s holding position s; `H % N == 0`, query head h reads kv head
        `h // (H // N)`.
      q_pos: int `[B]`, each row's position; its key and value are at slot `q_pos[b]` (so `q_pos[b] < S`).
        A negative position (an idle row) sees no slot.
      window: int32 `[]` (traced): slots `(q_pos - window, q_pos]` are visible; 2**30 for full attention.
      scale: the scores' scale, `1 / sqrt(D)` by default.
      softcap: if given, scores become `softcap * tanh(score / softcap)` (Gemma 2).
      sinks: float32 `[H]`, each query head's sink logit (gpt-oss), or None: no sink.
      block_k: slots per key block, `DEFAULT_BLOCK_K[platform]` by default; a power of two of at least 16
        for Triton; for Mosaic on a TPU best a multiple of 128 (the slots lie along the lanes of the
        scores). S need not be a multiple of it.
      platform: "triton" (GPUs) or "mosaic" (TPUs); see `supports` for the head sizes each compiles for.
      interpret: run the kernel in Pallas' interpreter (on any backend, e.g. a CPU) instead of compiling it.

    Returns:
      `[B, H, D]` in `q.dtype`: `softmax(q k^T * scale) @ v` over each row's visible slots (with sinks,
      `softmax(concat(scores, sink))[..., :-1] @ v`), 0 for a row that sees none.
    """
    H, D = q.shape[1:]
    N = k.shape[2]
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    if H % N:
        raise ValueError(f"the query heads ({H}) must be a multiple of the kv heads ({N})")
    block_k = DEFAULT_BLOCK_K[platform] if block_k is None else block_k
    if platform == "triton" and (block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"Triton's block_k must be a power of two of at least 16, got {block_k}")
    scale = 1 / math.sqrt(D) if scale is None else scale
    q_pos = q_pos.astype(jnp.int32)
    window = jnp.asarray(window, jnp.int32).reshape(1)  # a [1] array: Pallas passes blocks, not scalars
    call = _triton_decode if platform == "triton" else _mosaic_decode
    return call(q, k, v, q_pos, window, sink_logits(sinks, H), scale=scale, softcap=softcap, block_k=block_k,
                interpret=interpret)


# --- shared by both kernels ---------------------------------------------------------------------------


def _visible_slots(q_pos: jax.Array, window: jax.Array, S: int) -> tuple[jax.Array, jax.Array]:
    """A row's visible slots `[lo, hi]` (int32 scalars; none when lo > hi): `q_pos - window < s <= q_pos`
    and `0 <= s < S`."""
    return jnp.maximum(q_pos - window + 1, 0), jnp.minimum(q_pos, S - 1)


def _visible_blocks(lo: jax.Array, hi: jax.Array, S: int, block_k: int) -> tuple[jax.Array, jax.Array]:
    """The key blocks `[first, end)` holding a visible slot of `[lo, hi]` (`end == first`: none), with
    `0 <= first < cdiv(S, block_k)` always, so that `first` is a block that exists."""
    # lax.div truncates; both are divisions of slots >= 0 (hi where lo <= hi), for which it floors
    # (jnp's `//` would add a sign correction that the TPU lowering cannot always compile).
    first = lax.div(jnp.minimum(lo, S - 1), block_k)
    end = jnp.where(lo <= hi, lax.div(hi, block_k) + 1, first)
    return first, end


def _scores(q: jax.Array, k: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    """float32 `[G, block_k]` scores of queries `q [G, D]` against keys `k [block_k, D]`: `(q . k) * scale`,
    then `softcap * tanh(score / softcap)` if a softcap is given."""
    scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision_for(q.dtype),
                             preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    return scores


def _online_softmax_step(m: jax.Array, denom: jax.Array, acc: jax.Array, scores: jax.Array,
                         v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Folds one key block into the running softmax of G query heads.

    Args:
      m, denom: float32 `[G, 1]`, the running maximum and sum of `exp(score - m)`.
      acc: float32 `[G, D]`, the running sum of `exp(score - m) * v`.
      scores: float32 `[G, block_k]`, -inf at the slots not visible; the block holds at least one visible
        slot (so the new maximum is finite, and `exp(-inf - m')` is an exact 0).
      v: `[block_k, D]`, 0 at the slots not visible (a 0 weight times NaN would still be NaN).

    Returns:
      The new `(m, denom, acc)`.
    """
    m_new = jnp.maximum(m, scores.max(axis=1, keepdims=True))
    correction = jnp.exp(m - m_new)  # exp(m - m'): rescales the sums kept so far (0 before the first block)
    p = jnp.exp(scores - m_new)  # [G, block_k] unnormalised weights, 0 where not visible
    denom_new = correction * denom + p.sum(axis=1, keepdims=True)
    # The weights meet v in its own dtype (as `combine_values` does), accumulated in float32.
    pv = jnp.dot(p.astype(v.dtype), v, precision=precision_for(v.dtype), preferred_element_type=jnp.float32)
    acc_new = correction * acc + pv
    return m_new, denom_new, acc_new


def _finish(m: jax.Array, denom: jax.Array, acc: jax.Array, sink: jax.Array) -> jax.Array:
    """`acc / denom` with the sink folded into the running softmax (`m`, `denom`, `sink` float32 `[G, 1]`, `acc`
    `[G, D]`): the softmax-weighted sum of v; 0 for a row that saw no slot (there acc = 0)."""
    _, denom, rescale = fold_sink(m, denom, sink)
    return acc * rescale / jnp.where(denom > 0, denom, 1.0)  # (no slot and no sink: denom = 0, 0 / 1)


# --- Triton (GPU) -------------------------------------------------------------------------------------


def _triton_kernel(q_pos_ref, window_ref, sink_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float,
                   softcap: float | None, block_k: int):
    """One (row b, kv head n) program.

    Refs: `q_pos_ref`, `window_ref` int32 `[]`; `sink_ref` float32 `[G']` the group's sinks; `q_ref` `[G', D]`
    the group's query heads (both padded to G' rows); `k_ref`, `v_ref` `[S, D]` row b's cache of kv head n;
    `o_ref` `[G', D]`.
    """
    S = k_ref.shape[0]
    lo, hi = _visible_slots(q_pos_ref[...], window_ref[...], S)
    first, end = _visible_blocks(lo, hi, S, block_k)
    q = q_ref[...]

    def block(j, carry):
        start = pl.multiple_of(j * block_k, block_k)
        slots = start + jnp.arange(block_k)
        seen = (slots >= lo) & (slots <= hi)  # [block_k]; also False past the end of the cache (hi < S)
        # Masked loads: a slot that is not visible is not read, it comes in as 0.
        k = pltriton.load(k_ref.at[pl.ds(start, block_k), :], mask=seen[:, None], other=0)
        v = pltriton.load(v_ref.at[pl.ds(start, block_k), :], mask=seen[:, None], other=0)
        scores = jnp.where(seen[None, :], _scores(q, k, scale, softcap), -jnp.inf)
        return _online_softmax_step(*carry, scores, v)

    rows, D = q.shape
    start = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
             jnp.zeros((rows, D), jnp.float32))
    m, denom, acc = lax.fori_loop(first, end, block, start)  # only the visible blocks
    o_ref[...] = _finish(m, denom, acc, sink_ref[...][:, None]).astype(o_ref.dtype)


def _triton_decode(q, k, v, q_pos, window, sinks, *, scale, softcap, block_k, interpret):
    """`decode_attention` with the Triton kernel: a program per (row, kv head)."""
    B, H, D = q.shape
    S, N = k.shape[1], k.shape[2]
    G = H // N
    rows = max(_TRITON_MIN_ROWS, pl.next_power_of_2(G))
    q = q.reshape(B, N, G, D)  # query head h = n * G + g: kv head n's group
    q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - G), (0, 0)))  # zero rows, dropped from the output
    sinks = jnp.pad(sinks.reshape(N, G), ((0, 0), (0, rows - G)), constant_values=-jnp.inf)  # [N, rows], as q
    kernel = functools.partial(_triton_kernel, scale=scale, softcap=softcap, block_k=block_k)
    out = pl.pallas_call(
        kernel,
        grid=(B, N),
        in_specs=[
            pl.BlockSpec((None,), lambda b, n: (b,)),  # q_pos[b]
            pl.BlockSpec((None,), lambda b, n: (0,)),  # window
            pl.BlockSpec((None, rows), lambda b, n: (n, 0)),  # sinks[n]
            pl.BlockSpec((None, None, rows, D), lambda b, n: (b, n, 0, 0)),  # q[b, n]
            pl.BlockSpec((None, S, None, D), lambda b, n: (b, 0, n, 0)),  # k[b, :, n]: the kernel picks blocks
            pl.BlockSpec((None, S, None, D), lambda b, n: (b, 0, n, 0)),  # v[b, :, n]
        ],
        out_specs=pl.BlockSpec((None, None, rows, D), lambda b, n: (b, n, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, N, rows, D), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="triton_decode_attention",
    )(q_pos, window, sinks, q, k, v)
    return out[:, :, :G].reshape(B, H, D)


# --- Mosaic (TPU) -------------------------------------------------------------------------------------


def _mosaic_kernel(q_pos_ref, window_ref, sink_ref, q_ref, k_ref, v_ref, o_ref, m_ref, denom_ref, acc_ref, *,
                   scale: float, softcap: float | None, block_k: int, S: int):
    """Grid step (row b, key block j).

    Refs: `q_pos_ref` int32 `[B]`, `window_ref` int32 `[1]` (scalar memory); `sink_ref` float32 `[H, 1]`
    each query head's sink; `q_ref` `[H, D]` row b's queries; `k_ref`, `v_ref` `[block_k, N, D]` the key
    block the index map chose; `o_ref` `[H, D]`; scratch `m_ref`, `denom_ref` float32 `[H, 1]`, `acc_ref`
    float32 `[H, D]` (see `_online_softmax_step`).
    """
    b, j = pl.program_id(0), pl.program_id(1)
    lo, hi = _visible_slots(q_pos_ref[b], window_ref[0], S)
    first, end = _visible_blocks(lo, hi, S, block_k)
    H, N = q_ref.shape[0], k_ref.shape[1]
    G = H // N

    @pl.when(j == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((first <= j) & (j < end))  # a block outside the visible ones: its step does nothing
    def _block():
        # The slots of this block, along the keys of the scores [G, block_k] and along the rows of v.
        slots_row = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        slots_col = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        seen_row = (slots_row >= lo) & (slots_row <= hi)  # also False past the end of the cache (hi < S)
        seen_col = (slots_col >= lo) & (slots_col <= hi)
        for n in range(N):  # each kv head with its group of query heads n * G ... n * G + G - 1
            heads = pl.ds(n * G, G)
            scores = jnp.where(seen_row, _scores(q_ref[heads, :], k_ref[:, n, :], scale, softcap), -jnp.inf)
            v = jnp.where(seen_col, v_ref[:, n, :], 0)
            m, denom, acc = _online_softmax_step(m_ref[heads, :], denom_ref[heads, :], acc_ref[heads, :],
                                                 scores, v)
            m_ref[heads, :], denom_ref[heads, :], acc_ref[heads, :] = m, denom, acc

    @pl.when(j == pl.num_programs(1) - 1)
    def _end():
        o_ref[...] = _finish(m_ref[...], denom_ref[...], acc_ref[...], sink_ref[...]).astype(o_ref.dtype)


def _mosaic_kv_block(b, j, q_pos_ref, window_ref, *, S: int, block_k: int) -> jax.Array:
    """The key block grid step (b, j) copies in: j clamped into row b's visible blocks `[first, end)`.

    Before them the index stays at the first visible block, after them at the last (block `first` when
    none is visible). A block index equal to the previous step's is not fetched again, so each visible
    block is copied in once, and no other block is.
    """
    lo, hi = _visible_slots(q_pos_ref[b], window_ref[0], S)
    first, end = _visible_blocks(lo, hi, S, block_k)
    return jnp.minimum(jnp.maximum(j, first), jnp.maximum(end - 1, first))


def _mosaic_decode(q, k, v, q_pos, window, sinks, *, scale, softcap, block_k, interpret):
    """`decode_attention` with the Mosaic kernel: grid (row, key block)."""
    B, H, D = q.shape
    S, N = k.shape[1], k.shape[2]
    kv_block = functools.partial(_mosaic_kv_block, S=S, block_k=block_k)

    def kv_index(b, j, q_pos_ref, window_ref):
        return b, kv_block(b, j, q_pos_ref, window_ref), 0, 0

    def row_index(b, j, q_pos_ref, window_ref):
        return b, 0, 0

    kernel = functools.partial(_mosaic_kernel, scale=scale, softcap=softcap, block_k=block_k, S=S)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # q_pos and window: read by the index maps and the kernel
        grid=(B, pl.cdiv(S, block_k)),
        in_specs=[
            pl.BlockSpec((H, 1), lambda b, j, q_pos_ref, window_ref: (0, 0)),  # sinks, whole
            pl.BlockSpec((None, H, D), row_index),  # q[b]
            pl.BlockSpec((None, block_k, N, D), kv_index),  # k[b, block]
            pl.BlockSpec((None, block_k, N, D), kv_index),  # v[b, block]
        ],
        out_specs=pl.BlockSpec((None, H, D), row_index),  # written at the last key block
        scratch_shapes=[pltpu.VMEM((H, 1), jnp.float32), pltpu.VMEM((H, 1), jnp.float32),
                        pltpu.VMEM((H, D), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, H, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="mosaic_decode_attention",
    )(q_pos, window, sinks.reshape(H, 1), q, k, v)
