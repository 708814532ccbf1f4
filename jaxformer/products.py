"""`product(equation, x, w)`: the einsum every weight matrix of the decoder is applied with.

In float32 (and float64) it is `jnp.einsum`. With narrower operands (bfloat16) every product accumulates
in float32 and rounds once, on every backend, and is written so that XLA:CPU runs it on
bfloat16 data (docs/performance.md, "bfloat16 on a CPU"):

- `preferred_element_type=float32`: XLA:CPU sends a bf16 x bf16 -> f32 product to its
  YNNPACK kernel, which reads the bf16 matrix as it is; a bf16-out product is instead
  computed from a float32 copy of the matrix (twice its bytes, written and read again).
- A product of one row (decoding one sequence) is computed as two (the row and a zero
  row): XLA:CPU turns one row into a matrix-vector product of its own, which again works
  on a float32 copy.
- The gradient is written out (a custom VJP) so that the backward products are bf16 x
  bf16 as well: autodiff's would multiply the float32 cotangent by the bf16 matrix, and the
  mixed product converts the matrix.

A quantized matrix (`jaxformer.quantized`, a qwix `QArray`) is multiplied in the form its format
pays in (docs/precision.md):

- int8 (one scale per output channel): `x` is quantized too, each row to int8 with its own scale
  (`s_x = max|x| / 127`), the product is int8 x int8 summed exactly in int32, and one multiply by
  `s_x s_w` gives it back: W8A8, as llama.cpp computes it. On a CPU it is written here, since
  XLA:CPU's integer product is fast only with `x` first and the matrix stored `[out, in]` (as a
  `Quantized` is: `[in, out]` ran 2.7x slower, and qwix's einsum, which puts the matrix first,
  11x; docs/precision.md); elsewhere it is qwix's einsum of the same two quantized operands (the
  platforms' int8 dots).
- every other format: the matrix is dequantized where it is used, inside the product's program,
  and multiplied as a float one of `x`'s dtype; on a CPU block by block of its output rows, each
  block dequantized while it is in cache (`_by_blocks`), elsewhere whole, where XLA fuses it.

Either way the matrix is frozen: its gradient is zero, and `x`'s is `dy` times the dequantized
matrix (the straight-through estimate for `x`'s rounding).
"""

import functools
import math

import jax
import jax.numpy as jnp
import qwix

from jaxformer.kernels import cpu
from jaxformer.quantized import QArray, Quantized, dequantize_stored, format_of, frozen_cotangent


def product(equation: str, x: jax.Array, w: jax.Array, wide: bool = False) -> jax.Array:
    """`einsum(equation, x, w)` in `x`'s dtype, accumulated in float32.

    Args:
      equation: an einsum of two operands with explicit letters (no `...`), each letter in
        two of the three terms: `"btd,df->btf"`.
      x: the input (activations); its first axis is not one the product sums over.
      w: the matrix.
      wide: give the float32 sums as they are, not rounded to `x`'s dtype (the logits).

    Returns:
      The product, in `x`'s dtype (float32 with `wide`, unless `x` is wider).
    """
    if isinstance(w, QArray):
        return _quantized(equation, wide, x, w)
    form = _kernel_form(equation, x)
    if form and x.dtype == w.dtype and x.dtype in (jnp.float32, jnp.bfloat16) and cpu.fits(
            f"{form}_product", *_sizes(equation, w)):
        return _decoding(equation, wide, x, w)
    return _reference(equation, wide, x, w)


def _reference(equation: str, wide: bool, x: jax.Array, w: jax.Array) -> jax.Array:
    """A float `product` as XLA computes it."""
    if min(jnp.finfo(x.dtype).bits, jnp.finfo(w.dtype).bits) >= 32:
        # float32 (or float64) throughout: autodiff's gradient, at the library's float32 precision
        return jnp.einsum(equation, x, w, precision=precision_for(x.dtype))
    return _narrow(equation, wide, x, w)


KERNEL_ROWS = 256  # the most rows of x a product sends to the CPU products (decoding's, a prompt's); more: XLA's


