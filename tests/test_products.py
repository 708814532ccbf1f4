"""`product`: float32 unchanged, bfloat16 accumulated in float32 and rounded once (values and
gradients against float64), one row as many, and on a CPU no float32 copy of a bf16 matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import init_params

from jaxformer import Decoder, DecoderConfig, products
from jaxformer.decoding.front_door import run
from jaxformer.decoding.request import DecodeRequest
from jaxformer.products import product

EQUATIONS = [("btd,df->btf", (3, 5, 64), (64, 48)), ("bthk,hkd->btd", (2, 3, 4, 16), (4, 16, 40)),
             ("td,vd->tv", (6, 64), (96, 64))]


def operands(x_shape, w_shape, dtype, seed=0):
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    return jax.random.normal(kx, x_shape).astype(dtype), jax.random.normal(kw, w_shape).astype(dtype), ky


def within_one_rounding(got, x, w, equation):
    """`got` is the exact product of `x` and `w` (float64) rounded once to bfloat16: within
    bf16's unit roundoff (2^-8 of the value: 8 significant bits) plus float32 accumulation's
    error, bounded by the sum of the terms' magnitudes (|x| . |w|) times a few float32 units."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    exact = np.einsum(equation, x64, w64)
    magnitude = np.einsum(equation, np.abs(x64), np.abs(w64))
    error = np.abs(np.asarray(got, np.float64) - exact)
    assert np.all(error <= 2.0**-8 * np.abs(exact) + 2.0**-20 * magnitude), error.max()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("equation,x_shape,w_shape", EQUATIONS)
def test_float32_and_float64_are_einsum_with_autodiffs_gradient(equation, x_shape, w_shape, dtype):
    """Values: einsum's, but for a float32 product of a few rows on a CPU, which the CPU products
    compute (`jaxformer.kernels.cpu`) in an order of their own: within float32's bound for a sum
    of K products, K u sum |x||w| (u = 2^-24), of the exact value. Gradients: einsum's."""
    with jax.enable_x64(dtype == "float64"):
        x, w, ky = operands(x_shape, w_shape, dtype)
        dy = jax.random.normal(ky, jnp.einsum(equation, x, w).shape, dtype)
        got, pull = jax.vjp(lambda x, w: product(equation, x, w), x, w)
        want, pull_want = jax.vjp(lambda x, w: jnp.einsum(equation, x, w, precision="highest"), x, w)
        assert got.dtype == dtype
        if dtype == "float64" or not products.cpu.enabled():
            np.testing.assert_array_equal(got, want)
        else:
            x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
            k = x.size // np.prod(got.shape[:x.ndim - (x.ndim + w.ndim - got.ndim) // 2])
            bound = k * 2.0**-24 * np.einsum(equation, np.abs(x64), np.abs(w64))
            assert np.all(np.abs(np.asarray(got, np.float64) - np.einsum(equation, x64, w64)) <= bound)
        for g, w_ in zip(pull(dy), pull_want(dy)):
            np.testing.assert_array_equal(g, w_)


@pytest.mark.parametrize("equation,x_shape,w_shape", EQUATIONS)
def test_bfloat16_values_and_gradients_are_the_float64_products_rounded_once(equation, x_shape, w_shape):
    x, w, ky = operands(x_shape, w_shape, jnp.bfloat16)
    y, pull = jax.vjp(jax.jit(lambda x, w: product(equation, x, w)), x, w)
    dy = jax.random.normal(ky, y.shape).astype(jnp.bfloat16)
    dx, dw = pull(dy)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16 and dx.shape == x.shape and dw.shape == w.shape
    (x_spec, w_spec), y_spec = equation.split("->")[0].split(","), equation.split("->")[1]
    within_one_rounding(y, x, w, equation)
    within_one_rounding(dx, dy, w, f"{y_spec},{w_spec}->{x_spec}")  # dL/dx = dy . w
    within_one_rounding(dw, x, dy, f"{x_spec},{y_spec}->{w_spec}")  # dL/dw = x . dy


