"""The CPU products (`jaxformer.kernels.cpu`, custom calls to `cpu_products.cc`) against exact
references: int8's and int4's integer sums exactly, the float ones within float32's bound for a
sum of K products in any order (K u sum |x||w|, u = 2^-24), over the shapes their loops split
(rows one at a time and four at a time, a panel's tail of columns, K not a multiple of a vector);
`product` sending them a few rows and XLA more; and greedy decoding of a trained model, in each
weight format, giving the tokens of XLA's products."""

import functools
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import memorised_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import CORPUS

from jaxformer import Decoder, DecoderConfig, generate, products
from jaxformer.kernels import cpu
from jaxformer.quantized import Quantization, quantize, quantize_params
from jaxformer.sharding import param_axes
from jaxformer.text import train_bpe

needs_products = pytest.mark.skipif(not cpu.enabled(), reason="no CPU products: not built, or no AVX-512 here")


def test_without_the_products_xla_runs_said_once_in_one_line(monkeypatch, caplog):
    """Not built (or not runnable here): `enabled()` is False, so every product is XLA's, and the
    reason is logged once, in one line, however often it is asked."""
    monkeypatch.setattr(cpu, "_cpu_products", None)
    monkeypatch.setattr(cpu, "_registered", functools.cache(cpu._registered.__wrapped__))
    with caplog.at_level(logging.WARNING, logger=cpu.__name__):
        assert not cpu.enabled() and not cpu.enabled()
    assert [r.getMessage() for r in caplog.records] == [
        "jaxformer: the CPU products were not built (no C++ compiler at install); XLA's run instead"]
    w = jnp.ones((64, 32))
    assert "jaxformer_" not in jax.jit(lambda x: products.product("rd,df->rf", x, w)).lower(jnp.ones((1, 64))).as_text()

ROWS = [1, 3, 4, 5, 8, 13, 30]  # (streamed: two and four at a time, and what is left; in blocks of 12 and 6 past 8)


