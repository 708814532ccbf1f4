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
"""

import functools
import math

import jax
import jax.numpy as jnp


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
