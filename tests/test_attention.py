import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    SMALL,
    filled_layers,
    import_peer,
    jit_apply,
    numpy_attention,
    random_params,
    torch_peer,
    with_sinks,
)

from jaxformer import Decoder, KVCache, attention
from jaxformer.attention import (
    FULL_WINDOW,
    AttentionSpec,
    GQASelfAttention,
    Part,
    Visibility,
    attend,
    block_paths,
    decoding_paths,
    dot_product_attention,
)
from jaxformer.blockwise import blockwise_attention, visible
from jaxformer.kernels import mosaic_attention, triton_attention
from jaxformer.kernels.decode_attention import decode_attention


def _qkv(seed, batch=2, T=5, S=7, n_head=6, n_kv=2, head_dim=8):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (batch, T, n_head, head_dim)) * 2,
            jax.random.normal(kk, (batch, S, n_kv, head_dim)) * 2,
            jax.random.normal(kv, (batch, S, n_kv, head_dim)))


def test_grouped_einsum_equals_repeated_kv():
    q, k, v = _qkv(0)
    mask = jax.random.bernoulli(jax.random.key(1), 0.7, (2, 5, 7)).at[:, :, 0].set(True)
    out, weights = dot_product_attention(q, k, v, mask)
    chex.assert_shape(out, (2, 5, 6, 8))
    chex.assert_shape(weights, (2, 6, 5, 7))
    # The slow path, in float64 numpy: repeat each kv head n_rep times, contiguously, then plain MHA.
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    mask = np.asarray(mask)
    k_rep, v_rep = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)  # [batch, S, n_head, head_dim]
    scores = np.einsum("bthd,bshd->bhts", q, k_rep) / np.sqrt(8)
    scores = np.where(mask[:, None], scores, -np.inf)
    want_w = np.exp(scores - scores.max(-1, keepdims=True))
    want_w /= want_w.sum(-1, keepdims=True)  # softmax over the keys
    want = np.einsum("bhts,bshd->bthd", want_w, v_rep)
    weights = np.asarray(weights)
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_allclose(weights, want_w, atol=1e-6)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-6)
    assert np.where(mask[:, None], 0.0, weights).max() == 0.0  # blocked keys get exactly 0


def test_matches_per_head_numpy_formula():
    q, k, v = _qkv(2, n_head=4, n_kv=4)  # plain multi-head attention
    mask = np.tril(np.ones((5, 7), bool), k=2)
    out, _ = dot_product_attention(q, k, v, jnp.asarray(mask))
    qn, kn, vn = (np.asarray(a, np.float64) for a in (q, k, v))
    for b in range(2):
        for h in range(4):
            s = qn[b, :, h] @ kn[b, :, h].T / np.sqrt(8)
            s[~mask] = -np.inf
            w = np.exp(s - s.max(-1, keepdims=True))
            np.testing.assert_allclose(out[b, :, h], (w / w.sum(-1, keepdims=True)) @ vn[b, :, h], atol=1e-5)


def test_fully_masked_row_is_finite():
    q, k, v = _qkv(3)
    mask = jnp.ones((5, 7), bool).at[2].set(False)
    out, weights = dot_product_attention(q, k, v, mask)
    assert bool(jnp.isfinite(out).all()) and bool(jnp.isfinite(weights).all())