def within_float32_sums(got, x, w):
    """`got` is x . w (float64, exactly) to within K u |x| . |w|."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    bound = x64.shape[1] * 2.0**-24 * (np.abs(x64) @ np.abs(w64))
    error = np.abs(np.asarray(got, np.float64) - x64 @ w64)
    assert np.all(error <= bound), (error - bound).max()


@needs_products
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k,n", [(320, 272), (37, 2064), (1024, 16)])  # (a panel's tail; K odd, two panels; one)
def test_kn_product_is_the_float_product_summed_in_float32(k, n, rows, dtype):
    rng = np.random.default_rng(rows)
    x, w = jnp.asarray(rng.normal(size=(rows, k)), dtype), jnp.asarray(rng.normal(size=(k, n)), dtype)
    got = jax.jit(cpu.kn_product)(x, w)
    assert got.dtype == jnp.float32 and got.shape == (rows, n)
    within_float32_sums(got, x, w)


@needs_products
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k,n", [(320, 68), (2048, 4)])
def test_nk_product_is_the_float_product_summed_in_float32(k, n, rows, dtype):
    rng = np.random.default_rng(rows)
    x, w = jnp.asarray(rng.normal(size=(rows, k)), dtype), jnp.asarray(rng.normal(size=(n, k)), dtype)
    got = jax.jit(cpu.nk_product)(x, w)
    assert got.dtype == jnp.float32 and got.shape == (rows, n)
    within_float32_sums(got, x, w.T)


@needs_products
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k,n", [(320, 68), (333, 8), (8192, 4)])  # (K a multiple of 64, or not)
def test_int8_product_is_the_integer_product_exactly(k, n, rows):
    """Every value of int8 (-128 too) and the extremes everywhere: sum (w + 128) x - 128 sum x is exact."""
    rng = np.random.default_rng(rows)
    x, w = rng.integers(-128, 128, (rows, k), dtype=np.int8), rng.integers(-128, 128, (n, k), dtype=np.int8)
    x[0, :] = -128
    w[-1, :] = 127
    got = jax.jit(cpu.int8_product)(x, w)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, x.astype(np.int64) @ w.T.astype(np.int64))


@needs_products
@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.bfloat16], ids=["float32 scales", "bfloat16 scales"])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k,group", [(384, 32), (384, 64), (384, 128), (320, 32), (320, 64)])  # (128 values a
def test_int4_product_is_each_groups_integer_sum_scaled(k, group, rows, scale_dtype):  # step; half a step left)
    """Every int4 value (-8 to 7) against int8 x: each group's sum exact, the groups' scaled sums within
    float32's bound, K u sum_g |s_g| sum |x q|."""
    n = 20
    rng = np.random.default_rng(rows)
    x, q = rng.integers(-127, 128, (rows, k), dtype=np.int8), rng.integers(-8, 8, (n, k), dtype=np.int8)
    s = np.asarray(jnp.asarray(rng.normal(size=(n, k // group)), scale_dtype), np.float64)
    got = jax.jit(cpu.int4_product)(jnp.asarray(x), jnp.asarray(q, jnp.int4), jnp.asarray(s, scale_dtype))
    sums = np.einsum("rgk,ngk->rng", x.reshape(rows, -1, group).astype(np.int64), q.reshape(n, -1, group))
    magnitude = np.einsum("rgk,ngk->rng", np.abs(x.reshape(rows, -1, group)).astype(np.int64),
                          np.abs(q.reshape(n, -1, group)))
    want = np.einsum("rng,ng->rn", sums.astype(np.float64), s)
    bound = k * 2.0**-24 * np.einsum("rng,ng->rn", magnitude.astype(np.float64), np.abs(s))
    assert got.dtype == jnp.float32 and np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


@needs_products
def test_inside_disabled_a_program_keeps_xlas_products():
    w = jnp.ones((64, 32))
    lowered = lambda: jax.jit(lambda x: products.product("rd,df->rf", x, w)).lower(jnp.ones((1, 64))).as_text()  # noqa: E731
    with cpu.disabled():
        assert not cpu.enabled() and "jaxformer_" not in lowered()
    assert cpu.enabled() and "jaxformer_kn_product" in lowered()


@needs_products
def test_the_handlers_refuse_what_they_do_not_take():
    """jaxformer/products.py sends only shapes that `fits`; a handler given others says so."""
    x = jnp.zeros((2, 100), jnp.int8)
    assert not cpu.fits("int4_product", 100, 8, 100 // 32)
    with pytest.raises(Exception, match="jaxformer cpu product: int4_product takes"):
        jax.jit(cpu.int4_product)(x, jnp.zeros((8, 100), jnp.int4), jnp.ones((8, 3), jnp.float32))
    with pytest.raises(Exception, match="jaxformer cpu product: x and w must be float32 or bfloat16"):
        jax.jit(cpu.kn_product)(jnp.zeros((2, 16), jnp.float16), jnp.zeros((16, 16), jnp.float16))


@needs_products
@pytest.mark.parametrize("weights,target", [("float32", "kn_product"), ("bfloat16", "kn_product"),
                                            ("tied float32", "nk_product"), ("int8", "int8_product"),
                                            ("int4", "int4_product")])
def test_a_product_of_a_few_rows_calls_the_cpu_products_and_of_more_xlas(weights, target):
    w = jnp.asarray(np.random.default_rng(0).normal(size=(128, 32)), jnp.bfloat16 if weights == "bfloat16" else None)
    equation = "rd,df->rf"
    if weights == "tied float32":  # an embedding [vocab, d] as the output head
        equation, w = "rd,fd->rf", w.T
    elif weights in ("int8", "int4"):
        w = quantize(w, Quantization(weights, group=32), (0,))
    for rows, called in ((products.KERNEL_ROWS, True), (products.KERNEL_ROWS + 1, False)):
        x = jnp.ones((rows, 128), jnp.bfloat16 if weights == "bfloat16" else jnp.float32)
        text = jax.jit(lambda x, w: products.product(equation, x, w)).lower(x, w).as_text()
        assert (f"jaxformer_{target}" in text) == called, rows


BPE = train_bpe([CORPUS], 280)
CONFIG = DecoderConfig(vocab_size=BPE.vocab_size, n_layer=1, n_head=4, n_kv_head=2, d_model=64, max_seq_len=48)


@pytest.fixture(scope="module")
def trained():
    return memorised_params(CONFIG, BPE.encode(CORPUS, add_special_tokens=False), batch=8)


@needs_products
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4"])
def test_greedy_tokens_of_a_trained_model_are_xlas_in_each_format(trained, weights, monkeypatch):
    """Batch 1 and 3 (the CPU products) against the same decoding with XLA's products alone
    (`KERNEL_ROWS` 0): the same tokens, in every weight format (int8 and int4, group 32, with the
    head quantized too; int4 is W4A8 on both paths)."""
    model = Decoder(CONFIG)
    params = trained
    if weights == "bfloat16":
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    elif weights != "float32":
        params = quantize_params(params, param_axes(model), Quantization(weights, group=32, head=True))
    ids = BPE.encode(CORPUS, add_special_tokens=False)
    prompts = jnp.asarray([ids[i:i + 8] for i in (0, 40, 97)], jnp.int32)
    for batch in (prompts[:1], prompts):
        fast = generate(model, params, batch, max_new_tokens=24)
        with monkeypatch.context() as patched:
            patched.setattr(products, "KERNEL_ROWS", 0)
            jax.clear_caches()
            reference = generate(model, params, batch, max_new_tokens=24)
        jax.clear_caches()
        np.testing.assert_array_equal(fast, reference)
        recited = BPE.decode(np.asarray(fast[0]).tolist())
        assert recited in CORPUS, recited  # (it learned the text: the tokens are not a tie's toss)