def _kernel_form(equation: str, x: jax.Array) -> str | None:
    """"kn" or "nk" where `equation` (its matrix's letters in their stored order) is a 2-D product the
    CPU products take (`jaxformer.kernels.cpu`, where they run): x `[rows..., K...]` with at most
    `KERNEL_ROWS` rows, w stored `[K..., N...]` ("kn") or `[N..., K...]` ("nk"), the output
    `[rows..., N...]`; else None."""
    if not cpu.enabled():
        return None
    x_spec, w_spec, out, summed = _letters(equation)
    x_rest, w_rest = x_spec[:-len(summed)], "".join(a for a in w_spec if a not in summed)
    if not (x_spec.endswith(summed) and out == x_rest + w_rest) or math.prod(x.shape[:len(x_rest)]) > KERNEL_ROWS:
        return None
    return "kn" if w_spec == summed + w_rest else "nk" if w_spec == w_rest + summed else None


def _sizes(equation: str, w) -> tuple[int, int]:
    """(K, N): the sizes of the matrix's summed axes and of its others."""
    _, w_spec, _, summed = _letters(equation)
    return (math.prod(n for a, n in zip(w_spec, w.shape) if a in summed),
            math.prod(n for a, n in zip(w_spec, w.shape) if a not in summed))


def _as_rows(equation: str, x: jax.Array, w) -> tuple[jax.Array, int, tuple[int, ...]]:
    """x as `[R, K]`, K, and the output's shape, for a product in `_kernel_form`."""
    x_spec, _, out, summed = _letters(equation)
    rows = x.shape[:len(x_spec) - len(summed)]
    k = math.prod(x.shape[len(rows):])
    out_shape = rows + tuple(n for a, n in zip(_letters(equation)[1], w.shape) if a not in summed)
    return x.reshape(-1, k), k, out_shape


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decoding(equation: str, wide: bool, x: jax.Array, w: jax.Array) -> jax.Array:
    """A float product of a few rows by the CPU products (XLA's elsewhere), the gradient XLA's."""
    def on_cpu(x, w):
        rows, k, out_shape = _as_rows(equation, x, w)
        y = (cpu.kn_product(rows, w.reshape(k, -1)) if _kernel_form(equation, x) == "kn"
             else cpu.nk_product(rows, w.reshape(-1, k)))
        return y.reshape(out_shape).astype(jnp.float32 if wide else x.dtype)

    return jax.lax.platform_dependent(x, w, cpu=on_cpu, default=functools.partial(_reference, equation, wide))


def _decoding_fwd(equation, wide, x, w):
    return _decoding(equation, wide, x, w), (x, w)


def _decoding_bwd(equation, wide, residuals, dy):
    return jax.vjp(functools.partial(_reference, equation, wide), *residuals)[1](dy)


_decoding.defvjp(_decoding_fwd, _decoding_bwd)


def precision_for(dtype) -> jax.lax.Precision:
    """The matmul precision the library asks for with operands of `dtype` (docs/precision.md):
    `HIGHEST` for float32, so that float32 means float32 on every backend (left to the backend,
    an NVIDIA GPU multiplies float32 matrices in TF32, a 10-bit mantissa, and a TPU in bfloat16
    passes); `DEFAULT` for bfloat16 operands, whose products accumulate in float32 as asked for
    with `preferred_element_type`."""
    return jax.lax.Precision.HIGHEST if jnp.finfo(dtype).bits >= 32 else jax.lax.Precision.DEFAULT


def _accumulated(equation: str, x: jax.Array, w: jax.Array, wide: bool = False) -> jax.Array:
    """`einsum(equation, x, w, preferred_element_type=float32)` in `x`'s dtype (float32 if
    `wide`); one row as two."""
    x_spec, w_spec = equation.split("->")[0].split(",")
    summed = math.prod(n for axis, n in zip(w_spec, w.shape) if axis in x_spec)  # the contracted size
    one_row = x_spec[0] not in w_spec and x.size == summed  # every axis of x but the summed ones is 1
    y = jnp.einsum(equation, jnp.concatenate([x, jnp.zeros_like(x)]) if one_row else x, w,
                   preferred_element_type=jnp.float32, precision=precision_for(x.dtype))
    return (y[:1] if one_row else y).astype(jnp.float32 if wide else x.dtype)  # `y[:1]`: the row's, not the zero row's


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _narrow(equation: str, wide: bool, x: jax.Array, w: jax.Array) -> jax.Array:
    return _accumulated(equation, x, w, wide)


