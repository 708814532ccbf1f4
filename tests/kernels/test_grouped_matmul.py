"""The grouped-matmul kernels (`jaxformer.kernels.grouped_matmul`), Triton's and Mosaic's, run in
Pallas's interpreter on the CPU: the product against `grouped.in_blocks` and a per-expert loop in
float64, its gradients against autodiff of the dense formula; which products a GPU and a TPU
pick (`grouped.device_products`); and the kernels lowered for CUDA and TPU (`jax.export`)."""

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import grouped
from jaxformer.kernels import CUDA_CUSTOM_CALL_TARGETS
from jaxformer.kernels.grouped_matmul import PLATFORMS, grouped_matmul, row_tile, supports

# bfloat16 keeps 8 significant bits: rounding a number x moves it by at most 2**-8 |x|.
BF16_ROUNDING = 2.0 ** -8
F32 = functools.partial(np.asarray, dtype=np.float32)

# Each case: experts E, d, F, tokens N, choices k, the layout's block (or a capacity: one block of
# that many rows per expert), the kernels' tiles (None: as `supports` chooses them), and the
# experts the routing may choose (the others get no row). The dropless layouts end in blocks past
# the last group (`_case` checks).
CASES = {
    # d and F no powers of two: Triton's tiles of 16 (3 x 5 of them), Mosaic's one whole block.
    "uneven": dict(E=5, d=48, F=80, N=20, k=2, block=16, chosen=(0, 1, 3)),
    # Several tiles of d and of F on both kernels (the accumulator across d tiles, dw's tiles), rows
    # in blocks of 32 (one tile each).
    "tiles": dict(E=4, d=32, F=48, N=24, k=2, block=32, tiles=(16, 16), chosen=(1, 2, 3)),
    # A capacity of 48 rows: every expert one block (an unchosen one's all zeros), of 3 row tiles
    # of 16; no block past the last group, pairs dropped instead (about 60 an expert).
    "capacity": dict(E=3, d=32, F=32, N=60, k=2, capacity=48, chosen=(0, 2)),
    # Wider, at the default tiles (Triton's 64: 4 x 6 of them; Mosaic's 256 and 128: 1 x 3), 16 experts
    # of which half chosen, blocks of 16 rows (the full tier: tests/conftest.py).
    "wide": dict(E=16, d=256, F=384, N=64, k=4, block=16, chosen=tuple(range(1, 16, 2))),
}


def _case(name, dtype=jnp.float32, seed=0):
    """`(x [N, d], w [E, d, F], ids [N, k], layout, rows)` of case `name`, `rows` the layout's
    `[rows, d]` (x's rows gathered, zeros in the padding)."""
    c = CASES[name]
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (c["N"], c["d"])).astype(dtype)
    w = jax.random.normal(keys[1], (c["E"], c["d"], c["F"])).astype(dtype)
    chosen = jnp.asarray(c["chosen"])
    ids = chosen[jax.random.randint(keys[2], (c["N"], c["k"]), 0, len(c["chosen"]))]
    capacity = c.get("capacity")
    layout = grouped.dispatch(ids, c["E"], capacity or c["block"], capacity)
    block_expert = np.asarray(layout.block_expert)
    if capacity is None:  # an expert with no row and no block; blocks past the last group
        assert not (set(range(c["E"])) - set(c["chosen"])) & set(block_expert) and (block_expert == c["E"]).any()
    else:
        assert layout.dropped > 0
    return x, w, ids, layout, grouped.gather_rows(x, layout, c["k"])


def _loop(rows, w, layout) -> np.ndarray:
    """float64 `[rows, F]`: each block's rows times its expert's matrix, expert by expert; zeros
    past the last group."""
    rows, w = np.asarray(rows, np.float64), np.asarray(w, np.float64)
    expert = np.asarray(grouped.row_experts(layout))
    out = np.zeros((rows.shape[0], w.shape[-1]))
    for e in range(w.shape[0]):
        out[expert == e] = rows[expert == e] @ w[e]
    return out


@functools.partial(jax.jit, static_argnames=("platform", "tiles", "interpret"))
def _kernel(rows, w, block_expert, dy, *, platform, tiles, interpret=True):
    """The kernel's output and `(dx, dw)` for the cotangent `dy`, in the interpreter (or compiled)."""
    y, vjp = jax.vjp(lambda rows, w: grouped_matmul(rows, w, block_expert, platform=platform, tiles=tiles,
                                                    interpret=interpret), rows, w)
    return y, vjp(dy)


@jax.jit
def _dense(rows, w, expert, dy):
    """The dense per-row formula `y[r] = x[r] @ w[e(r)]` (a zero matrix past the last group) and
    its autodiff's `(dx, dw)` for `dy`."""
    def product(rows, w):
        padded = jnp.concatenate([w, jnp.zeros_like(w[:1])])  # [E + 1, d, F]: "expert E" multiplies by 0
        return jnp.einsum("rd,rdf->rf", rows, padded[expert], preferred_element_type=jnp.float32)

    y, vjp = jax.vjp(product, rows, w)
    return y, vjp(dy)


