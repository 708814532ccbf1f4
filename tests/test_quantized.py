"""Quantized matrices: each format's values against a NumPy reference written from its definition
(NF4's code book derived again from the normal distribution; MXFP4 and FP8 decoded as their
checkpoints define them, and against transformers' own decoder; written back as shipped bit for bit),
and their products against the dequantized float product (int8's W8A8 against its formula in exact
integers)."""

import itertools
import math
from statistics import NormalDist

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxformer import products
from jaxformer.products import product
from jaxformer.quantized import (
    NF4,
    QArray,
    Quantization,
    dequantize,
    e2m1,
    format_of,
    from_fp8,
    from_mxfp4,
    quantize,
    stored,
    to_fp8,
    to_mxfp4,
)


def matrix(shape, seed=0):
    return np.array(jax.random.normal(jax.random.key(seed), shape), np.float32)


def groups_of(w, inputs, group):
    """Every (output channel, group) of `w` as index tuples: the runs of `group` consecutive
    inputs along the last input axis, one index of every other axis (slow, plain)."""
    axis = inputs[-1]
    others = [range(n) if i != axis else range(0, n, group) for i, n in enumerate(w.shape)]
    for start in itertools.product(*others):
        yield tuple(slice(s, s + group) if i == axis else s for i, s in enumerate(start))


def reference(w, how, inputs):
    """The dequantized matrix, from the module docstring's definitions, one group at a time."""
    out = np.empty_like(w, dtype=np.float64)
    if how.format == "int8":
        s = np.abs(w).max(axis=inputs, keepdims=True) / 127
        s[s == 0] = 1  # an all-zero channel: zeros, whatever the scale
        return np.round(w / s) * s
    for g in groups_of(w, inputs, how.group):
        v = w[g].astype(np.float64)
        if how.format == "nf4":
            s = np.abs(v).max() or 1
            out[g] = NF4[np.argmin(np.abs(v[..., None] / s - NF4), axis=-1)] * s
        elif how.affine:
            lo, hi = min(v.min(), 0), max(v.max(), 0)
            s = (hi - lo) / 15 or 1
            zero = np.round(-lo / s)
            q = np.clip(np.round(v / s) + zero, 0, 15)
            out[g] = (q - zero) * s
        else:
            s = np.abs(v).max() / 7 or 1
            out[g] = np.clip(np.round(v / s), -7, 7) * s
    return out


HOWS = [Quantization("int8"), Quantization("int4"), Quantization("int4", 32), Quantization("int4", 128, affine=True),
        Quantization("int4", 64, affine=True), Quantization("nf4"), Quantization("nf4", 32)]
SHAPES = [((256, 4, 32), (0,)), ((4, 64, 96), (0, 1)), ((3, 128, 40), (1,))]  # q's, o's, an expert stack's


def test_the_nf4_code_book_is_qloras_normal_quantiles():
    """QLoRA's construction: 8 quantiles of N(0, 1) from p = 0.9677 down to the median (exclusive)
    and 7 mirrored below, with 0 between, each side scaled to end at +-1."""
    ppf, offset = NormalDist().inv_cdf, 0.9677083
    above = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    below = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    codes = np.sort(np.array(above + [0.0] + below))
    np.testing.assert_allclose(NF4, codes / np.abs(codes).max(), atol=2e-7)


@pytest.mark.parametrize("how,shape,inputs", [(how, shape, inputs) for how in HOWS for shape, inputs in SHAPES
                                               if how.format == "int8" or shape[inputs[-1]] % how.group == 0],
                         ids=str)  # (a group that does not divide is refused: the next test)
