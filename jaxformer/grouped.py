"""The grouped product of a mixture of experts: rows sorted by expert, each group of rows times
its expert's matrix,

    y[r] = x[r] @ w[e(r)]        x [R, d], w [E, d, F], e(r) the expert of row r

computed at the cost of the rows it has, never of all `E` experts for every row.

`dispatch` lays a call's `(token, choice)` pairs out by expert: a stable sort by expert id, each
expert's group then padded to a whole number of blocks of `block` rows, so that every block
belongs to one expert. The layout's size is static (`Layout.blocks`, an upper bound whatever
the choices), so one compiled program serves every routing.

Two ways to multiply the blocks, chosen per platform (`jaxformer.experts` does, with
`jax.lax.platform_dependent`):

    in_blocks   a scan over the blocks, each `[block, d] @ w[e]` reading its one expert's
                matrix, an unused block skipped: a CPU's way (its `ragged_dot` computes every
                row against every expert and masks: `E` times the work)
    ragged      `jax.lax.ragged_dot` on the groups' sizes: the grouped-matmul kernels of a
                GPU and a TPU compiler
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.products import precision_for

LARGEST_BLOCK = 128  # rows per block at most (`block_size`)


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
    (the rows past the last group, zeros, stay zeros)."""
    y = jax.lax.ragged_dot(x, w, layout.group_sizes, precision=precision_for(x.dtype),
                           preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def in_blocks(x: jax.Array, w: jax.Array, layout: Layout) -> jax.Array:
    """`y [rows, F]`, `y[r] = x[r] @ w[e(r)]`, a block at a time (`_blocked`)."""
    blocks = layout.block_expert.shape[0]
    y = _blocked(x.reshape(blocks, layout.block, x.shape[-1]), w, layout.block_expert)
    return y.reshape(layout.rows, w.shape[-1])


def _block_product(equation: str, x_block: jax.Array, w: jax.Array, e: jax.Array, out_shape) -> jax.Array:
    """`einsum(equation, x_block, w[e])` in `x_block`'s dtype, or zeros for a block past the last
    group (`e == E`): its expert's matrix alone is read."""
    n_experts = w.shape[0]

    def used():
        w_e = jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
        return jnp.einsum(equation, x_block, w_e, precision=precision_for(x_block.dtype),
                          preferred_element_type=jnp.float32).astype(x_block.dtype)

    return jax.lax.cond(e < n_experts, used, lambda: jnp.zeros(out_shape, x_block.dtype))


@jax.custom_vjp
def _blocked(x: jax.Array, w: jax.Array, block_expert: jax.Array) -> jax.Array:
    """`[blocks, block, F]`: block j of `x [blocks, block, d]` times `w[block_expert[j]]`."""
    shape = (x.shape[1], w.shape[-1])

    def step(_, inputs):
        x_block, e = inputs
        return None, _block_product("bd,df->bf", x_block, w, e, shape)

    return jax.lax.scan(step, None, (x, block_expert))[1]


def _blocked_fwd(x, w, block_expert):
    return _blocked(x, w, block_expert), (x, w, block_expert)


def _blocked_bwd(residuals, dy):
    """`y_j = x_j w_e`: `dx_j = dy_j w_e^T`, and `dw_e` the sum of `x_j^T dy_j` over e's blocks,
    each block adding into its expert's rows of one `[E, d, F]` carry (autodiff of the scan
    would build a whole `[E, d, F]` per block)."""
    x, w, block_expert = residuals
    n_experts = w.shape[0]

    def step(dw, inputs):
        x_block, dy_block, e = inputs
        dx_block = _block_product("bf,df->bd", dy_block, w, e, x_block.shape)

        def add(dw):
            grad = jnp.einsum("bd,bf->df", x_block, dy_block, precision=precision_for(x_block.dtype),
                              preferred_element_type=jnp.float32)
            row = jax.lax.dynamic_index_in_dim(dw, e, keepdims=False) + grad
            return jax.lax.dynamic_update_index_in_dim(dw, row, e, 0)

        return jax.lax.cond(e < n_experts, add, lambda dw: dw, dw), dx_block

    dw, dx = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), (x, dy, block_expert))
    return dx, dw.astype(w.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)

PRODUCTS = {"ragged": ragged, "in_blocks": in_blocks}


@functools.partial(jax.jit, static_argnames=("block", "how", "capacity"))
def grouped_product(x: jax.Array, w: jax.Array, ids: jax.Array, *, block: int = 1, how: str = "in_blocks",
                    capacity: int | None = None) -> jax.Array:
    """`[N, k, F]`: `x[n] @ w[ids[n, c]]` for each token n and choice c (zeros where a `capacity`
    drops the pair), through the layout and one grouped product (`PRODUCTS[how]`): what the
    experts' layer does, for tests and benchmarks."""
    layout = dispatch(ids, w.shape[0], block, capacity)
    y = PRODUCTS[how](gather_rows(x, layout, ids.shape[1]), w, layout)
    return scatter_rows(y, layout, ids.shape)