def _check(name, platform, dtype, interpret=True):
    """The kernels of `platform` on case `name` in `dtype` (interpreted, or compiled for this
    machine's GPU or TPU): y against `in_blocks` and the float64
    loop, dx and dw against autodiff of the dense formula (float32, on the same numbers); a block
    past the last group gives zeros and takes no gradient, an expert with no row a zero gradient.

    float32: the sums' rounding alone (the reference at HIGHEST precision, tests/conftest.py),
    1e-5 of the largest entry. bfloat16: products of bfloat16 numbers are exact in float32, the
    kernels sum in float32 and round the result once, at most `BF16_ROUNDING` of it (and
    `in_blocks` rounds once too: two roundings apart at most)."""
    x, w, ids, layout, rows = _case(name, dtype)
    c = CASES[name]
    dy = jax.random.normal(jax.random.key(7), (layout.rows, c["F"])).astype(dtype)
    y, (dx, dw) = _kernel(rows, w, layout.block_expert, dy, platform=platform, tiles=c.get("tiles"),
                          interpret=interpret)
    expert = grouped.row_experts(layout)
    want, (want_dx, want_dw) = _dense(F32(rows), F32(w), expert, F32(dy))
    want = np.asarray(want)
    assert y.dtype == dx.dtype == dw.dtype == dtype and y.shape == want.shape and dw.shape == w.shape

    rounding = 1e-5 if dtype == jnp.float32 else BF16_ROUNDING + 1e-5
    largest = np.abs(want).max()
    np.testing.assert_allclose(F32(y), _loop(rows, w, layout), atol=rounding * largest, rtol=0)
    np.testing.assert_allclose(F32(y), F32(grouped.in_blocks(rows, w, layout)), atol=2 * rounding * largest, rtol=0)
    past = np.asarray(expert) == c["E"]
    np.testing.assert_array_equal(F32(y)[past], 0)
    np.testing.assert_array_equal(F32(dx)[past], 0)
    np.testing.assert_array_equal(F32(dw)[list(set(range(c["E"])) - set(c["chosen"]))], 0)
    for got, expected, what in ((dx, want_dx, "dx"), (dw, want_dw, "dw")):
        np.testing.assert_allclose(F32(got), expected, atol=rounding * np.abs(expected).max(), rtol=0, err_msg=what)


# The interpreter is slow (each case compiles a few programs, each of a grid's steps a loop
# iteration): the "wide" case is tests/conftest.py's FULL_TIER, the others the fast tier's.
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("platform", PLATFORMS)
def test_float32_equals_in_blocks_a_loop_and_the_dense_gradients(platform, name):
    _check(name, platform, jnp.float32)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("platform", PLATFORMS)
def test_bfloat16_within_one_rounding(platform, name):
    _check(name, platform, jnp.bfloat16)


# The kernels a backend compiles (`jax.default_backend()`).
COMPILED = {"gpu": "triton", "tpu": "mosaic"}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", [name for name in CASES if "tiles" not in CASES[name]])
def test_compiled_on_a_gpu_or_a_tpu(name, dtype):
    """The same checks with the kernels compiled for this machine's GPU (Triton) or TPU (Mosaic),
    not interpreted, at the tiles `supports` chooses (smaller ones break a TPU's layout rules);
    skipped on a CPU, which compiles neither (benchmarks/accelerator_check.sh runs this file)."""
    platform = COMPILED.get(jax.default_backend())
    if platform is None:
        pytest.skip(f"the kernels compile for a GPU or a TPU, not for {jax.default_backend()} (interpreted above)")
    _check(name, platform, dtype, interpret=False)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_products_of_pairs_and_their_gradients_through_the_layout(platform):
    """`grouped_product(how=platform)`, the layout's way there and back (gather, kernel, scatter),
    against the per-pair formula `x[n] @ w[ids[n, c]]` and its autodiff: x's and w's gradients
    (an expert chosen by no pair: a zero gradient)."""
    x, w, ids, _, _ = _case("uneven")
    cotangent = jax.random.normal(jax.random.key(3), (*ids.shape, w.shape[-1]))

    def loss(f, x, w):
        return jnp.sum(f(x, w) * cotangent)

    kernel = functools.partial(grouped.grouped_product, ids=ids, block=16, how=platform, interpret=True)
    got = jax.jit(jax.value_and_grad(functools.partial(loss, kernel), argnums=(0, 1)))(x, w)
    dense = jax.value_and_grad(functools.partial(loss, lambda x, w: jnp.einsum("nd,nkdf->nkf", x, w[ids])),
                               argnums=(0, 1))(x, w)
    for g, ref in zip(jax.tree.leaves(got), jax.tree.leaves(dense)):
        np.testing.assert_allclose(g, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)
    assert not np.any(np.asarray(got[1][1])[[2, 4]])  # experts 2 and 4: no pair


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_table_of_no_group_gives_zeros(platform):
    """Every block past the last group (nothing routed): y, dx and dw all zeros, whatever the rows
    hold (a kernel reads no row of such a block into a sum)."""
    x, w = jax.random.normal(jax.random.key(0), (32, 16)), jax.random.normal(jax.random.key(1), (3, 16, 16))
    y, (dx, dw) = _kernel(x, w, jnp.full(2, 3, jnp.int32), x, platform=platform, tiles=None)
    assert not np.any(y) and not np.any(dx) and not np.any(dw)