# bfloat16 keeps 8 significant bits: rounding a number x moves it by at most 2**-9 |x|.
BF16_ROUNDING = 2.0 ** -9
# gpt-oss's attention sinks of 4 query heads: distinct signs and sizes, so that a head given
# another's sink (a wrong grouping of the query heads) attends otherwise.
SINKS = jnp.array([1.5, -1.0, 0.3, 2.5])


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["no sinks", "sinks"])
@pytest.mark.parametrize("platform, dtype", [("cuda", jnp.bfloat16), ("tpu", jnp.float32)])
def test_each_platforms_paths_run_in_the_kernels_interpreter_equal_the_cpus(platform, dtype, sinks, monkeypatch):
    """What the model calls on a GPU or TPU (`block_paths`, `decoding_paths`: the kernels, their
    arguments laid out as the model passes them), run here in Pallas' interpreter, equals what it
    calls on a CPU: values and gradients (the sinks' too) in blocks, and a decoding step over rows
    of different lengths, full and sliding, soft-capped. In float32 exactly but for the order of sums; in
    bfloat16 (the GPU's kernel dtype) within a few roundings of each side: the output, a convex
    combination of the values, within 8 of the largest value (4 a side, as the kernel's own test
    allows), a gradient within 16 of the largest."""
    for module in (triton_attention, mosaic_attention):
        monkeypatch.setattr(module, "flash_attention", functools.partial(module.flash_attention, interpret=True))
    monkeypatch.setattr(attention, "decode_attention", functools.partial(decode_attention, interpret=True))
    q, k, v = (a.astype(dtype) for a in _qkv(5, batch=2, T=40, S=40, n_head=4, n_kv=2, head_dim=128))
    positions = jnp.tile(jnp.arange(40), (2, 1))
    exact = dtype == jnp.float32
    out_atol = 2e-5 if exact else 8 * BF16_ROUNDING * float(jnp.abs(v.astype(jnp.float32)).max())
    grad_atol = 2e-5 if exact else 16 * BF16_ROUNDING

    def close(got, want, atol):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol)

    for window in (FULL_WINDOW, 9):
        args = (positions, positions, jnp.int32(window))
        paths = block_paths(128, q.dtype, softcap=30.0)
        assert paths[platform] is not paths["default"]  # (a kernel takes heads of 128 in this dtype)
        kernel, vjp_kernel = jax.vjp(lambda q, k, v, s, f=paths[platform], a=args: f(q, k, v, *a, s), q, k, v, sinks)
        cpu, vjp_cpu = jax.vjp(lambda q, k, v, s, f=paths["default"], a=args: f(q, k, v, *a, s), q, k, v, sinks)
        close(kernel, cpu, out_atol)
        for got, want in zip(jax.tree.leaves(vjp_kernel(kernel)), jax.tree.leaves(vjp_cpu(kernel))):
            close(got, want, grad_atol * float(jnp.abs(want.astype(jnp.float32)).max()))
        one = q[:, :1].repeat(2, axis=0)  # 4 rows of one new token, at positions 0, 20, 39 and 7
        cache_k, cache_v = k.repeat(2, axis=0), v.repeat(2, axis=0)
        step = (one, cache_k, cache_v, jnp.array([0, 20, 39, 7]), jnp.int32(window), sinks)
        paths = decoding_paths(128, q.dtype, softcap=30.0)
        close(paths[platform](*step), paths["default"](*step), out_atol)


def test_a_gpu_attends_in_blocks_with_its_kernel_in_bfloat16_alone():
    """In float32 the Triton kernels were several times slower than the `jnp` blocks on a GPU
    (`attention.KERNEL_DTYPES`): there the model attends with the `jnp` blocks; a TPU's kernel
    takes both."""
    for dtype, cuda_kernel in ((jnp.float32, False), (jnp.bfloat16, True)):
        paths = block_paths(128, dtype)
        assert (paths["cuda"] is not paths["default"]) == cuda_kernel
        assert paths["tpu"] is not paths["default"]
    narrow = block_paths(100, jnp.bfloat16)  # (a head the kernel does not take)
    assert narrow["cuda"] is narrow["default"]


# --- attention sinks (gpt-oss) on every path, and the layer against transformers' -----------------------


def _attend(kind):
    """`attend` as a path: `(q, k, v, q_pos, k_pos, window, **scores) -> out`."""
    def run(q, k, v, q_pos, k_pos, window, **scores):
        return attend(q, k, v, Visibility(q_pos, k_pos, window), kind=kind, **scores)[0]
    return run


def _decoding(platform):
    """The decoding kernel on `platform`, in the interpreter, as a path of one query per row (at
    `q_pos[:, 0]`) over a cache whose slot s holds position s."""
    def run(q, k, v, q_pos, k_pos, window, **scores):
        return decode_attention(q[:, 0], k, v, q_pos[:, 0], window, block_k=16, platform=platform, interpret=True,
                                **scores)[:, None]
    return run


# Every path the model may attend by, `(q, k, v, q_pos [batch, T], k_pos [batch, S], window,
# **scores) -> out [batch, T, n_head, head_dim]`. The kernels run in Pallas' interpreter, with
# blocks of 16 (8 for the `jnp` blocks): T = S = 24 is two blocks, the second padded.
MANY_QUERIES = {
    "dense": _attend("dense"),
    "blocks": _attend("blocks"),
    "jnp blocks of 8": functools.partial(blockwise_attention, block_q=8, block_k=8),
    "triton flash": functools.partial(triton_attention.flash_attention, block_q=16, block_k=16, interpret=True),
    "mosaic flash": functools.partial(mosaic_attention.flash_attention, block_q=16, block_k=16, interpret=True),
}
# ... and those of one new token per row (T = 1; `attend`'s "auto" makes it a `decoding_step`).
ONE_QUERY = {"decoding step": _attend("auto"), "triton decode": _decoding("triton"),
             "mosaic decode": _decoding("mosaic")}
