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
    if min(jnp.finfo(x.dtype).bits, jnp.finfo(w.dtype).bits) >= 32:
        # float32 (or float64) throughout: autodiff's gradient, at the library's float32 precision
        return jnp.einsum(equation, x, w, precision=precision_for(x.dtype))
    return _narrow(equation, wide, x, w)


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


def _w8a8(equation: str, x: jax.Array, w: QArray) -> jax.Array:
    """`einsum(equation, x, W)` for an int8 `w` (a scale per output channel), float32: `x`'s rows
    quantized to int8 each with its own scale, the integer product summed in int32, then scaled."""
    x_spec, w_spec, out, summed = _letters(equation)
    x_axes = tuple(x_spec.index(a) for a in summed)
    x = x.astype(jnp.float32)
    s_x = jnp.max(jnp.abs(x), axis=x_axes, keepdims=True) / 127
    s_x = jnp.where(s_x > 0, s_x, 1)  # an all-zero row: any scale gives zeros
    q_x = jnp.round(x / s_x).astype(jnp.int8)  # in [-127, 127]
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
    # Dequantized once `x` is there. A dequantization reads parameters alone, and XLA:CPU schedules
    # every layer's first, holding the whole model in float at once (it drops an optimization barrier);
    # a zero times one of x's numbers (which it does not fold: x may not be finite) makes each wait for
    # its layer.
    w = w.replace(scale=w.scale + jnp.zeros((), w.scale.dtype) * x.reshape(-1)[0].astype(w.scale.dtype))
    x_rest, w_rest = (''.join(a for a in spec if a not in summed) for spec in (x_spec, w_spec))
    if not (x_spec.endswith(summed) and w_spec.endswith(summed) and out == x_rest + w_rest):
        return _dequantized(equation, wide, x, w)  # (a product over the matrix's outputs, or its experts')
    return jax.lax.platform_dependent(x, w, cpu=functools.partial(_by_blocks, wide, len(summed)),
                                      default=functools.partial(_dequantized, equation, wide))


def _dequantized(equation: str, wide: bool, x: jax.Array, w: QArray) -> jax.Array:
    """`equation` with `w` dequantized whole."""
    return product(equation, x, dequantize_stored(w, x.dtype), wide)


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