def test_each_format_is_its_definition(how, shape, inputs):
    w = matrix(shape)
    w[(1,) * len(shape)] = 0  # a zero among the values, and a whole group (int8: channel) of zeros
    w[tuple(slice(None) if i in inputs else 0 for i in range(len(shape))) if how.format == "int8"
      else next(groups_of(w, inputs, how.group))] = 0
    q = quantize(jnp.asarray(w), how, inputs)
    lead, outputs = tuple(range(inputs[0])), tuple(range(inputs[-1] + 1, w.ndim))
    chex.assert_shape(q.qvalue, tuple(w.shape[i] for i in (*lead, *outputs, *inputs)))  # stored: inputs last
    assert q.shape == w.shape and format_of(q) == how.format
    np.testing.assert_allclose(np.asarray(dequantize(q), np.float64), reference(w, how, inputs), rtol=1e-6,
                               atol=1e-7)
    bits = {"int8": 8, "int4": 4, "nf4": 4}[how.format]
    assert jnp.dtype(q.qvalue.dtype).itemsize * 8 >= bits and q.scale.dtype == jnp.float32


def test_bad_quantizations_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="quantize must be one of"):
        Quantization("int3")
    with pytest.raises(ValueError, match="group_size must be one of"):
        Quantization("int4", 48)
    with pytest.raises(ValueError, match="affine applies to int4 alone"):
        Quantization("nf4", affine=True)
    refused = r"group_size: 64 does not divide the matrix's inputs \[96\] \(shape \(96, 8\)\); pick one of \(32,\)$"
    with pytest.raises(ValueError, match=refused):
        quantize(jnp.ones((96, 8)), Quantization("int4"), (0,))


def test_scales_take_the_dtype_asked_for():
    q = quantize(jnp.asarray(matrix((64, 8))), Quantization("int4", 32, affine=True), (0,), jnp.bfloat16)
    assert q.scale.dtype == jnp.bfloat16 and q.zero_point.dtype == jnp.uint4 and dequantize(q).dtype == jnp.bfloat16