# (window, softcap): a full layer, a sliding one, and a sliding one whose scores are capped.
SINK_CASES = {"full": (FULL_WINDOW, None), "sliding": (5, None), "sliding, softcap": (9, 2.0)}


@functools.partial(jax.jit, static_argnames=("path", "softcap"))
def _run_path(path, q, k, v, q_pos, k_pos, window, sinks, softcap):
    return {**MANY_QUERIES, **ONE_QUERY}[path](q, k, v, q_pos, k_pos, window, sinks=sinks, softcap=softcap)


def _sink_inputs(path):
    """q `[batch, T, 4, 16]`, k, v `[batch, S, 2, 16]` (GQA: 2 query heads per kv head) with scores
    of about the sinks' size, and the positions `[batch, T]`, `[batch, S]`: for a path of many
    queries, row 0 causal over 24 positions and row 1 left-padded by 6 empty slots, whose first 6
    queries (position -1) see no key; for a decoding path, 4 rows at positions 0, 11, 23 and -1 (an
    idle row, which sees no slot)."""
    batch, T = (4, 1) if path in ONE_QUERY else (2, 24)
    kq, kk, kv = jax.random.split(jax.random.key(11), 3)
    q = jax.random.normal(kq, (batch, T, 4, 16))
    k, v = (jax.random.normal(key, (batch, 24, 2, 16)) for key in (kk, kv))
    if path in ONE_QUERY:
        return q, k, v, jnp.array([[0], [11], [23], [-1]]), jnp.tile(jnp.arange(24), (batch, 1))
    k_pos = jnp.stack([jnp.arange(24), jnp.maximum(jnp.arange(24) - 6, -1)])
    return q, k, v, k_pos, k_pos


@pytest.mark.parametrize("case", SINK_CASES)
@pytest.mark.parametrize("path", [*MANY_QUERIES, *ONE_QUERY])
def test_every_path_attends_with_sinks_as_the_formula(path, case):
    """`softmax(concat(scores, sink))[..., :-1] @ v` with each query head's own sink, written out
    in float64 numpy (`numpy_attention`): every path's output within float32 rounding (the values
    are ~1: 2e-5), and exactly 0 on a row that sees no key. The sinks move the formula's output
    far more than that (a path that dropped them, or gave a head another's, fails)."""
    window, softcap = SINK_CASES[case]
    q, k, v, q_pos, k_pos = _sink_inputs(path)
    mask = np.asarray(visible(q_pos, k_pos, window))  # [batch, T, S]
    blind = ~mask.any(-1)  # [batch, T]: the rows that see no key
    assert blind.any() and not blind.all()
    want, _ = numpy_attention(q, k, v, mask, SINKS, softcap=softcap)
    assert np.abs(want - numpy_attention(q, k, v, mask, softcap=softcap)[0]).max() > 0.1
    got = _run_path(path, q, k, v, q_pos, k_pos, jnp.int32(window), SINKS, softcap)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got)[blind], 0)


def test_dense_weights_with_sinks_are_the_formulas_and_sum_below_one():
    """The dense path's weights (what it sows) are the formula's, without the sink's column: each
    row's sum is below 1 by the sink's share, and 0 on a row that sees no key."""
    q, k, v, q_pos, k_pos = _sink_inputs("dense")
    mask = np.asarray(visible(q_pos, k_pos, jnp.int32(FULL_WINDOW)))
    _, weights = dot_product_attention(q, k, v, jnp.asarray(mask), sinks=SINKS)
    _, want = numpy_attention(q, k, v, mask, SINKS)
    np.testing.assert_allclose(weights, want, atol=1e-6, rtol=0)
    sums = np.asarray(weights.sum(-1))  # [batch, n_head, T]
    sees = mask.any(-1)[:, None]  # [batch, 1, T]
    assert (sums[np.broadcast_to(sees, sums.shape)] < 1 - 1e-3).all()
    np.testing.assert_array_equal(sums[np.broadcast_to(~sees, sums.shape)], 0)


def _gpt_oss_layer(window):
    """A `DecoderConfig` and gpt-oss's attention `AttentionSpec` of 4 query heads over 2 kv heads
    of 8 channels, on a width of 32: q/k/v and o biases, sinks, and `window` (None: full)."""
    config = SMALL.replace(n_layer=1, d_model=32, head_dim_override=8)
    spec = AttentionSpec(n_head=4, n_kv_head=2, head_dim=8, window=window, rope_theta=1e4, rope_scaling=None,
                         qkv_bias=True, sinks=True, o_bias=True)
    return config, spec


