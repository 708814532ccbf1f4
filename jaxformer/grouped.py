"""The grouped product of a mixture of experts: rows sorted by expert, each group of rows times
its expert's matrix,

    y[r] = x[r] @ w[e(r)]        x [R, d], w [E, d, F], e(r) the expert of row r

computed at the cost of the rows it has, never of all `E` experts for every row.

`dispatch` lays a call's `(token, choice)` pairs out by expert: a stable sort by expert id, each
expert's group then padded to a whole number of blocks of `block` rows, so that every block
belongs to one expert. The layout's size is static (`Layout.blocks`, an upper bound whatever
the choices), so one compiled program serves every routing.

Ways to multiply the blocks (`PRODUCTS`), chosen per platform (`jaxformer.experts` does, with
`jax.lax.platform_dependent` and `device_products`):

    in_blocks   a scan over the blocks, each `[block, d] @ w[e]` reading its one expert's
                matrix, an unused block skipped: a CPU's way (its `ragged_dot` computes every
                row against every expert and masks: `E` times the work)
    unrolled    the same, the scan unrolled (a decoding step's few blocks)
    triton      the Pallas kernels of `jaxformer.kernels.grouped_matmul` on this layout, a tile
    mosaic      of rows one expert's, its matrix picked from the block table: a GPU's (Triton)
                and a TPU's (Mosaic) way, where the kernels take the shapes and the blocks
    ragged      `jax.lax.ragged_dot` on the groups' sizes, left to the GPU's or TPU's compiler
                (elsewhere; XLA's GPU compiler may expand it to a dense product per group)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.kernels import grouped_matmul as kernels
from jaxformer.products import precision_for, product
from jaxformer.quantized import QArray, dequantize, frozen_cotangent

LARGEST_BLOCK = 128  # rows per block at most (`block_size`)
UNROLLED_BLOCKS = 64  # `in_blocks(unroll=True)` unrolls its loop over this many blocks or fewer


def block_size(rows: int, n_experts: int) -> int:
    """Rows per block for `rows` (token, choice) pairs over `n_experts`: about the rows an expert
    gets on average, a power of two in `[1, LARGEST_BLOCK]`. Larger blocks mean fewer steps but
    more padding: an expert's last block is padded, up to `block - 1` rows of zeros."""
    size = 1
    while size * 2 <= min(LARGEST_BLOCK, rows / n_experts):
        size *= 2
    return size


class Layout(NamedTuple):
    """Where each (token, choice) pair sits among the rows of the grouped product.

    Attributes:
      order: int32 `[N * k]`, the pairs (flattened `[N, k]` indices) in expert order (a stable sort).
      dest: int32 `[N * k]`, the row of the product that the i-th pair of `order` is; `rows` (past
        the end) for a pair dropped by a capacity.
      group_sizes: int32 `[E]`, each expert's rows with padding (a multiple of the block).
      block_expert: int32 `[blocks]`, each block's expert; `E` for a block past the last group.
      dropped: int32 `[]`, the pairs a capacity dropped (0 without one).
      block: rows per block.
    """

    order: jax.Array
    dest: jax.Array
    group_sizes: jax.Array
    block_expert: jax.Array
    dropped: jax.Array
    block: int

    @property
    def rows(self) -> int:
        """The padded rows of the product: `blocks * block`."""
        return self.block_expert.shape[0] * self.block