def _narrow_fwd(equation, wide, x, w):
    return _accumulated(equation, x, w, wide), (x, w)


def _narrow_bwd(equation, wide, residuals, dy):
    """`y = x . w` summed over their shared axes: `dx = dy . w`, `dw = x . dy`, each over the
    axes the other operand lacks (a float32 `dy` of a `wide` product rounded to `x`'s dtype
    first, so that both products stay narrow)."""
    x, w = residuals
    (x_spec, w_spec), y_spec = equation.split("->")[0].split(","), equation.split("->")[1]
    dy = dy.astype(x.dtype)
    dx = _accumulated(f"{y_spec},{w_spec}->{x_spec}", dy, w)
    dw = _accumulated(f"{x_spec},{y_spec}->{w_spec}", x, dy.astype(x.dtype))
    return dx.astype(x.dtype), dw.astype(w.dtype)


_narrow.defvjp(_narrow_fwd, _narrow_bwd)


def _letters(equation: str) -> tuple[str, str, str, str]:
    """`(x's, w's, the output's, the summed)` letters of a two-operand einsum."""
    (x_spec, w_spec), out = equation.split("->")[0].split(","), equation.split("->")[1]
    return x_spec, w_spec, out, "".join(a for a in x_spec if a in w_spec and a not in out)