def test_mxfp4_is_decoded_as_gpt_oss_ships_it():
    """Byte b of a block holds values 2b (low nibble) and 2b + 1 (high), each e2m1 (sign, two exponent
    bits with bias 1, one mantissa bit), times 2^(scale - 127); and `[out, in]` becomes `[in, out]`."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)  # [E, out, in / 32, 16]
    scales = rng.integers(118, 134, (3, 5, 2), dtype=np.uint8)

    def e2m1(n):
        sign, exponent, mantissa = (-1) ** (n >> 3), (n >> 1) & 3, n & 1
        return sign * (mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1))

    want = np.empty((3, 5, 64))
    for e, o, b, i in itertools.product(range(3), range(5), range(2), range(16)):
        byte, scale = int(blocks[e, o, b, i]), 2.0 ** (int(scales[e, o, b]) - 127)
        want[e, o, 32 * b + 2 * i] = e2m1(byte & 15) * scale
        want[e, o, 32 * b + 2 * i + 1] = e2m1(byte >> 4) * scale
    q = from_mxfp4(blocks, scales)
    assert q.qvalue.dtype == jnp.uint4 and q.qtype == "mxfp4" and format_of(q) == "mxfp4"  # (e2m1's codes)
    assert q.qvalue.shape == (3, 64, 5) and q.scale.shape == (3, 2, 5)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), want.transpose(0, 2, 1))
    with pytest.raises(ValueError, match="255"):
        from_mxfp4(blocks, np.full_like(scales, 255))


def test_e2m1_codes_decode_to_float4_e2m1s_values():
    """Each of the 16 codes `quantized.e2m1` builds from bits is the value ml_dtypes' float4_e2m1fn
    reads the same four bits as (its own definition, written independently)."""
    codes = np.arange(16, dtype=np.uint8)
    want = codes.astype(ml_dtypes.uint4).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    got = np.asarray(e2m1(jnp.asarray(codes.astype(ml_dtypes.uint4))))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # (code 8 is -0)
    assert sorted(set(np.abs(want).tolist())) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_mxfp4_is_decoded_as_transformers_decodes_it():
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # the peer's decoder

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 40, 4), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(np.asarray(dequantize(from_mxfp4(blocks, scales))), theirs.numpy())


@pytest.mark.parametrize("shape", [(256, 384), (320, 200)])  # whole 128 x 128 blocks; partial last ones
def test_block_fp8_is_decoded_as_deepseek_ships_it(shape):
    """Value [o, i] times weight_scale_inv[o // 128, i // 128]; kept `[out, in]`, and transposed as a
    torch Linear's weight is on load."""
    rng = np.random.default_rng(1)
    weight = rng.normal(0, 100, shape).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = rng.uniform(1e-4, 1e-2, (-(-shape[0] // 128), -(-shape[1] // 128))).astype(np.float32)
    want = np.empty(shape)
    for o, i in itertools.product(range(shape[0]), range(shape[1])):
        want[o, i] = float(weight[o, i]) * float(scale_inv[o // 128, i // 128])
    q = from_fp8(weight, scale_inv, (128, 128))
    assert q.qvalue.dtype == jnp.float8_e4m3fn and q.qvalue.shape == shape
    np.testing.assert_allclose(np.asarray(dequantize(q), np.float64), want, rtol=1e-7)
    np.testing.assert_allclose(np.asarray(dequantize(q.swapaxes(0, 1)), np.float64), want.T, rtol=1e-7)
    with pytest.raises(ValueError, match="weight_scale_inv must be"):
        from_fp8(weight, scale_inv[:1], (128, 128))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mxfp4_is_written_back_as_shipped(dtype):
    """`to_mxfp4(from_mxfp4(blocks, scales))` is the same bytes (every byte, e8m0's least and greatest
    scales, either scale dtype); scales that are not one power of two per 32 inputs are refused."""
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, (2, 6, 3, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, (2, 6, 3), dtype=np.uint8)
    scales[0, 0, :2] = 0, 254
    q = from_mxfp4(blocks, scales, dtype)
    again = to_mxfp4(q)
    assert [a.dtype for a in again] == [np.uint8, np.uint8]
    np.testing.assert_array_equal(again[0], blocks)
    np.testing.assert_array_equal(again[1], scales)
    with pytest.raises(ValueError, match="one scale per 32 inputs"):  # a scale per 16 inputs
        to_mxfp4(QArray(q.qvalue, jnp.repeat(q.scale, 2, axis=1).at[0, 0, 0].multiply(2), qtype="mxfp4"))
    with pytest.raises(ValueError, match="powers of two"):
        to_mxfp4(QArray(q.qvalue, q.scale.at[0, 0, 0].multiply(3), qtype="mxfp4"))


@pytest.mark.parametrize("shape", [(256, 384), (320, 200)])
def test_block_fp8_is_written_back_as_shipped(shape):
    """`to_fp8(from_fp8(weight, scale_inv))` is the same values and float32 scales, partial blocks too;
    a scale that differs within a block is refused."""
    rng = np.random.default_rng(3)
    weight = rng.normal(0, 100, shape).astype(ml_dtypes.float8_e4m3fn)
    scale_inv = rng.uniform(1e-4, 1e-2, (-(-shape[0] // 128), -(-shape[1] // 128))).astype(np.float32)
    q = from_fp8(weight, scale_inv, (128, 128))
    values, scales = to_fp8(q, (128, 128))
    assert values.dtype == ml_dtypes.float8_e4m3fn and scales.dtype == np.float32
    np.testing.assert_array_equal(values.view(np.uint8), weight.view(np.uint8))
    np.testing.assert_array_equal(scales, scale_inv)
    with pytest.raises(ValueError, match="one scale per 128 x 128 block"):
        to_fp8(QArray(q.qvalue, q.scale.at[1, 0].multiply(2)), (128, 128))


EQUATIONS = [("btd,dhk->bthk", (2, 3, 256), (256, 4, 32), (0,)), ("bthk,hkd->btd", (2, 3, 4, 64), (4, 64, 96), (0, 1)),
             ("bd,df->bf", (5, 128), (128, 40), (0,))]


@pytest.mark.parametrize("equation,x_shape,w_shape,inputs", EQUATIONS)
def test_int8_is_w8a8_the_rows_quantized_and_summed_in_exact_integers(equation, x_shape, w_shape, inputs):
    """y = (sum of q_x q_w in integers) s_x s_w, each row of x quantized with s_x = max|row| / 127;
    so within sum |x - x^| |W^| of the dequantized matrix's float product."""
    x, w = matrix(x_shape, 1), matrix(w_shape, 2)
    q = quantize(jnp.asarray(w), Quantization("int8"), inputs)
    x_spec = equation.split(",")[0]
    summed = tuple(i for i, a in enumerate(x_spec) if a in equation.split(",")[1].split("->")[0])
    s_x = np.abs(x).max(axis=summed, keepdims=True) / 127
    q_x = np.round(x / s_x)
    q_w, s_w = np.asarray(q.logical().qvalue, np.int64), np.asarray(q.logical().scale, np.float64)
    ints = np.einsum(equation, q_x.astype(np.int64), q_w)
    # the scales' grid, s_x of the row times s_w of the channel: both are constant over the summed
    # axes, so their product summed over them is that many times it
    grid = np.einsum(equation, np.broadcast_to(s_x, x.shape), np.broadcast_to(s_w, w.shape)) / np.prod(
        [x.shape[i] for i in summed])
    want = ints * grid
    got = np.asarray(product(equation, jnp.asarray(x), q), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    w_hat = np.asarray(dequantize(q), np.float64)
    error = np.einsum(equation, np.abs(x - q_x * s_x), np.abs(w_hat))
    assert np.all(np.abs(got - np.einsum(equation, x.astype(np.float64), w_hat)) <= error + 1e-5)


@pytest.mark.parametrize("path", ["cpu products", "xla", "xla by blocks"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("equation,x_shape,w_shape,inputs", EQUATIONS, ids=["q", "o", "2-d"])
def test_int4_is_w4a8_on_a_cpu_each_groups_integers_summed_and_scaled(equation, x_shape, w_shape, inputs, group,
                                                                       path, monkeypatch):
    """Symmetric int4 on a CPU: y = s_x sum_g s_g (sum over the group of q_x q), x's rows quantized as
    W8A8's; within float32's bound for a sum of K products, K u sum |q_x s_x||W^| (u = 2^-24), of
    that value computed exactly, by the CPU products (a few rows) and by XLA (more rows: the
    integers times the dequantized matrix, whole or by blocks); and so within sum |x - x^||W^| of
    the dequantized matrix's float product."""
    if path != "cpu products":
        monkeypatch.setattr(products, "KERNEL_ROWS", 0)
    if path == "xla by blocks":
        monkeypatch.setattr(products, "BLOCK_VALUES", 2**10)
    x, w = matrix(x_shape, 1), matrix(w_shape, 2)
    q = quantize(jnp.asarray(w), Quantization("int4", group), inputs)
    x_spec = equation.split(",")[0]
    summed = tuple(i for i, a in enumerate(x_spec) if a in equation.split(",")[1].split("->")[0])
    s_x = np.abs(x).max(axis=summed, keepdims=True) / 127
    q_x = np.round(x / s_x)
    w_hat = np.asarray(dequantize(q), np.float64)  # (q s: each an integer times its group's scale, exact)
    out_axes = equation.split("->")[1]
    scale = s_x.reshape(*s_x.shape[:len(s_x.shape) - len(summed)], *(1,) * (len(out_axes) - len(x_spec) + len(summed)))
    want = np.einsum(equation, q_x, w_hat) * scale  # (float64: exact to 2^-53 here)
    got = np.asarray(product(equation, jnp.asarray(x), q), np.float64)
    k = math.prod(x.shape[i] for i in summed)
    assert np.all(np.abs(got - want) <= k * 2.0**-24 * np.einsum(equation, np.abs(q_x), np.abs(w_hat)) * scale)
    error = np.einsum(equation, np.abs(x - q_x * s_x), np.abs(w_hat))
    assert np.all(np.abs(got - np.einsum(equation, x.astype(np.float64), w_hat)) <= error + 1e-5)


@pytest.mark.parametrize("blocks", [False, True], ids=["one block", "blocks"])
@pytest.mark.parametrize("equation,x_shape,w_shape,inputs", EQUATIONS[:2], ids=["q", "o"])
@pytest.mark.parametrize("how", [Quantization("int4", 32, affine=True), Quantization("nf4")], ids=str)
def test_other_formats_multiply_the_dequantized_matrix(how, equation, x_shape, w_shape, inputs, blocks, monkeypatch):
    """On a CPU by blocks of output rows, each dequantized as it is multiplied (with a small
    `BLOCK_VALUES`, many blocks): the dequantized matrix's product, within float32's error bound for
    a sum of K products, K u sum |x||W^| (u = 2^-24), of its exact value; and bfloat16's rounded
    once more (2^-8 of it). (Not to the bit the whole dequantized matrix's product: a block's
    product is a 2-D one, whose sums XLA may order otherwise than the equation's.)"""
    if blocks:
        monkeypatch.setattr(products, "BLOCK_VALUES", 2**10)  # (24 or 32 blocks of 3 or 4 rows)
    x, w = jnp.asarray(matrix(x_shape, 1)), jnp.asarray(matrix(w_shape, 2))
    q = quantize(w, how, inputs)
    k = math.prod(w_shape[i] for i in inputs)
    for dtype, rounding in ((jnp.float32, 0), (jnp.bfloat16, 2**-8)):  # bf16: the dequantized bf16 matrix's
        xd, qd = x.astype(dtype), q.astype(dtype)
        x64, w64 = np.asarray(xd, np.float64), np.asarray(dequantize(qd), np.float64)
        exact = np.einsum(equation, x64, w64)
        got = np.asarray(product(equation, xd, qd), np.float64)
        assert np.all(np.abs(got - exact) <= k * 2**-24 * np.einsum(equation, np.abs(x64), np.abs(w64))
                      + rounding * np.abs(exact))


@pytest.mark.parametrize("blocks", [False, True], ids=["one block", "blocks"])
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_shipped_formats_multiply_the_dequantized_matrix(fmt, blocks, monkeypatch):
    """MXFP4 and FP8 as the other dequantized formats, by blocks on a CPU (FP8's values' bits sliced
    as uint8 and taken back in the block): within float32's bound for a sum of K products of the
    dequantized matrix's exact product, and bfloat16's rounding of it."""
    if blocks:
        monkeypatch.setattr(products, "BLOCK_VALUES", 2**10)  # (32 or 24 blocks)
    rng = np.random.default_rng(5)
    k, n = 256, 96
    if fmt == "mxfp4":  # every code of e2m1, scales 2^-9 .. 2^2
        q = from_mxfp4(rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8),
                       rng.integers(118, 130, (n, k // 32), dtype=np.uint8))
    else:  # e4m3 values of a wide range, two 128-input blocks' scales
        q = from_fp8(rng.normal(0, 100, (n, k)).astype(ml_dtypes.float8_e4m3fn),
                     rng.uniform(1e-4, 1e-2, (1, 2)).astype(np.float32), (128, 128)).swapaxes(0, 1)
    q = stored(q, (0,))  # [n, k]: inputs last, as a loaded model holds it
    x = jnp.asarray(matrix((5, k), 1))
    for dtype, rounding in ((jnp.float32, 0), (jnp.bfloat16, 2**-8)):
        xd, qd = x.astype(dtype), q.astype(dtype)
        x64, w64 = np.asarray(xd, np.float64), np.asarray(dequantize(qd), np.float64)
        exact = x64 @ w64
        got = np.asarray(product("bd,df->bf", xd, qd), np.float64)
        assert np.all(np.abs(got - exact) <= k * 2**-24 * (np.abs(x64) @ np.abs(w64)) + rounding * np.abs(exact))


@pytest.mark.parametrize("how", [Quantization("int8"), Quantization("nf4")], ids=str)
def test_a_quantized_matrix_is_frozen_and_x_gets_the_dequantized_gradient(how):
    x, w = jnp.asarray(matrix((2, 3, 128), 1)), jnp.asarray(matrix((128, 40), 2))
    q = quantize(w, how, (0,))
    dy = jnp.asarray(matrix((2, 3, 40), 3))
    dx, dq = jax.grad(lambda x, q: jnp.sum(product("btd,df->btf", x, q) * dy), argnums=(0, 1), allow_int=True)(x, q)
    np.testing.assert_allclose(dx, jnp.einsum("btf,df->btd", dy, dequantize(q), precision="highest"), rtol=1e-5,
                               atol=1e-5)
    assert not np.any(np.asarray(dq.scale)) and dq.qvalue.dtype == jax.dtypes.float0


def test_one_int8_row_is_that_row_of_two():
    x, w = jnp.asarray(matrix((2, 1, 128), 1)), jnp.asarray(matrix((128, 40), 2))
    q = quantize(w, Quantization("int8"), (0,))
    np.testing.assert_array_equal(product("btd,df->btf", x[:1], q), product("btd,df->btf", x, q)[:1])


def test_a_quantized_matrix_is_a_qwix_qarray_stored_inputs_last_of_the_models_shape():
    w = jnp.asarray(matrix((3, 64, 4, 8)))  # an expert stack of [d, H, K] matrices
    q = quantize(w, Quantization("nf4", 32), (1,))
    assert isinstance(q, QArray) and q.shape == (3, 64, 4, 8) and q.qvalue.shape == (3, 4, 8, 64)
    assert q.stored_order("edhk") == "ehkd" and q.logical().qvalue.shape == (3, 64, 4, 8)
    np.testing.assert_array_equal(dequantize(q[1]), dequantize(q)[1])  # leading axes index as an array's
    with pytest.raises(IndexError, match="indexes its 1 leading axes alone"):
        q[..., 0]
    assert q.astype(jnp.bfloat16).scale.dtype == jnp.bfloat16 and type(q.astype(jnp.bfloat16)) is type(q)


@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_a_model_dequantizes_one_matrix_at_a_time(fmt):
    """A format multiplied dequantized (int4, NF4) dequantizes each matrix where its layer reads it: the
    forward's temporaries hold two float32 matrices at most, not the model (XLA would otherwise run every
    layer's dequantization first: 8 layers' 36 MiB)."""
    from jaxformer import Decoder, DecoderConfig
    from jaxformer.quantized import quantize_params
    from jaxformer.sharding import param_axes

    config = DecoderConfig(vocab_size=256, n_layer=8, n_head=8, n_kv_head=2, d_model=512, d_ff=1024, max_seq_len=16)
    model, tokens = Decoder(config), jnp.zeros((1, 4), jnp.int32)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
    params = quantize_params(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), param_axes(model),
                             Quantization(fmt))
    temp = jax.jit(lambda p, t: model.apply({"params": p}, t)[0]).lower(params, tokens).compile() \
        .memory_analysis().temp_size_in_bytes
    largest = 4 * 512 * 1024  # w_gate's float32 bytes
    assert temp <= 2 * largest + (1 << 20), temp


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
def test_a_quantized_embedding_looks_up_its_dequantized_rows(fmt):
    from jaxformer.embeddings import lookup

    table = jnp.asarray(matrix((40, 64)))  # [vocab, d_model]: a scale per row (and group of its d_model)
    q = quantize(table, Quantization(fmt, 32), (1,))
    ids = jnp.array([[0, 39, 5, -1, 40, 5]])
    rows = np.asarray(lookup(q, ids))
    chex.assert_shape(rows, (1, 6, 64))
    np.testing.assert_array_equal(rows[0, [0, 1, 2, 5]], np.asarray(dequantize(q))[[0, 39, 5, 5]])
    assert np.isnan(rows[0, [3, 4]]).all()  # ids outside the vocabulary: NaN rows, as a float table's


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("how", [Quantization("int8", head=True), Quantization("int4", 32, affine=True, head=True),
                                 Quantization("nf4", 32, head=True)], ids=lambda how: how.format)
def test_a_quantized_head_looks_up_and_scores_with_its_dequantized_matrix(how, tied):
    """With `head`, the embedding and the untied head are quantized too (a tied one once), a scale
    per vocabulary row over d_model. The stream is the one of the model whose embedding and head are
    their dequantized matrices, to the bit (rows looked up, then dequantized); the logits are that
    stream's product with the dequantized head within the product's bound: float32's for a sum of
    d_model products, and for int8 the stream's rounding to int8 per row, sum |x - x^||W^| (W8A8)."""
    import dataclasses

    from conftest import SMALL, random_params

    from jaxformer import Decoder
    from jaxformer.quantized import quantize_params
    from jaxformer.sharding import param_axes

    config = dataclasses.replace(SMALL, tie_embeddings=tied)
    model = Decoder(config)
    params = random_params(config, seed=3)
    q = quantize_params(params, param_axes(model), how)
    heads = ["embed"] if tied else ["embed", "lm_head"]
    assert all(isinstance(q[name], QArray) and q[name].shape == params[name].shape for name in heads)
    assert not isinstance(quantize_params(params, param_axes(model), dataclasses.replace(how, head=False))["embed"],
                          QArray)  # only when asked
    tokens = jnp.arange(12)[None] % config.vocab_size
    x = model.apply({"params": q}, tokens, hidden=True)[0]  # [1, T, d_model]
    floats = dict(q, **{name: dequantize(q[name]) for name in heads})
    np.testing.assert_array_equal(x, model.apply({"params": floats}, tokens, hidden=True)[0])
    x = np.asarray(x, np.float64)[0]  # [T, d]
    w = np.asarray(floats["embed"].T if tied else floats["lm_head"], np.float64)  # [d, V]
    logits = np.asarray(model.apply({"params": q}, tokens)[0], np.float64)[0]
    bound = config.d_model * 2**-24 * np.abs(x) @ np.abs(w)
    if how.format == "int8":  # the stream's rows rounded to int8 (`test_int8_is_w8a8_...`'s bound)
        s_x = np.abs(x).max(-1, keepdims=True) / 127
        bound += np.abs(x - np.round(x / s_x) * s_x) @ np.abs(w)
    assert np.all(np.abs(logits - x @ w) <= bound)


@pytest.mark.parametrize("remat", [False, True], ids=["", "remat"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
def test_a_qlora_step_dequantizes_one_matrix_at_a_time_in_its_backward_too(fmt, remat, monkeypatch):
    """The adapters' gradient over a quantized base (QLoRA's step), each matrix in many blocks as at a
    real size (`BLOCK_VALUES` small): the backward dequantizes each matrix once its layer's gradient
    is there, so the temporaries hold no layer's float32 matrices beyond those at work (read from the
    parameters alone, every layer's ran at the backward's start: 8 layers' 68 MiB). The bound also
    admits each matrix's values unpacked to a byte apiece (XLA:CPU converts a 4-bit array before the
    forward's loop over its blocks slices it)."""
    from jaxformer import Decoder, DecoderConfig, LoraConfig
    from jaxformer.lora import init_lora
    from jaxformer.quantized import quantize_params
    from jaxformer.sharding import param_axes

    monkeypatch.setattr(products, "BLOCK_VALUES", 2**16)  # (8 to 32 blocks a matrix)
    lora = LoraConfig(rank=8, alpha=16.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"))
    config = DecoderConfig(vocab_size=256, n_layer=8, n_head=8, n_kv_head=2, d_model=512, d_ff=1024, max_seq_len=16,
                           remat=remat)
    tokens = jnp.zeros((1, 4), jnp.int32)
    shapes = jax.eval_shape(lambda: Decoder(config).init(jax.random.key(0), tokens)["params"])
    base = quantize_params(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), param_axes(Decoder(config)),
                           Quantization(fmt))
    model = Decoder(config.replace(lora=lora))

    def loss(adapters, base):  # the base an argument, as jaxformer-finetune's step takes it
        return model.apply({"params": base, "lora": adapters}, tokens)[0].sum()

    temp = jax.jit(jax.grad(loss)).lower(init_lora(base, lora, jax.random.key(0)), base).compile() \
        .memory_analysis().temp_size_in_bytes
    values = config.n_layer * (2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1024)  # every matrix's
    largest = 4 * 512 * 1024  # w_gate's float32 bytes
    assert temp <= 2 * largest + values + (1 << 20), (temp, values)
