"""The grouped product of a mixture of experts as Pallas kernels, for GPUs (Triton) and TPUs
(Mosaic), forward and backward, over `jaxformer.grouped`'s blocked layout (read its docstring
first):

    y[r] = x[r] @ w[e(r)]        x [rows, d], w [E, d, F], e(r) the expert of row r

The rows come in tiles of `tm` rows (a layout's block, or a part of it), and every tile is one
expert's: `tile_expert[t]`, or `E` for a tile past the last group (zeros in, zeros out). So a
tile's product is one dense `[tm, d] @ [d, F]`, its expert's matrix picked by the table, with
none of the group-boundary bookkeeping of a general grouped matmul (Megablox's, whose tiles
may straddle two groups). The tiles past the last group come last, after `used` tiles of real
groups, and an expert's tiles are consecutive.

Three products, each a kernel of both backends:

    forward   y_t  = x_t w_e              a tile's rows times its expert's matrix
    dx        dx_t = dy_t w_e^T           the same kernel, w's tile transposed in the contraction
                                          (w^T is never written out)
    dw        dw_e = sum over e's tiles of x_t^T dy_t     an expert with no tile: zeros

Mosaic (TPU). A grid step's blocks are copied into VMEM by index maps, which read the tile
table from SMEM (scalar prefetch): the weight's block of tile t is `w[tile_expert[t]]`'s. The
forward's grid is (F tile n, row tile t, d tile k), k innermost and "arbitrary": a float32
VMEM accumulator sums over k and is written out at the last k. Consecutive tiles of one expert
map to the same weight block (with d whole, k = 0 alone), which the pipeline does not copy
again. A tile past the last group copies nothing new (its index maps clamp to the last used
tile) and writes zeros. dx is the same call with the weight's block `[tn, tk]` at (e, n, k)
contracted over its last axis. dw's grid is (d tile, F tile, row tile t), t innermost and
"arbitrary": the output block is expert `tile_expert[t]`'s, revisited over that expert's
consecutive tiles (as Megablox's tgmm does); the accumulator starts at an expert's first tile
and is written at its last. Past the last used tile the index stays at the last expert's block
and nothing is written (its buffer keeps what was). An expert with no tile is never visited:
the output aliases an array of zeros, so its gradient is zero.

Triton (GPU). No scalar prefetch: a program loads its tile's expert id and slices the weight
itself. Forward and dx: grid (row tile t, output tile n), each program a loop over the
contraction's tiles; a tile past the last group stores zeros without reading a weight. dw:
grid (expert e, d tile, F tile), each program a loop over expert e's tiles `[start_e, end_e)`
(from the sorted table), summing `x_t^T dy_t` in registers: each output tile has one program,
so no atomics and a fixed order of sums; an expert with no tile loops zero times and stores
zeros.

Both accumulate in float32 and multiply float32 at full precision (`products.precision_for`).
`supports` says which shapes and dtypes each takes. On a CPU the kernels run with
`interpret=True` (slowly: it is for tests); no GPU or TPU ran them here, they were interpreted
and lowered (docs/performance.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxformer.products import precision_for

PLATFORMS = ("triton", "mosaic")
# Rows per tile: a power of two from 16 (Triton multiplies matrices of at least 16 a side; a
# bfloat16 TPU tile is 16 sublanes) to 128, the largest that divides the layout's block.
ROW_TILES = (128, 64, 32, 16)
# Triton: d and F in tiles of the largest power of two up to 64 that divides them (at least 16).
TRITON_TILES = (64, 32, 16)
# Mosaic: d and F in tiles of the largest of these that divides them (a TPU lane is 128 wide);
# a dimension no multiple of 128 is one whole block, up to MOSAIC_WHOLE.
MOSAIC_TILES = (512, 256, 128)
MOSAIC_WHOLE = 512


def supports(d: int, F: int, dtype, platform: str) -> bool:
    """Whether `grouped_matmul` on `platform` ("triton" or "mosaic") compiles for `x [rows, d]`
    and `w [E, d, F]` (and the experts' down projection, `[rows, F]` by `[E, F, d]`) in `dtype`;
    where it does not, multiply with `jax.lax.ragged_dot`.

    Triton: d and F multiples of 16 (its tiles are powers of two from 16). Mosaic: each a
    multiple of 128, or at most `MOSAIC_WHOLE` (one whole block). Both take float32 and bfloat16.
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return False
    if platform == "triton":
        return d % 16 == 0 and F % 16 == 0
    if platform == "mosaic":
        return all(n % 128 == 0 or n <= MOSAIC_WHOLE for n in (d, F))
    raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")


def row_tile(block: int) -> int | None:
    """The rows per tile of a layout with blocks of `block` rows: the largest of `ROW_TILES`
    dividing it, or None (a block the kernels do not take: `jax.lax.ragged_dot` then)."""
    return next((tm for tm in ROW_TILES if block % tm == 0), None)


def _tile(n: int, platform: str) -> int:
    """The tile of a dimension of n (d or F) on `platform`, as `supports` allows it."""
    tiles = TRITON_TILES if platform == "triton" else MOSAIC_TILES
    return next((t for t in tiles if n % t == 0), n)


@functools.partial(jax.jit, static_argnames=("platform", "tiles", "interpret"))
def grouped_matmul(x: jax.Array, w: jax.Array, block_expert: jax.Array, *, platform: str,
                   tiles: tuple[int, int] | None = None, interpret: bool = False) -> jax.Array:
    """`y [rows, F]`, `y[r] = x[r] @ w[e(r)]`, on a layout of blocks each one expert's (as
    `grouped.dispatch` lays them out), by the Pallas kernels of `platform`; differentiable in x
    and w (the backward is kernels too). Jitted: a model's products of one shape (its layers',
    gate's and up's) trace and lower the kernels once, and inside `platform_dependent` the
    platforms a program does not run on cost a CPU's trace little.

    Args:
      x: `[rows, d]`, `rows = blocks * block`, float32 or bfloat16; the rows of a block past the
        last group are zeros (`grouped.gather_rows` leaves them so).
      w: `[E, d, F]`, x's dtype.
      block_expert: int32 `[blocks]`, each block's expert, non-decreasing, `E` for a block past
        the last group (`grouped.Layout.block_expert`).
      platform: "triton" (GPUs) or "mosaic" (TPUs); `supports` says which d, F and dtypes.
      tiles: `(td, tf)`, the tiles of d and F; by default as `supports` says (tests pass smaller
        ones to cover several tiles at small sizes).
      interpret: run the kernels in Pallas's interpreter (on any backend, e.g. a CPU) instead of
        compiling them.

    Returns:
      `[rows, F]` in x's dtype: zeros in a block past the last group.

    Raises:
      ValueError: a platform, block, shape or dtype the kernels do not take.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    rows, d = x.shape
    F = w.shape[-1]
    blocks = block_expert.shape[0]
    block = rows // blocks
    if w.dtype != x.dtype or not supports(d, F, x.dtype, platform):
        raise ValueError(f"grouped_matmul on {platform} does not take x {x.dtype}{list(x.shape)} by "
                         f"w {w.dtype}{list(w.shape)} (supports, and one dtype)")
    if block * blocks != rows or row_tile(block) is None:
        raise ValueError(f"blocks of {rows / blocks:g} rows: the kernels take multiples of {ROW_TILES[-1]}")
    tm = row_tile(block)
    tiles = (_tile(d, platform), _tile(F, platform)) if tiles is None else tiles
    tile_expert = jnp.repeat(block_expert.astype(jnp.int32), block // tm)  # [rows / tm], each tile's expert
    return _grouped(x, w, tile_expert, platform, tiles, interpret)


# --- Mosaic (TPU) -----------------------------------------------------------------------------


def _matmul(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """float32 product of 2-D `a` and `b` over axis `contract[0]` of a and `contract[1]` of b
    ((1, 0): a @ b; (1, 1): a @ b^T; (0, 0): a^T @ b), at full precision for float32."""
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               preferred_element_type=jnp.float32, precision=precision_for(a.dtype))


def _last_used(t, used_ref):
    """Row tile t, or the last used tile for a tile past it (so that its blocks are the last
    used tile's, already in VMEM, and nothing new is copied in)."""
    return jnp.maximum(jnp.minimum(t, used_ref[0] - 1), 0)


def _expert_of(t, expert_ref, used_ref, n_experts):
    """Tile t's expert for an index map: the last used tile's past it (never `E`)."""
    return jnp.minimum(expert_ref[_last_used(t, used_ref)], n_experts - 1)


def _mosaic_product_kernel(expert_ref, used_ref, x_ref, w_ref, out_ref, acc_ref, *, transpose: bool):
    """Grid step (output tile n, row tile t, contraction tile k).

    Refs: `expert_ref` int32 `[tiles]`, `used_ref` int32 `[1]` (SMEM); `x_ref [tm, tk]`; `w_ref`
    `[tk, tn]` (`[tn, tk]` when `transpose`), tile t's expert's; `out_ref [tm, tn]`; scratch
    `acc_ref` float32 `[tm, tn]`.
    """
    t, k = pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t < used_ref[0])  # a tile past the last group: its sum stays 0
    def _step():
        acc_ref[...] += _matmul(x_ref[...], w_ref[...], (1, 1 if transpose else 0))

    @pl.when(k == pl.num_programs(2) - 1)
    def _finish():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _mosaic_product(x, w, tile_expert, used, tiles, transpose, interpret):
    """`[rows, F]` (x @ w per tile) or, `transpose`, `[rows, d]` (x @ w^T per tile, x `[rows, F]`)."""
    rows = x.shape[0]
    n_experts, d, F = w.shape
    tm = rows // tile_expert.shape[0]
    td, tf = tiles
    # The output's dimension and the contraction's, and their tiles.
    (n_out, tn), (n_in, tk) = ((d, td), (F, tf)) if transpose else ((F, tf), (d, td))

    def x_index(n, t, k, expert_ref, used_ref):
        return _last_used(t, used_ref), k

    def w_index(n, t, k, expert_ref, used_ref):
        e = _expert_of(t, expert_ref, used_ref, n_experts)
        return (e, n, k) if transpose else (e, k, n)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,  # the tile table and the used tiles: read by the index maps and the kernel
        grid=(n_out // tn, tile_expert.shape[0], n_in // tk),
        in_specs=[pl.BlockSpec((tm, tk), x_index),
                  pl.BlockSpec((None, tn, tk) if transpose else (None, tk, tn), w_index)],
        out_specs=pl.BlockSpec((tm, tn), lambda n, t, k, *_: (t, n)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_mosaic_product_kernel, transpose=transpose),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((rows, n_out), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="grouped_matmul_dx" if transpose else "grouped_matmul",
    )(tile_expert, used, x, w)


def _mosaic_weight_grad_kernel(expert_ref, used_ref, x_ref, dy_ref, zeros_ref, dw_ref, acc_ref):
    """Grid step (d tile a, F tile b, row tile t).

    Refs: `expert_ref` int32 `[tiles]`, `used_ref` int32 `[1]` (SMEM); `x_ref [tm, td]`, `dy_ref
    [tm, tf]` tile t's; `zeros_ref` the zeros `dw_ref` aliases (in HBM, unread); `dw_ref [td, tf]`
    the block of tile t's expert; scratch `acc_ref` float32 `[td, tf]`.
    """
    del zeros_ref
    t, used = pl.program_id(2), used_ref[0]
    e = expert_ref[t]
    first = (t == 0) | (expert_ref[jnp.maximum(t - 1, 0)] != e)  # the expert's first tile
    last = (t == used - 1) | (expert_ref[jnp.minimum(t + 1, pl.num_programs(2) - 1)] != e)  # and its last

    @pl.when((t < used) & first)
    def _start():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(t < used)
    def _step():
        x = x_ref[...]
        # x_t^T dy_t, x_t transposed in float32 (as Megablox's tgmm and the attention kernels transpose).
        acc_ref[...] += _matmul(x.astype(jnp.float32).T.astype(x.dtype), dy_ref[...], (1, 0))

    @pl.when((t < used) & last)
    def _finish():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)

    @pl.when(used == 0)  # no tile in any group: the one block the index map stays on is still written (zeros)
    def _nothing():
        dw_ref[...] = jnp.zeros(dw_ref.shape, dw_ref.dtype)


def _mosaic_weight_grad(x, dy, tile_expert, used, n_experts, dtype, tiles, interpret):
    """`dw [E, d, F]` in `dtype`: each expert's sum of `x_t^T dy_t` over its tiles, 0 for one with none."""
    rows, d = x.shape
    F = dy.shape[1]
    tm = rows // tile_expert.shape[0]
    td, tf = tiles

    def rows_index(a, b, t, expert_ref, used_ref, *, column):  # x's block (t, a), dy's (t, b)
        return _last_used(t, used_ref), (a if column == "a" else b)

    def dw_index(a, b, t, expert_ref, used_ref):
        return _expert_of(t, expert_ref, used_ref, n_experts), a, b

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(d // td, F // tf, tile_expert.shape[0]),
        in_specs=[pl.BlockSpec((tm, td), functools.partial(rows_index, column="a")),
                  pl.BlockSpec((tm, tf), functools.partial(rows_index, column="b")),
                  pl.BlockSpec(memory_space=pl.ANY)],  # the zeros: aliased by the output, never copied in
        out_specs=pl.BlockSpec((None, td, tf), dw_index),
        scratch_shapes=[pltpu.VMEM((td, tf), jnp.float32)],
    )
    return pl.pallas_call(
        _mosaic_weight_grad_kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((n_experts, d, F), dtype),
        # (operands counted with the scalar prefetch: the zeros are the fifth) An expert never visited keeps them.
        input_output_aliases={4: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="grouped_matmul_dw",
    )(tile_expert, used, x, dy, jnp.zeros((n_experts, d, F), dtype))


# --- Triton (GPU) -----------------------------------------------------------------------------


def _triton_product_kernel(expert_ref, x_ref, w_ref, out_ref, *, tk: int, transpose: bool):
    """Program (row tile t, output tile n).

    Refs: `expert_ref` int32 `[]`, tile t's expert; `x_ref [tm, K]` its rows (K the contraction,
    d or F); `w_ref [E, K, tn]` (`[E, tn, K]` when `transpose`), every expert's columns of output
    tile n; `out_ref [tm, tn]`.
    """
    n_experts = w_ref.shape[0]
    e = expert_ref[...]

    def product(e):
        def step(k, acc):
            cols = pl.ds(pl.multiple_of(k * tk, tk), tk)
            w = w_ref[e, :, cols] if transpose else w_ref[e, cols, :]
            return acc + _matmul(x_ref[:, cols], w, (1, 1 if transpose else 0))

        return jax.lax.fori_loop(0, x_ref.shape[1] // tk, step, jnp.zeros(out_ref.shape, jnp.float32))

    # A tile past the last group (e == E) reads no weight and stores zeros.
    acc = jax.lax.cond(e < n_experts, product, lambda e: jnp.zeros(out_ref.shape, jnp.float32), e)
    out_ref[...] = acc.astype(out_ref.dtype)


def _triton_product(x, w, tile_expert, tiles, transpose, interpret):
    """As `_mosaic_product`, a program per (row tile, output tile)."""
    rows, K = x.shape
    n_experts, d, F = w.shape
    tm = rows // tile_expert.shape[0]
    td, tf = tiles
    (n_out, tn), tk = ((d, td), tf) if transpose else ((F, tf), td)
    if transpose:  # every expert's rows n of w [E, d, F]: w_e^T's columns n
        w_spec = pl.BlockSpec((n_experts, tn, K), lambda t, n: (0, n, 0))
    else:
        w_spec = pl.BlockSpec((n_experts, K, tn), lambda t, n: (0, 0, n))
    return pl.pallas_call(
        functools.partial(_triton_product_kernel, tk=tk, transpose=transpose),
        grid=(tile_expert.shape[0], n_out // tn),
        in_specs=[pl.BlockSpec((None,), lambda t, n: (t,)),  # tile_expert[t]
                  pl.BlockSpec((tm, K), lambda t, n: (t, 0)),  # tile t's rows
                  w_spec],
        out_specs=pl.BlockSpec((tm, tn), lambda t, n: (t, n)),
        out_shape=jax.ShapeDtypeStruct((rows, n_out), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="grouped_matmul_dx" if transpose else "grouped_matmul",
    )(tile_expert, x, w)


def _triton_weight_grad_kernel(start_ref, end_ref, x_ref, dy_ref, dw_ref, *, tm: int):
    """Program (expert e, d tile a, F tile b).

    Refs: `start_ref`, `end_ref` int32 `[]`, expert e's tiles `[start, end)`; `x_ref [rows, td]`,
    `dy_ref [rows, tf]`, every row's columns a and b; `dw_ref [td, tf]`.
    """
    def step(t, acc):
        rows = pl.ds(pl.multiple_of(t * tm, tm), tm)
        return acc + _matmul(x_ref[rows, :], dy_ref[rows, :], (0, 0))  # x_t^T dy_t

    acc = jax.lax.fori_loop(start_ref[...], end_ref[...], step, jnp.zeros(dw_ref.shape, jnp.float32))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _triton_weight_grad(x, dy, tile_expert, n_experts, dtype, tiles, interpret):
    """As `_mosaic_weight_grad`, a program per (expert, d tile, F tile)."""
    rows, d = x.shape
    F = dy.shape[1]
    tm = rows // tile_expert.shape[0]
    td, tf = tiles
    experts = jnp.arange(n_experts, dtype=jnp.int32)
    # Each expert's tiles, consecutive in the sorted table: [start, end), empty for an expert with none.
    start = jnp.searchsorted(tile_expert, experts, side="left").astype(jnp.int32)
    end = jnp.searchsorted(tile_expert, experts, side="right").astype(jnp.int32)
    per_expert = pl.BlockSpec((None,), lambda e, a, b: (e,))
    return pl.pallas_call(
        functools.partial(_triton_weight_grad_kernel, tm=tm),
        grid=(n_experts, d // td, F // tf),
        in_specs=[per_expert, per_expert,
                  pl.BlockSpec((rows, td), lambda e, a, b: (0, a)),
                  pl.BlockSpec((rows, tf), lambda e, a, b: (0, b))],
        out_specs=pl.BlockSpec((None, td, tf), lambda e, a, b: (e, a, b)),
        out_shape=jax.ShapeDtypeStruct((n_experts, d, F), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="grouped_matmul_dw",
    )(start, end, x, dy)


# --- the product and its gradient -------------------------------------------------------------


def _product(x, w, tile_expert, platform, tiles, transpose, interpret):
    if platform == "triton":
        return _triton_product(x, w, tile_expert, tiles, transpose, interpret)
    used = jnp.sum(tile_expert < w.shape[0], dtype=jnp.int32).reshape(1)
    return _mosaic_product(x, w, tile_expert, used, tiles, transpose, interpret)


def _weight_grad(x, dy, tile_expert, n_experts, dtype, platform, tiles, interpret):
    if platform == "triton":
        return _triton_weight_grad(x, dy, tile_expert, n_experts, dtype, tiles, interpret)
    used = jnp.sum(tile_expert < n_experts, dtype=jnp.int32).reshape(1)
    return _mosaic_weight_grad(x, dy, tile_expert, used, n_experts, dtype, tiles, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, tile_expert, platform, tiles, interpret):
    return _product(x, w, tile_expert, platform, tiles, False, interpret)


def _grouped_fwd(x, w, tile_expert, platform, tiles, interpret):
    return _grouped(x, w, tile_expert, platform, tiles, interpret), (x, w, tile_expert)


def _grouped_bwd(platform, tiles, interpret, residuals, dy):
    """`y_t = x_t w_e`: `dx_t = dy_t w_e^T`, `dw_e = sum over e's tiles of x_t^T dy_t`."""
    x, w, tile_expert = residuals
    dx = _product(dy, w, tile_expert, platform, tiles, True, interpret)
    dw = _weight_grad(x, dy, tile_expert, w.shape[0], w.dtype, platform, tiles, interpret)
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)