def _int8_rows(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """`(q_x, s_x)`: x's rows (over `axes`) as int8, each with its own scale `s_x = max|row| / 127`
    (float32, `axes` kept as 1s), `q_x = round(x / s_x)` in [-127, 127]."""
    x = x.astype(jnp.float32)
    s_x = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / 127
    s_x = jnp.where(s_x > 0, s_x, 1)  # an all-zero row: any scale gives zeros
    return jnp.round(x / s_x).astype(jnp.int8), s_x


def _w8a8(equation: str, x: jax.Array, w: QArray) -> jax.Array:
    """`einsum(equation, x, W)` for an int8 `w` (a scale per output channel), float32: `x`'s rows
    quantized to int8 each with its own scale, the integer product summed in int32, then scaled."""
    x_spec, w_spec, out, summed = _letters(equation)
    x_axes = tuple(x_spec.index(a) for a in summed)
    q_x, s_x = _int8_rows(x, x_axes)
    s_w = w.scale.astype(jnp.float32)
    x_rest = "".join(a for a in x_spec if a not in summed)
    w_rest = "".join(a for a in w_spec if a not in summed)
    # s_x s_w laid out as the output: an outer product over their own letters (no sum)
    scales = jnp.einsum(f"{x_rest},{w_rest}->{out}", jnp.squeeze(s_x, x_axes),
                        jnp.squeeze(s_w, tuple(w_spec.index(a) for a in summed)))

    def on_cpu(q_x, q_w):  # x first: XLA:CPU's fast integer product (module docstring)
        k = len(summed)
        if x_spec.endswith(summed) and w_spec.endswith(summed) and out == x_rest + w_rest:
            # As one 2-D product `[rows, K] x [N, K]`, the form XLA:CPU's int8 kernel runs fast (with
            # several output or summed axes it took ~6x as long), one row as two (one alone: 10x).
            rows = math.prod(q_x.shape[:-k])
            flat_x, flat_w = q_x.reshape(rows, -1), q_w.reshape(math.prod(q_w.shape[:-k]), -1)
            if _kernel_form(equation, x) and cpu.fits("int8_product", *flat_w.shape[::-1]):
                ints = cpu.int8_product(flat_x, flat_w)  # (a few rows: the CPU products' exact sums)
            else:
                flat_x = jnp.concatenate([flat_x, jnp.zeros_like(flat_x)]) if rows == 1 else flat_x
                ints = jnp.einsum("rk,nk->rn", flat_x, flat_w, preferred_element_type=jnp.int32)[:rows]
            return ints.reshape(*q_x.shape[:-k], *q_w.shape[:-k]).astype(jnp.float32)  # (exact below 2^24)
        return jnp.einsum(equation, q_x, q_w, preferred_element_type=jnp.int32).astype(jnp.float32)

    def elsewhere(q_x, q_w):  # qwix's product of the two quantized operands, unscaled
        return qwix.einsum(equation, QArray(q_x, jnp.ones_like(s_x)), QArray(q_w, jnp.ones_like(s_w)),
                           preferred_element_type=jnp.float32)

    return jax.lax.platform_dependent(q_x, w.qvalue, cpu=on_cpu, default=elsewhere) * scales


def _stored(equation: str, w: QArray) -> str:
    """`equation` with `w`'s letters in its stored order (a `Quantized`'s inputs last)."""
    x_spec, w_spec, out, _ = _letters(equation)
    return f"{x_spec},{w.stored_order(w_spec) if isinstance(w, Quantized) else w_spec}->{out}"


def _quantized_forward(equation: str, wide: bool, x: jax.Array, w: QArray) -> jax.Array:
    equation = _stored(equation, w)
    x_spec, w_spec, out, summed = _letters(equation)
    if format_of(w) == "int8" and all(w.scale.shape[w_spec.index(a)] == 1 for a in summed):  # (summed over
        # its inputs: one scale per output channel; a product over its outputs takes the dequantized matrix)
        y = _w8a8(equation, x, w)
        return y if wide or jnp.finfo(x.dtype).bits > 32 else y.astype(x.dtype)
    x_rest, w_rest = (''.join(a for a in spec if a not in summed) for spec in (x_spec, w_spec))
    if not (x_spec.endswith(summed) and w_spec.endswith(summed) and out == x_rest + w_rest):
        return _dequantized(equation, wide, x, w)  # (a product over the matrix's outputs, or its experts')
    k = len(summed)
    if format_of(w) == "int4" and w.zero_point is None and _group(w, k):
        on_cpu = functools.partial(_w4a8, equation, wide)
    else:
        on_cpu = functools.partial(_by_blocks, wide, k)
    return jax.lax.platform_dependent(x, w, cpu=on_cpu, default=functools.partial(_dequantized, equation, wide))


def _waiting(w: QArray, x: jax.Array) -> QArray:
    """`w` made to wait for `x` before it is dequantized. A dequantization reads parameters alone, and
    XLA:CPU schedules every layer's first, holding the whole model in float at once (it drops an
    optimization barrier); a zero times one of x's numbers (which it does not fold: x may not be
    finite) added to the scales makes each wait for its layer."""
    return w.replace(scale=w.scale + jnp.zeros((), w.scale.dtype) * x.reshape(-1)[0].astype(w.scale.dtype))


def _dequantized(equation: str, wide: bool, x: jax.Array, w: QArray) -> jax.Array:
    """`equation` with `w` dequantized whole, once `x` is there."""
    return product(equation, x, dequantize_stored(_waiting(w, x), x.dtype), wide)


def _group(w: QArray, k: int) -> int | None:
    """The inputs a scale of `w` (stored `[outs..., ins...]`, k input axes) covers, where they are a run
    of consecutive inputs of one output (int4's groups, as `jaxformer.quantized` tiles them): each
    input axis's tile, from the last, its whole length until one that is not, 1 before it; else None."""
    tiles = [n // m for n, m in zip(w.qvalue.shape, w.scale.shape)]
    if any(t != 1 for t in tiles[:-k]):
        return None
    group, whole = 1, True
    for n, t in reversed(list(zip(w.qvalue.shape[-k:], tiles[-k:]))):
        if t > 1 and not whole:
            return None
        group, whole = group * t, whole and t == n
    return group


def _w4a8(equation: str, wide: bool, x: jax.Array, w: QArray) -> jax.Array:
    """int4 (symmetric, in groups) on a CPU: W4A8, as llama.cpp computes Q4_0. `x`'s rows are quantized
    to int8 as W8A8's are (`_int8_rows`), each group's integer sum is taken and scaled by its group's
    scale, and the row's scale multiplies the total:

        y[r, n] = s_x[r] sum_g s[n, g] sum_{k in g} q_x[r, k] q[n, k]

    by the CPU products for a few rows (each group's sum exact in int32), else as the product of
    `q_x` (exact in x's dtype) with the dequantized matrix by blocks (`_by_blocks`)."""
    x_spec, _, _, summed = _letters(equation)
    k = len(summed)
    q_x, s_x = _int8_rows(x, tuple(range(x.ndim - k, x.ndim)))
    rows, n = x.shape[:-k], w.qvalue.shape[:-k]
    flat_q = w.qvalue.reshape(math.prod(n), -1)  # [N, K]
    if _kernel_form(equation, x) and cpu.fits("int4_product", flat_q.shape[1], flat_q.shape[0],
                                              flat_q.shape[1] // _group(w, k)):
        sums = cpu.int4_product(q_x.reshape(-1, flat_q.shape[1]), flat_q, w.scale.reshape(flat_q.shape[0], -1))
        sums = sums.reshape(*rows, *n)
    else:
        sums = _by_blocks(True, k, q_x.astype(x.dtype), w)
    y = sums * s_x.reshape(*rows, *(1,) * len(n))
    return y if wide or jnp.finfo(x.dtype).bits > 32 else y.astype(x.dtype)


BLOCK_VALUES = 2**19  # a block's dequantized values: 2 MiB of float32, which stays in a core's cache


def _by_blocks(wide: bool, k: int, x: jax.Array, w: QArray) -> jax.Array:
    """`x . W^T` for `W` stored `[outs..., ins...]` (`x` `[rows..., ins...]`, k input axes), as a loop over blocks of
    W's output rows, each dequantized and multiplied while it is in cache. Dequantized whole, the
    matrix is written to and read back from memory in float32 (8x int4's bytes): on XLA:CPU a
    2048 x 8192 int4 product took 87 ms so against float32's 17.5 (docs/precision.md)."""
    outs, ins = w.qvalue.shape[:-k], w.qvalue.shape[-k:]
    n, width = math.prod(outs), math.prod(ins)
    # The fewest blocks of whole rows within BLOCK_VALUES each (rows that divide n).
    count = next(c for c in range(max(1, -(-n * width // BLOCK_VALUES)), n + 1) if n % c == 0)
    rows = x.reshape(-1, width)
    # XLA:CPU slices a float8 (FP8) array in a loop only after converting all of it to float16 (the
    # whole matrix written out before the loop: the blocks' point lost), so the loop slices its bits,
    # as uint8, and each block takes them back. (MXFP4's values are held as their uint4 codes for the
    # same reason, `jaxformer.quantized`: a 4-bit bitcast fails in XLA:CPU's lowering at some shapes.)
    w = _waiting(w, x)
    values = w.qvalue.dtype
    fp8 = jnp.issubdtype(values, jnp.floating) and jnp.finfo(values).bits == 8
    qvalue = jax.lax.bitcast_convert_type(w.qvalue, jnp.uint8) if fp8 else w.qvalue
    flat = [None if a is None else a.reshape(count, n // count, -1) for a in (qvalue, w.scale, w.zero_point)]

    def block(parts):
        q, scale, zero_point = parts
        q = jax.lax.bitcast_convert_type(q, values) if fp8 else q
        return product("rk,nk->rn", rows, dequantize_stored(QArray(q, scale, zero_point, qtype=w.qtype), x.dtype),
                       wide)

    y = jax.lax.map(block, flat)
    return jnp.moveaxis(y, 0, 1).reshape(*x.shape[:-k], *outs)  # [count, rows, n / count] -> [rows..., outs...]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _quantized(equation: str, wide: bool, x: jax.Array, w: QArray) -> jax.Array:
    return _quantized_forward(equation, wide, x, w)


def _quantized_fwd(equation, wide, x, w):
    return _quantized_forward(equation, wide, x, w), (x, w)


def _quantized_bwd(equation, wide, residuals, dy):
    """`dx = dy . W` with the dequantized `W` (through `x`'s rounding as if it were not there);
    the frozen matrix's cotangent is zero (float0 for its integer leaves)."""
    x, w = residuals
    # Dequantized once `dy` is there, as the forward's once `x` is: read from parameters alone, XLA:CPU ran
    # every layer's at the backward's start, holding the whole model in float32 (Llama-3.1-8B's QLoRA
    # step, 512 tokens: 36 GiB of temporaries against 10).
    w = w.replace(scale=w.scale + jnp.zeros((), w.scale.dtype) * dy.reshape(-1)[0].astype(w.scale.dtype))
    x_spec, w_spec, out, _ = _letters(_stored(equation, w))
    dx = product(f"{out},{w_spec}->{x_spec}", dy.astype(x.dtype), dequantize_stored(w, x.dtype))
    return dx.astype(x.dtype), frozen_cotangent(w)


_quantized.defvjp(_quantized_fwd, _quantized_bwd)