def test_float32_products_ask_for_the_highest_precision_bfloat16_ones_for_the_default():
    """The library's precision, not the backend's default (TF32 on an NVIDIA GPU, bf16 passes
    on a TPU): every float32 product of the forward and backward passes says HIGHEST. (More rows
    than the CPU products take: XLA's products throughout.)"""
    for dtype, want in (("float32", "HIGHEST"), ("bfloat16", "DEFAULT")):
        x, w, _ = operands((2, products.KERNEL_ROWS, 64), (64, 48), dtype)
        program = jax.make_jaxpr(jax.grad(lambda x, w: product("btd,df->btf", x, w).astype(jnp.float32).sum(),
                                          argnums=(0, 1)))(x, w)
        precisions = [str(eqn.params["precision"]) for eqn in _equations(program.jaxpr)
                      if eqn.primitive.name == "dot_general"]
        assert len(precisions) == 3 and all(want in p for p in precisions), (dtype, precisions)


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the programs its equations hold (a jit's, a custom gradient's)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(inner, jax.extend.core.ClosedJaxpr):
                    yield from _equations(inner.jaxpr)
                elif isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _equations(inner)


@pytest.mark.parametrize("equation,x_shape,w_shape", EQUATIONS)
def test_a_wide_bfloat16_product_is_its_float32_sums_unrounded(equation, x_shape, w_shape):
    """`wide=True` (the logits): float32, within float32 accumulation's error of the exact
    product, no bf16 rounding (2^-8 of the value) on top; its gradients stay bfloat16."""
    x, w, ky = operands(x_shape, w_shape, jnp.bfloat16)
    y, pull = jax.vjp(jax.jit(lambda x, w: product(equation, x, w, wide=True)), x, w)
    assert y.dtype == jnp.float32
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    error = np.abs(np.asarray(y, np.float64) - np.einsum(equation, x64, w64))
    assert np.all(error <= 2.0**-20 * np.einsum(equation, np.abs(x64), np.abs(w64))), error.max()
    dx, dw = pull(jax.random.normal(ky, y.shape))
    assert dx.dtype == dw.dtype == jnp.bfloat16


def test_one_row_is_the_product_of_that_row():
    """Decoding one sequence: a single row (computed beside a zero row) is the row alone's
    product, and its gradient is too."""
    x, w, _ = operands((1, 1, 64), (64, 48), jnp.bfloat16)
    y = product("btd,df->btf", x, w)
    assert y.shape == (1, 1, 48)
    within_one_rounding(y, x, w, "btd,df->btf")
    dx = jax.grad(lambda x: product("btd,df->btf", x, w).astype(jnp.float32).sum())(x)
    within_one_rounding(dx, jnp.ones((1, 1, 48), jnp.bfloat16), w, "btf,df->btd")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="how XLA:CPU computes a bfloat16 product")
@pytest.mark.parametrize("rows", [1, 4])
def test_a_bfloat16_product_needs_no_float32_copy_of_the_matrix(rows, optimized_programs):
    """The matrix is read as bf16: XLA's temporary memory is far below the float32 copy
    (2x the matrix) that `jnp.einsum` of bf16 operands, or a single row, makes on a CPU."""
    x, w, _ = operands((rows, 1, 1024), (1024, 2048), jnp.bfloat16)
    plain = jax.jit(lambda x, w: jnp.einsum("btd,df->btf", x, w)).lower(x, w).compile().memory_analysis()
    assert plain.temp_size_in_bytes >= 2 * w.nbytes  # what this test guards against is real here
    ours = jax.jit(lambda x, w: product("btd,df->btf", x, w)).lower(x, w).compile().memory_analysis()
    assert ours.temp_size_in_bytes < w.nbytes / 16, ours.temp_size_in_bytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="how XLA:CPU computes a bfloat16 product")
def test_a_bfloat16_decoding_run_holds_no_float32_copy_of_the_weights(optimized_programs):
    """`generate`'s whole program with bf16 weights, batch 1: XLA's temporary memory stays
    far below the weights (a float32 copy of them, or of the embedding table lifted out of
    the loop, would be 2x theirs)."""
    config = DecoderConfig(vocab_size=4096, n_layer=2, n_head=4, n_kv_head=2, d_model=256, max_seq_len=64,
                           dtype="bfloat16", param_dtype="bfloat16")
    model, params = Decoder(config), init_params(config)
    weights = sum(p.nbytes for p in jax.tree.leaves(params))
    request = DecodeRequest.create(model, np.ones((1, 8), np.int32), max_new_tokens=8)
    memory = run.lower(model, params, request).compile().memory_analysis()
    assert memory.temp_size_in_bytes < weights / 8, (memory.temp_size_in_bytes, weights)