def _layer_output(config, spec, params, x):
    """`GQASelfAttention`'s `y [batch, T, d_model]` over `x [batch, T, d_model]` at positions `0 .. T-1`, uncached."""
    positions = jnp.arange(x.shape[1])
    cos, sin, seen = spec.view(positions, positions)
    part = Part(x.shape[0], x.shape[1], cos, sin, {spec.attention_type: seen}, None)
    return GQASelfAttention(config, spec).apply({"params": params}, x, (part,))[0]


@pytest.mark.peers
@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
def test_a_layer_with_sinks_and_biases_equals_transformers_gpt_oss_attention(window):
    """`GQASelfAttention` with gpt-oss's features against transformers' `GptOssAttention` (eager, torch
    float32) with its weights copied over, RoPE from each side's own default rope at base 10^4, and
    the causal (and sliding) mask written out for it: the outputs within float32 rounding. With the
    sinks at -inf the layer is plain attention (as `sinks=False`), and that is far from gpt-oss's."""
    torch = torch_peer()
    gpt_oss = import_peer("transformers.models.gpt_oss.modeling_gpt_oss")
    config, spec = _gpt_oss_layer(window)
    batch, T, d, H, K, D = 2, 12, 32, 4, 2, 8
    x = jax.random.normal(jax.random.key(0), (batch, T, d))
    shapes = spec.weights(d)
    keys = jax.random.split(jax.random.key(1), len(shapes))
    params = {name: 0.3 * jax.random.normal(key, weight.shape) for key, (name, weight) in zip(keys, shapes.items())}
    params["sinks"] = SINKS  # (of the size of the scores, which are ~1 here)
    ours = _layer_output(config, spec, params, x)

    hf_config = gpt_oss.GptOssConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=K, head_dim=D,
                                     num_hidden_layers=1, attention_bias=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf_config._attn_implementation = "eager"
    layer = gpt_oss.GptOssAttention(hf_config, layer_idx=0).eval()
    p = {name: np.asarray(a, np.float32) for name, a in params.items()}
    state = {"sinks": p["sinks"], "o_proj.weight": p["wo"].reshape(H * D, d).T, "o_proj.bias": p["bo"]}
    for x_name in "qkv":  # a Linear's weight is [out, in]: ours [d, heads, D] flattened and transposed
        state[f"{x_name}_proj.weight"] = p[f"w{x_name}"].reshape(d, -1).T
        state[f"{x_name}_proj.bias"] = p[f"b{x_name}"].reshape(-1)
    layer.load_state_dict({name: torch.tensor(np.ascontiguousarray(a)) for name, a in state.items()})
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    mask = (s <= t) & (s > t - (window or T))  # [T, S]: causal, within the window
    hidden = torch.tensor(np.asarray(x))
    with torch.no_grad():
        rope = gpt_oss.GptOssRotaryEmbedding(hf_config)(hidden, torch.arange(T)[None])
        theirs = layer(hidden, rope, torch.tensor(np.where(mask, 0.0, -np.inf), dtype=torch.float32)[None, None])[0]
    theirs = theirs.numpy()
    bound = 1e-5 * np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0)

    without = _layer_output(config, spec, {**params, "sinks": jnp.full(H, -jnp.inf)}, x)
    plain = dataclasses.replace(spec, sinks=False)
    no_sinks = {name: a for name, a in params.items() if name != "sinks"}
    np.testing.assert_allclose(without, _layer_output(config, plain, no_sinks, x), atol=1e-6, rtol=0)
    assert np.abs(np.asarray(without) - theirs).max() > 100 * bound


QWEN3_NEXT_LAYER = AttentionSpec(n_head=4, n_kv_head=2, head_dim=16, window=None, rope_theta=1e4, rope_scaling=None,
                                 qk_norm=True, output_gate=True, partial_rotary_factor=0.25)


