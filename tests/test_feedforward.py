"""The SwiGLU FFN's hand-written gradient against autodiff of the plain formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import DecoderConfig
from jaxformer.feedforward import GatedMLP, written_swiglu
from jaxformer.products import product


def plain_swiglu(x, w_gate, w_up, w_down):
    """`(silu(x W_gate) * (x W_up)) W_down`, differentiated by JAX itself, each product the library's
    (`product`: on a CPU the same products as the module's, whose order of sums is their own)."""
    h = jax.nn.silu(product("btd,df->btf", x, w_gate)) * product("btd,df->btf", x, w_up)
    return product("btf,fd->btd", h, w_down)


def inputs(dtype=jnp.float32, d_model=16, ffn_dim=40):
    k = jax.random.split(jax.random.key(0), 5)
    # Gate pre-activations of a few units either side of 0: silu's curve, not its tails.
    x = jax.random.normal(k[0], (3, 7, d_model), dtype)
    w_gate = jax.random.normal(k[1], (d_model, ffn_dim), dtype) * 0.5
    w_up = jax.random.normal(k[2], (d_model, ffn_dim), dtype) * 0.5
    w_down = jax.random.normal(k[3], (ffn_dim, d_model), dtype) * 0.5
    cotangent = jax.random.normal(k[4], (3, 7, d_model), dtype)  # dL/dy, not all ones
    return (x, w_gate, w_up, w_down), cotangent


def vjp_of(f, args, cotangent):
    y, pullback = jax.vjp(f, *args)
    return y, pullback(cotangent)


def test_forward_is_the_formula_exactly():
    args, _ = inputs()
    np.testing.assert_array_equal(written_swiglu(*args), plain_swiglu(*args))


def test_hand_written_gradient_matches_autodiff_in_float64():
    # In float64 the two differ by rounding alone (~1e-15), so a wrong term anywhere
    # (silu' without its z (1 - sigmoid) part, a missing transpose) is far outside.
    with jax.enable_x64(True):
        args, cotangent = inputs(jnp.float64)
        _, want = vjp_of(plain_swiglu, args, cotangent)
        _, got = vjp_of(written_swiglu, args, cotangent)
        for name, g, w in zip(("x", "w_gate", "w_up", "w_down"), got, want):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=name)


def test_gradient_of_a_loss_under_jit_in_float32():
    args, cotangent = inputs()

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * cotangent)

    want = jax.jit(jax.grad(loss(plain_swiglu), argnums=(0, 1, 2, 3)))(*args)
    got = jax.jit(jax.grad(loss(written_swiglu), argnums=(0, 1, 2, 3)))(*args)
    for name, g, w in zip(("x", "w_gate", "w_up", "w_down"), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_wrong_gradient_would_fail():
    # The float64 check's tolerance separates right from wrong: silu'(z) taken as
    # sigmoid(z) alone (a plausible slip) misses by far more than 1e-12.
    with jax.enable_x64(True):
        (x, w_gate, w_up, w_down), cotangent = inputs(jnp.float64)
        gate, up = x @ w_gate, x @ w_up
        dh = cotangent @ w_down.T
        slipped = jnp.einsum("btd,btf->df", x, dh * up * jax.nn.sigmoid(gate))
        _, (_, right, _, _) = vjp_of(written_swiglu, (x, w_gate, w_up, w_down), cotangent)
        assert not np.allclose(slipped, right, rtol=1e-12, atol=1e-12)
        assert np.abs(slipped - right).max() > 1e-3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_module_gradients_keep_parameter_dtypes(dtype):
    config = DecoderConfig(vocab_size=11, n_layer=2, n_head=2, n_kv_head=1, d_model=16, d_ff=40,
                           max_seq_len=8, dtype=dtype)
    module = GatedMLP(config)
    x = jax.random.normal(jax.random.key(1), (2, 5, 16)).astype(dtype)
    params = module.init(jax.random.key(0), x)["params"]
    assert {k: v.shape for k, v in params.items()} == {"w_gate": (16, 40), "w_up": (16, 40), "w_down": (40, 16)}
    grads = jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x).astype(jnp.float32)))(params)
    assert all(g.dtype == jnp.float32 and g.shape == params[k].shape for k, g in grads.items())
    # The same gradients as autodiff of the formula, with the parameters cast as the module casts them.
    want = jax.grad(lambda p: jnp.sum(plain_swiglu(x, p["w_gate"].astype(dtype), p["w_up"].astype(dtype),
                                                   p["w_down"].astype(dtype)).astype(jnp.float32)))(params)
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    for k in grads:
        np.testing.assert_allclose(np.asarray(grads[k], np.float32), np.asarray(want[k], np.float32),
                                   rtol=tol, atol=tol * float(jnp.abs(want[k]).max()), err_msg=k)