def test_supports_row_tiles_and_refusals():
    assert supports(48, 80, jnp.float32, "triton") and supports(2880, 2880, jnp.bfloat16, "triton")
    assert not supports(40, 64, jnp.float32, "triton") and not supports(64, 64, jnp.float16, "triton")
    assert supports(48, 80, jnp.bfloat16, "mosaic") and supports(2048, 1408, jnp.float32, "mosaic")
    assert not supports(2880, 2048, jnp.bfloat16, "mosaic")  # no multiple of 128, too wide for one block
    with pytest.raises(ValueError, match="platform"):
        supports(64, 64, jnp.float32, "cuda")
    assert [row_tile(block) for block in (1, 8, 16, 32, 48, 128, 256)] == [None, None, 16, 32, 16, 128, 128]
    x, w = jnp.zeros((32, 16)), jnp.zeros((2, 16, 16))
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(x, w, jnp.zeros(4, jnp.int32), platform="triton", interpret=True)  # blocks of 8 rows
    with pytest.raises(ValueError, match="does not take"):
        grouped_matmul(x, w.astype(jnp.bfloat16), jnp.zeros(2, jnp.int32), platform="mosaic", interpret=True)


def test_a_gpu_and_a_tpu_take_the_kernels_where_they_serve():
    """`device_products`: the kernels where they take the widths, at blocks of at least 16 rows
    (a decoding step's few pairs too); `ragged_dot` elsewhere and on other platforms; with a
    capacity, its blocks either way (the kernels where 16 rows divide it)."""
    paths = grouped.device_products(2048, 1024, jnp.bfloat16, pairs=512 * 8, n_experts=64, capacity=None)
    assert paths == {"cuda": dict(how="triton", block=64), "tpu": dict(how="mosaic", block=64),
                     "default": dict(how="ragged", block=1)}
    decoding = grouped.device_products(2048, 1024, jnp.float32, pairs=4 * 8, n_experts=64, capacity=None)
    assert (decoding["cuda"], decoding["tpu"]) == (dict(how="triton", block=16), dict(how="mosaic", block=16))
    gpt_oss = grouped.device_products(2880, 2880, jnp.bfloat16, pairs=4096 * 4, n_experts=32, capacity=None)
    assert gpt_oss["cuda"]["how"] == "triton" and gpt_oss["tpu"] == dict(how="ragged", block=1)
    assert grouped.device_products(2048, 1024, jnp.float16, 64, 8, None)["cuda"] == dict(how="ragged", block=1)
    assert grouped.device_products(256, 128, jnp.bfloat16, 64, 8, capacity=48)["tpu"] == dict(how="mosaic", block=48)
    assert grouped.device_products(256, 128, jnp.bfloat16, 64, 8, capacity=20)["tpu"] == dict(how="ragged", block=20)


KERNEL_CALLS = {"cuda": f"stablehlo.custom_call @{CUDA_CUSTOM_CALL_TARGETS[0]}",
                "tpu": "stablehlo.custom_call @tpu_custom_call"}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("target", ["cuda", "tpu"])
def test_lowers_for_cuda_and_tpu(target, dtype):
    """Compiled (not interpreted), the product and its gradient lower to the platform's kernels:
    the forward one, then dx and dw beside it, at OLMoE's widths (2048 by 1024, several tiles of
    each) and blocks of 32 rows."""
    platform = {"cuda": "triton", "tpu": "mosaic"}[target]
    E, d, F, blocks = 64, 2048, 1024, 80
    args = (jax.ShapeDtypeStruct((blocks * 32, d), dtype), jax.ShapeDtypeStruct((E, d, F), dtype),
            jax.ShapeDtypeStruct((blocks,), jnp.int32))

    def forward(x, w, block_expert):
        return grouped_matmul(x, w, block_expert, platform=platform)

    def loss(x, w, block_expert):
        return jnp.sum(forward(x, w, block_expert).astype(jnp.float32) ** 2)  # (y itself needed: its kernel kept)

    export = functools.partial(jax.export.export, platforms=[target], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(call) for call in CUDA_CUSTOM_CALL_TARGETS])
    for fn, kernels in ((forward, ["grouped_matmul"]),
                        (jax.grad(loss, argnums=(0, 1)), ["grouped_matmul", "grouped_matmul_dx", "grouped_matmul_dw"])):
        text = export(jax.jit(fn))(*args).mlir_module()
        assert text.count(KERNEL_CALLS[target]) == len(kernels)
        assert Counter(re.findall(r'name = "(grouped_matmul\w*)"', text)) == Counter(kernels)