@pytest.mark.peers
def test_a_layer_with_an_output_gate_and_partial_rotary_equals_transformers_qwen3_next_attention():
    """`GQASelfAttention` with Qwen3-Next's features (the output gate from the doubled `q_proj`, RoPE on
    each head's first quarter of channels, q/k norms of `1 + weight`) against transformers'
    `Qwen3NextAttention` (eager, float32; Qwen3.5's is the same code), its weights ours, over 12
    tokens: within 1e-5 of the largest output. Without the gate, or rotating every channel, the
    output moves by far more."""
    torch = torch_peer()
    qwen3_next = import_peer("transformers.models.qwen3_next.modeling_qwen3_next")
    spec, (batch, T, d, H, K, D) = QWEN3_NEXT_LAYER, (2, 12, 32, 4, 2, 16)
    config = SMALL.replace(n_layer=1, d_model=d, head_dim_override=D, norm_plus_one=True)
    shapes = spec.weights(d)
    assert shapes["wq"].shape == (d, H, 2 * D)  # each head's query channels, then its gate's
    keys = jax.random.split(jax.random.key(1), len(shapes) + 2)
    params = {name: 0.3 * jax.random.normal(key, weight.shape) for key, (name, weight) in zip(keys, shapes.items())}
    params.update({norm: {"weight": 0.3 * jax.random.normal(key, (D,))} for norm, key in zip(("q_norm", "k_norm"),
                                                                                            keys[-2:])})
    x = jax.random.normal(jax.random.key(0), (batch, T, d))
    ours = _layer_output(config, spec, params, x)

    hf_config = qwen3_next.Qwen3NextConfig(hidden_size=d, num_attention_heads=H, num_key_value_heads=K, head_dim=D,
                                           num_hidden_layers=1, rms_norm_eps=config.norm_eps,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                            "partial_rotary_factor": 0.25})
    hf_config._attn_implementation = "eager"
    layer = qwen3_next.Qwen3NextAttention(hf_config, layer_idx=0).eval()
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    state = {"q_proj.weight": p["wq"].reshape(d, -1).T, "k_proj.weight": p["wk"].reshape(d, -1).T,
             "v_proj.weight": p["wv"].reshape(d, -1).T, "o_proj.weight": p["wo"].reshape(H * D, d).T,
             "q_norm.weight": p["q_norm"]["weight"], "k_norm.weight": p["k_norm"]["weight"]}
    layer.load_state_dict({name: torch.tensor(np.ascontiguousarray(a)) for name, a in state.items()})
    causal = np.where(np.tril(np.ones((T, T), bool)), 0.0, -np.inf)
    hidden = torch.tensor(np.asarray(x))
    with torch.no_grad():
        rope = qwen3_next.Qwen3NextRotaryEmbedding(hf_config)(hidden, torch.arange(T)[None])
        assert rope[0].shape[-1] == 4  # a quarter of 16 channels
        theirs = layer(hidden, rope, torch.tensor(causal, dtype=torch.float32)[None, None])[0].numpy()
    bound = 1e-5 * np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, atol=bound, rtol=0)

    ungated = dataclasses.replace(spec, output_gate=False)
    every_channel = dataclasses.replace(spec, partial_rotary_factor=1.0)
    for other, other_params in ((ungated, {**params, "wq": params["wq"][..., :D]}), (every_channel, params)):
        assert np.abs(np.asarray(_layer_output(config, other, other_params, x)) - theirs).max() > 100 * bound


def test_a_spec_rotates_an_even_number_of_channels_up_to_its_heads():
    assert QWEN3_NEXT_LAYER.rotary_dim == 4
    assert dataclasses.replace(QWEN3_NEXT_LAYER, partial_rotary_factor=1).rotary_dim == 16
    for factor in (0.0, 0.2, 1.5):  # none, 3 of 16 channels, more than a head
        with pytest.raises(ValueError, match="AttentionSpec.partial_rotary_factor must rotate an even number"):
            dataclasses.replace(QWEN3_NEXT_LAYER, partial_rotary_factor=factor)


def test_a_decoder_with_sinks_decodes_from_its_cache_as_its_full_forward():
    """A decoder whose layers have sinks and an o bias (one of them sliding): a prefill, then one
    token at a time (`decoding_step`, with the sinks), gives the logits of one uncached forward, but
    for float32 rounding in sums of other orders (1e-5 of the largest logit: the random weights'
    logits are ~10)."""
    config = with_sinks(filled_layers(SMALL, windows=[None, 5, None]))
    model = Decoder(config)
    params = random_params(config, seed=3)
    assert params["block_0"]["attn"]["sinks"].shape == (config.n_head,)
    tokens = jax.random.randint(jax.random.key(2), (2, 14), 0, config.vocab_size)
    full, _ = jit_apply(model, {"params": params}, tokens)
    logits, cache = jit_apply(model, {"params": params}, tokens[:, :10], KVCache.create(config, 2, capacity=16))
    pieces = [logits]
    for t in range(10, 14):
        logits, cache = jit_apply(model, {"params": params}, tokens[:, t:t + 1], cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5 * float(jnp.abs(full).max()), rtol=0)