def n_blocks(pairs: int, n_experts: int, block: int) -> int:
    """Blocks enough for any routing of `pairs` pairs: the pairs' own blocks, plus one partly
    filled block per expert that has any (none when a block is one row)."""
    return -(-pairs // block) + (min(n_experts, pairs) if block > 1 else 0)


def dispatch(ids: jax.Array, n_experts: int, block: int, capacity: int | None = None) -> Layout:
    """The `Layout` of the choices `ids` (int `[N, k]`, each in `[0, n_experts)`): dropless, each
    expert's pairs padded to whole blocks of `block` rows; or with a `capacity`, one block of
    `capacity` rows per expert, an expert's pairs past it (in token order) dropped.

    An id `n_experts` (or above) is a pair this call does not run: it gets no row (its `dest` is
    past the end, like a capacity's drop, its output zeros) and is not counted as dropped. Expert
    parallelism (`jaxformer.experts.expert_parallel`) so leaves the pairs of other devices' experts."""
    flat = ids.reshape(-1)  # [N * k], pair p = token p // k's choice p % k
    pairs = flat.shape[0]
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # ties keep token order; foreign pairs last
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # [E] pairs per expert (foreign ones not)
    expert = flat[order]  # [N * k] the sorted pairs' experts
    ours = expert < n_experts  # [N * k] the pairs this call runs
    rank = jnp.arange(pairs) - (jnp.cumsum(sizes) - sizes)[expert]  # each sorted pair's place in its group
    if capacity is not None:
        kept = ours & (rank < capacity)
        dest = jnp.where(kept, expert * capacity + rank, n_experts * capacity)
        return Layout(order, dest.astype(jnp.int32), jnp.full(n_experts, capacity, jnp.int32),
                      jnp.arange(n_experts, dtype=jnp.int32), (ours & ~kept).sum().astype(jnp.int32), capacity)
    padded = -(-sizes // block) * block  # [E], each group to whole blocks
    padded_end = jnp.cumsum(padded)  # [E]
    blocks = n_blocks(pairs, n_experts, block)
    dest = jnp.where(ours, (padded_end - padded)[expert] + rank, blocks * block)
    block_expert = jnp.searchsorted(padded_end, jnp.arange(blocks) * block, side="right").astype(jnp.int32)
    return Layout(order, dest.astype(jnp.int32), padded, block_expert, jnp.int32(0), block)


def gather_rows(x: jax.Array, layout: Layout, k: int) -> jax.Array:
    """`[rows, d]`: token `p // k`'s vector at the row of each pair p, zeros in the padding."""
    tokens = layout.order // k  # [N * k] the token of each sorted pair
    return jnp.zeros((layout.rows, x.shape[-1]), x.dtype).at[layout.dest].set(x[tokens], mode="drop")


def scatter_rows(y: jax.Array, layout: Layout, pairs_shape: tuple[int, int]) -> jax.Array:
    """`[N, k, F]`: each pair's row of `y [rows, F]` back in its (token, choice) place (zeros for
    a dropped pair)."""
    out = jnp.zeros((pairs_shape[0] * pairs_shape[1], y.shape[-1]), y.dtype)
    rows = jnp.take(y, layout.dest, axis=0, mode="fill", fill_value=0)
    return out.at[layout.order].set(rows).reshape(*pairs_shape, y.shape[-1])


def row_experts(layout: Layout) -> jax.Array:
    """int32 `[rows]`, each row's expert (`E` past the last group)."""
    return jnp.repeat(layout.block_expert, layout.block)


def ragged(x: jax.Array, w: jax.Array, layout: Layout) -> jax.Array:
    """`y [rows, F]`, `y[r] = x[r] @ w[e(r)]`, by `jax.lax.ragged_dot` over the padded groups
    (the rows past the last group, zeros, stay zeros); a quantized stack dequantized for the call."""
    w = dequantize(w, x.dtype) if isinstance(w, QArray) else w
    y = jax.lax.ragged_dot(x, w, layout.group_sizes, precision=precision_for(x.dtype),
                           preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def in_blocks(x: jax.Array, w: jax.Array, layout: Layout, unroll: bool = False) -> jax.Array:
    """`y [rows, F]`, `y[r] = x[r] @ w[e(r)]`, a block at a time (`_blocked`); with `unroll`, the loop
    over the blocks unrolled where they are `UNROLLED_BLOCKS` or fewer.

    Unrolled for a decoding step alone: there a step's one-row products are short against XLA:CPU's
    loop (docs/performance.md, "Mixtures of experts"), while a prompt's blocks, unrolled, make a
    program of three products per block and layer that compiles several times as long for little
    gain (an OLMoE-shaped layer's 5-token prompt, 40 blocks: 30.4 s against 10.5 s)."""
    blocks = layout.block_expert.shape[0]
    y = _blocked(x.reshape(blocks, layout.block, x.shape[-1]), w, layout.block_expert,
                 unroll and blocks <= UNROLLED_BLOCKS)
    return y.reshape(layout.rows, w.shape[-1])


def _block_product(equation: str, x_block: jax.Array, w: jax.Array, e: jax.Array, out_shape) -> jax.Array:
    """`einsum(equation, x_block, w[e])` in `x_block`'s dtype, or zeros for a block past the last
    group (`e == E`): its expert's matrix alone is read (a quantized one multiplied as `product`
    multiplies it: int8's W8A8, another format dequantized for this block)."""
    n_experts = w.shape[0]

    def used():
        w_e = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, e, keepdims=False), w)  # (a QArray's leaves)
        if isinstance(w_e, QArray):
            return product(equation, x_block, w_e)
        return jnp.einsum(equation, x_block, w_e, precision=precision_for(x_block.dtype),
                          preferred_element_type=jnp.float32).astype(x_block.dtype)

    return jax.lax.cond(e < n_experts, used, lambda: jnp.zeros(out_shape, x_block.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _blocked(x: jax.Array, w: jax.Array, block_expert: jax.Array, unroll: bool) -> jax.Array:
    """`[blocks, block, F]`: block j of `x [blocks, block, d]` times `w[block_expert[j]]`."""
    return _blocked_product("bd,df->bf", x, w, block_expert, (x.shape[1], w.shape[-1]), unroll)


def _blocked_product(equation: str, x: jax.Array, w: jax.Array, block_expert: jax.Array, shape,
                     unroll: bool = False) -> jax.Array:
    """`[blocks, *shape]`: `einsum(equation, x[j], w[block_expert[j]])` for each block j."""

    def step(_, inputs):
        x_block, e = inputs
        return None, _block_product(equation, x_block, w, e, shape)

    return jax.lax.scan(step, None, (x, block_expert), unroll=unroll)[1]


def _blocked_fwd(x, w, block_expert, unroll):
    return _blocked(x, w, block_expert, unroll), (x, w, block_expert)


def _blocked_bwd(unroll, residuals, dy):
    """`y_j = x_j w_e`: `dx_j = dy_j w_e^T`, and `dw_e` the sum of `x_j^T dy_j` over e's blocks,
    each block adding into its expert's rows of one `[E, d, F]` carry (autodiff of the scan
    would build a whole `[E, d, F]` per block). Two loops, so that where `w` is frozen (LoRA's
    base) the compiler drops the second, whose result nothing reads."""
    x, w, block_expert = residuals
    n_experts = w.shape[0]
    dx = _blocked_product("bf,df->bd", dy, w, block_expert, x.shape[1:])
    if isinstance(w, QArray):  # frozen, as `product`'s quantized matrices
        return dx, frozen_cotangent(w), None

    def add_block(dw, inputs):
        x_block, dy_block, e = inputs

        def add(dw):
            grad = jnp.einsum("bd,bf->df", x_block, dy_block, precision=precision_for(x_block.dtype),
                              preferred_element_type=jnp.float32)
            row = jax.lax.dynamic_index_in_dim(dw, e, keepdims=False) + grad
            return jax.lax.dynamic_update_index_in_dim(dw, row, e, 0)

        return jax.lax.cond(e < n_experts, add, lambda dw: dw, dw), None

    dw, _ = jax.lax.scan(add_block, jnp.zeros(w.shape, jnp.float32), (x, dy, block_expert))
    return dx, dw.astype(w.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def in_kernels(x: jax.Array, w: jax.Array, layout: Layout, *, platform: str, interpret: bool = False) -> jax.Array:
    """`y [rows, F]`, `y[r] = x[r] @ w[e(r)]`, by `platform`'s Pallas kernels ("triton" or
    "mosaic": `kernels.grouped_matmul`, `interpret` to run them on a CPU), for a layout whose
    block `kernels.row_tile` takes and shapes `kernels.supports` takes."""
    return kernels.grouped_matmul(x, w, layout.block_expert, platform=platform, interpret=interpret)


PRODUCTS = {"ragged": ragged, "in_blocks": in_blocks, "unrolled": functools.partial(in_blocks, unroll=True),
            "triton": functools.partial(in_kernels, platform="triton"),
            "mosaic": functools.partial(in_kernels, platform="mosaic")}
KERNEL_PRODUCTS = ("mosaic", "triton")  # the kernels' products: compiled for a GPU or TPU (a CPU: `interpret`)
KERNEL_ROWS = kernels.ROW_TILES[-1]  # the kernels' least block: smaller layouts' blocks grow to it


def device_products(d: int, F: int, dtype, pairs: int, n_experts: int, capacity: int | None,
                    quantized: bool = False) -> dict[str, dict]:
    """How a GPU and a TPU multiply the experts' blocks, `{"cuda": options, "tpu": options,
    "default": options}`, each `dict(how=..., block=...)` for the products of a layer of width d
    and experts' width F in `dtype` over `pairs` (token, choice) pairs: the Pallas kernels where
    they take those shapes (`kernels.supports`) and blocks (`kernels.row_tile`), `ragged_dot`
    elsewhere. A dropless layout's blocks are `block_size`'s, at least `KERNEL_ROWS` for the
    kernels (an expert's last block padded further), and a block of one row for `ragged_dot`;
    with a capacity, one block of `capacity` rows per expert either way. `quantized` matrices take
    `ragged_dot` everywhere (`ragged`: dequantized for the call; the kernels read float matrices)."""
    ragged_options = dict(how="ragged", block=capacity or 1)
    block = capacity or max(KERNEL_ROWS, block_size(pairs, n_experts))

    def on(platform):
        takes = not quantized and kernels.supports(d, F, dtype, platform) and kernels.row_tile(block) is not None
        return dict(how=platform, block=block) if takes else ragged_options

    return {"cuda": on("triton"), "tpu": on("mosaic"), "default": ragged_options}


@functools.partial(jax.jit, static_argnames=("block", "how", "capacity", "interpret"))
def grouped_product(x: jax.Array, w: jax.Array, ids: jax.Array, *, block: int = 1, how: str = "in_blocks",
                    capacity: int | None = None, interpret: bool = False) -> jax.Array:
    """`[N, k, F]`: `x[n] @ w[ids[n, c]]` for each token n and choice c (zeros where a `capacity`
    drops the pair), through the layout and one grouped product (`PRODUCTS[how]`; a kernel's in
    Pallas's interpreter with `interpret`): what the experts' layer does, for tests and benchmarks."""
    layout = dispatch(ids, w.shape[0], block, capacity)
    multiply = PRODUCTS[how]
    if how in KERNEL_PRODUCTS:
        multiply = functools.partial(multiply, interpret=interpret)
    y = multiply(gather_rows(x, layout, ids.shape[1]), w, layout)
    return scatter_rows(y, layout, ids.shape)
