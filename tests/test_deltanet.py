"""Gated DeltaNet (jaxformer.deltanet): its chunked form against its recurrent one (values and
gradients), padding and states across calls, and each piece against transformers' torch code
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, the Qwen3-Next and Qwen3.5
layers with the fallbacks transformers runs where the fla / causal-conv1d kernels are absent)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_peer, in_float64, torch_peer

from jaxformer import DecoderConfig, KVCache
from jaxformer.attention import Part
from jaxformer.cache import Entry
from jaxformer.deltanet import (
    GatedDeltaNet,
    GatedDeltaNetSpec,
    chunked_delta_rule,
    decay,
    gated_rms_norm,
    l2_normalize,
    linear_attention,
    recurrent_delta_rule,
    unit_lower_inverse,
)

CHUNK = 8  # small chunks: the lengths below cross several at tiny sizes
LENGTHS = {"1": 1, "chunk-1": CHUNK - 1, "chunk": CHUNK, "chunk+1": CHUNK + 1, "3chunks+5": 3 * CHUNK + 5}
D_MODEL = 32
SPEC = GatedDeltaNetSpec(n_key_head=2, n_value_head=4, key_dim=8, value_dim=6, conv_kernel=4, chunk=CHUNK)
CONFIG = DecoderConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, d_model=D_MODEL)


def _rule_inputs(seed, T, batch=2, n_key=2, n_value=4, d_k=8, d_v=6):
    """`(q, k, v, g, beta, state)` as a layer makes them: unit q and k, decays in (-1, 0], writes in
    (0, 1), and a nonzero state before the first token. Value head h reads key head h // 2."""
    kq, kk, kv, kg, kb, ks = jax.random.split(jax.random.key(seed), 6)
    return (l2_normalize(jax.random.normal(kq, (batch, T, n_key, d_k))),
            l2_normalize(jax.random.normal(kk, (batch, T, n_key, d_k))),
            jax.random.normal(kv, (batch, T, n_value, d_v)),
            -jax.random.uniform(kg, (batch, T, n_value)),
            jax.random.uniform(kb, (batch, T, n_value)),
            jax.random.normal(ks, (batch, n_value, d_k, d_v)))


@jax.jit
def _recurrent(*args):
    return recurrent_delta_rule(*args)


@functools.partial(jax.jit, static_argnames="chunk")
def _chunked(*args, chunk=CHUNK):
    return chunked_delta_rule(*args, chunk=chunk)


@pytest.mark.parametrize("T", LENGTHS.values(), ids=LENGTHS.keys())
def test_the_chunked_form_equals_the_recurrent_one(T):
    """Output and final state, from a nonzero state, at lengths around the chunk's (float32 rounding:
    the outputs are ~1)."""
    inputs = _rule_inputs(0, T)
    for got, want in zip(_chunked(*inputs), _recurrent(*inputs)):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)


@pytest.mark.parametrize("T", LENGTHS.values(), ids=LENGTHS.keys())
def test_the_chunked_forms_gradients_equal_the_recurrent_ones(T):
    """`jax.grad` of a scalar of the output and the final state w.r.t. q, k, v, g, beta and the initial
    state: the chunked form's equal the recurrent form's (its triangular solve's gradient included)."""
    inputs = _rule_inputs(1, T)
    weights = jax.random.normal(jax.random.key(2), (2, T, 4, 6)), jax.random.normal(jax.random.key(3), (2, 4, 8, 6))

    def scalar(rule):
        def loss(*args):
            o, state = rule(*args)
            return jnp.sum(o * weights[0]) + jnp.sum(state * weights[1])
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))

    for got, want in zip(scalar(_chunked)(*inputs), scalar(_recurrent)(*inputs)):
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_a_float64_model_computes_the_rule_in_float64():
    """Float64 inputs (a float64 model, the float32 one's twin in the tests' error bounds) are computed in
    float64: both forms agree to float64's rounding (float32's would leave ~1e-7), and the decay, the
    normalised keys and the gated norm stay float64."""
    inputs = _rule_inputs(0, CHUNK + 1)

    def both(q, k, v, g, beta, state):
        return (chunked_delta_rule(q, k, v, g, beta, state, chunk=CHUNK), recurrent_delta_rule(q, k, v, g, beta, state),
                decay(g, v[0, 0, :, 0], v[0, 0, :, 1]), l2_normalize(q), gated_rms_norm(v, v, v[0, 0, 0], 1e-6))

    (chunked, recurrent, *others) = in_float64(both, *inputs)
    for got, want in zip(chunked, recurrent):
        assert got.dtype == want.dtype == np.float64
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)
    assert [x.dtype for x in others] == [np.float64] * 3


@pytest.mark.parametrize("C", [1, 7, 64])
def test_the_unit_lower_inverse_is_the_float64_inverse(C):
    """`unit_lower_inverse` against NumPy's float64 inverse of `I + A`: for random strictly lower `A`
    (C not a power of two too), and for A all ones below the diagonal, whose inverse is `I` minus the
    first subdiagonal while its series `sum (-A)^m` has terms of binomial size (~1e17 at 64)."""
    A = jnp.tril(jax.random.uniform(jax.random.key(10), (3, C, C)), -1)
    for a in (A, jnp.tril(jnp.ones((C, C)), -1)):
        want = np.linalg.inv(np.eye(C) + np.asarray(a, np.float64))
        np.testing.assert_allclose(jax.jit(unit_lower_inverse)(a), want, atol=1e-6 * np.abs(want).max(), rtol=0)


def _states_from(spec, rows, dtype=jnp.float32):
    return spec.initial_states(rows, dtype)


@jax.jit
def _mix(qkv, g, beta, conv_weight, conv_state, state, valid):
    return linear_attention(SPEC, qkv, g, beta, conv_weight, conv_state, state, valid)


def _mix_inputs(seed, T, rows=2):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k1, (rows, T, SPEC.channels)), decay(jax.random.normal(k2, (rows, T, 4)), jnp.zeros(4),
                                                                    jnp.ones(4)),
            jax.nn.sigmoid(jax.random.normal(k3, (rows, T, 4))), 0.5 * jax.random.normal(k4, (SPEC.conv_kernel,
                                                                                              SPEC.channels)))


def test_a_prompt_in_pieces_padded_after_their_ends_equals_it_in_one():
    """`linear_attention` over a prompt of 21 tokens in one call, against three calls of 9, 1 (the
    recurrent form) and 11 tokens, each carrying the conv inputs and the state on: the same outputs
    and states. The pieces are padded to 12 tokens with garbage (valid False); the padding changes
    neither state, and row 1, whose first piece ends 4 tokens early and which continues from there,
    gives its own prompt's outputs."""
    qkv, g, beta, conv_weight = _mix_inputs(4, 21)
    states = _states_from(SPEC, 2)
    whole, *whole_states = _mix(qkv, g, beta, conv_weight, *states, None)
    garbage = _mix_inputs(5, 12)[:3]
    outs, (conv_state, state) = [], states
    for start, stop in ((0, 9), (9, 10), (10, 21)):
        T = 1 if stop - start == 1 else 12  # the single token unpadded: the recurrent form
        piece = [jnp.concatenate([a[:, start:stop], b[:, :T - (stop - start)]], axis=1)
                 for a, b in zip((qkv, g, beta), garbage)]
        valid = jnp.broadcast_to(jnp.arange(T) < stop - start, (2, T))
        o, conv_state, state = _mix(*piece, conv_weight, conv_state, state, valid)
        outs.append(o[:, :stop - start])
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), whole, atol=2e-6, rtol=0)
    for got, want in zip((conv_state, state), whole_states):
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
    # Row 1 alone: its first 5 tokens, padded to 12, then its next 16; equal to its 21 in one call.
    row = [a[1:] for a in (qkv, g, beta)]
    first = [jnp.concatenate([a[:, :5], b[1:, :7]], axis=1) for a, b in zip(row, garbage)]
    o1, *after = _mix(*first, conv_weight, *_states_from(SPEC, 1), (jnp.arange(12) < 5)[None])
    o2, *end = _mix(*[a[:, 5:] for a in row], conv_weight, *after, jnp.ones((1, 16), bool))
    np.testing.assert_allclose(jnp.concatenate([o1[:, :5], o2], axis=1), whole[1:], atol=2e-6, rtol=0)
    for got, want in zip(end, whole_states):
        np.testing.assert_allclose(got, want[1:], atol=2e-6, rtol=0)


@pytest.mark.peers
@pytest.mark.parametrize("T", [1, 70], ids=["one", "past-a-chunk"])
def test_both_forms_equal_transformers_torch_rules(T):
    """`chunked_delta_rule` (chunks of 64) against `torch_chunk_gated_delta_rule`, and
    `recurrent_delta_rule` against `torch_recurrent_gated_delta_rule`, float32, from a nonzero
    state, with twice as many value heads as key heads: outputs and final states."""
    torch = torch_peer()
    qwen3_next = import_peer("transformers.models.qwen3_next.modeling_qwen3_next")
    inputs = _rule_inputs(6, T)
    theirs = [torch.tensor(np.asarray(a)) for a in inputs]
    chunked = qwen3_next.torch_chunk_gated_delta_rule(*theirs[:5], initial_state=theirs[5], output_final_state=True)
    recurrent = qwen3_next.torch_recurrent_gated_delta_rule(*theirs[:5], initial_state=theirs[5],
                                                            output_final_state=True)
    for ours, torch_out in ((_chunked(*inputs, chunk=64), chunked), (_recurrent(*inputs), recurrent)):
        for got, want in zip(ours, torch_out):
            np.testing.assert_allclose(got, want.numpy(), atol=2e-6, rtol=0)


def _random_layer(seed):
    """`GatedDeltaNet(CONFIG, SPEC)`'s parameters drawn far from init (a wrong detail shows)."""
    shapes = jax.eval_shape(lambda: GatedDeltaNet(CONFIG, SPEC).init(jax.random.key(0), jnp.zeros((1, 1, D_MODEL)),
                                                                      (Part(1, 1, None, None, {}, None),)))
    leaves, tree = jax.tree.flatten(shapes["params"])
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, leaf.shape) + (leaf.ndim == 1)
                                     for k, leaf in zip(keys, leaves)])  # (the vectors near 1: a_log, dt_bias, norm)


@jax.jit
def _layer(params, x):
    return GatedDeltaNet(CONFIG, SPEC).apply({"params": params}, x, (Part(*x.shape[:2], None, None, {}, None),))[0]


@jax.jit
def _cached_layer(params, x, cache):
    part = Part(*x.shape[:2], None, None, {}, cache)
    y, (cache,), _ = GatedDeltaNet(CONFIG, SPEC).apply({"params": params}, x, (part,), 0)
    return y, cache


def test_the_layer_from_its_cache_continues_rows_as_one_call():
    """The layer over a cache of its states (`LinearState`, the cache's "linear" entry): two rows of
    24 tokens, as a ragged prefill (12 tokens a row, row 0's first 9 and row 1's first 5, the rest
    garbage past `cache.stop`), then 12 more from each row's end, then one (the recurrent form), give
    the outputs of one uncached call over the 24 (float32 rounding: 1e-5 of outputs up to ~9)."""
    params = _random_layer(11)
    x = jax.random.normal(jax.random.key(12), (2, 24, D_MODEL))
    whole = _layer(params, x)
    cache = KVCache.zeros(2, 32, n_layer=1, n_kv_head=1, head_dim=1, max_seq_len=32, dtype=jnp.float32,
                          entries=(Entry(*SPEC.cache_entry),))
    garbage = 10 * jax.random.normal(jax.random.key(13), (12, D_MODEL))
    prompt = jnp.stack([x[0, :12], jnp.concatenate([x[1, :5], garbage[5:]])])
    y, cache = _cached_layer(params, prompt, cache.replace(stop=jnp.array([9, 5])))
    ends = np.array([9, 5])
    outs = [[y[0, :9]], [y[1, :5]]]
    for T in (12, 1):
        piece = jnp.stack([x[b, end:end + T] for b, end in enumerate(ends)])
        y, cache = _cached_layer(params, piece, cache.replace(pos=jnp.asarray(ends), stop=None))
        for b in range(2):
            outs[b].append(y[b])
        ends = ends + T
    for b, end in enumerate(ends):
        np.testing.assert_allclose(jnp.concatenate(outs[b]), whole[b, :end], atol=1e-5, rtol=0)


def _as_transformers(params, layout: str) -> dict:
    """Our parameters as the checkpoint's state dict of its `linear_attn`: Qwen3-Next's fused `in_proj_qkvz`
    (rows per key head n: its q, its k, then the v and z of its value heads h = n r .. n r + r - 1) and
    `in_proj_ba` (per key head: its value heads' b, then their a); Qwen3.5's `in_proj_qkv` (every head's q,
    then k, then v), `in_proj_z`, `in_proj_b`, `in_proj_a`. The conv's channels are q's, k's, v's in both."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    d, K, r = D_MODEL, SPEC.conv_kernel, SPEC.n_value_head // SPEC.n_key_head
    n_key = SPEC.n_key_head

    def linear(w):  # ours [d, out...] -> a Linear's weight [out, d]
        return w.reshape(d, -1).T

    state = {"conv1d.weight": np.concatenate([p[f"conv_{x}"].reshape(-1, K) for x in "qkv"])[:, None],
             "dt_bias": p["dt_bias"], "A_log": p["a_log"], "norm.weight": p["norm"]["weight"],
             "out_proj.weight": p["wo"].reshape(-1, d).T}
    if layout == "qwen3_next":
        by_key_head = [p["wq"], p["wk"], p["wv"].reshape(d, n_key, -1), p["wz"].reshape(d, n_key, -1)]
        state["in_proj_qkvz.weight"] = linear(np.concatenate(by_key_head, axis=-1))  # [d, n_key, 2 Dk + 2 r Dv]
        state["in_proj_ba.weight"] = linear(np.concatenate([p["wb"].reshape(d, n_key, r), p["wa"].reshape(d, n_key, r)],
                                                           axis=-1))
    else:
        state["in_proj_qkv.weight"] = np.concatenate([linear(p[w]) for w in ("wq", "wk", "wv")])
        state.update({f"in_proj_{x}.weight": linear(p[f"w{x}"]) for x in "zba"})
    return state


@pytest.mark.peers
@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_the_layer_equals_transformers_gated_deltanet(layout):
    """`GatedDeltaNet` (chunks of 8) against transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet`
    (chunks of 64), float32, their weights ours as each checkpoint lays them out, over 20 tokens: within 1e-5
    of the largest output. The module's parameters are its spec's table."""
    torch = torch_peer()
    params = _random_layer(7)
    assert {n: a.shape for n, a in params.items() if n != "norm"} == {
        n: w.shape for n, w in SPEC.weights(D_MODEL).items()}
    x = jax.random.normal(jax.random.key(8), (2, 20, D_MODEL))
    ours = _layer(params, x)
    if layout == "qwen3_next":
        module = import_peer("transformers.models.qwen3_next.modeling_qwen3_next")
        hf_config = import_peer("transformers").Qwen3NextConfig
        layer_class = module.Qwen3NextGatedDeltaNet
    else:
        module = import_peer("transformers.models.qwen3_5.modeling_qwen3_5")
        hf_config = import_peer("transformers").Qwen3_5TextConfig
        layer_class = module.Qwen3_5GatedDeltaNet
    config = hf_config(hidden_size=D_MODEL, linear_num_key_heads=SPEC.n_key_head,
                       linear_num_value_heads=SPEC.n_value_head, linear_key_head_dim=SPEC.key_dim,
                       linear_value_head_dim=SPEC.value_dim, linear_conv_kernel_dim=SPEC.conv_kernel,
                       num_hidden_layers=1, rms_norm_eps=CONFIG.norm_eps, hidden_act="silu")
    layer = layer_class(config, 0).eval()
    state = _as_transformers(params, layout)
    layer.load_state_dict({name: torch.tensor(np.ascontiguousarray(a)) for name, a in state.items()})
    with torch.no_grad():
        theirs = layer(torch.tensor(np.asarray(x))).numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5 * np.abs(theirs).max(), rtol=0)


@pytest.mark.peers
def test_the_gated_norm_is_transformers_in_bfloat16():
    """`gated_rms_norm` against `Qwen3NextRMSNormGated` on bfloat16 inputs and weight: its casts in
    transformers' order give the same bfloat16 numbers (at most one bfloat16 ulp apart)."""
    torch = torch_peer()
    qwen3_next = import_peer("transformers.models.qwen3_next.modeling_qwen3_next")
    kx, kz, kw = jax.random.split(jax.random.key(9), 3)
    x, z = (3 * jax.random.normal(key, (64, 16), jnp.bfloat16) for key in (kx, kz))
    weight = 1 + 0.3 * jax.random.normal(kw, (16,), jnp.bfloat16)
    norm = qwen3_next.Qwen3NextRMSNormGated(16, eps=1e-6).to(torch.bfloat16)
    as_torch = [torch.tensor(np.asarray(a, np.float32)).to(torch.bfloat16) for a in (x, z, weight)]
    norm.weight.data = as_torch[2]
    with torch.no_grad():
        theirs = norm(as_torch[0], as_torch[1]).float().numpy()
    ours = np.asarray(gated_rms_norm(x, z, weight, 1e-6), np.float32)
    np.testing.assert_allclose(ours, theirs, rtol=2 ** -7, atol=0)
    assert np.mean(ours == theirs) > 0.95


def test_a_spec_refuses_heads_that_do_not_group():
    with pytest.raises(ValueError, match="n_value_head must be a multiple of n_key_head=3"):
        GatedDeltaNetSpec(3, 4, 8, 8)
    with pytest.raises(ValueError, match="GatedDeltaNetSpec.chunk must be at least 1"):
        GatedDeltaNetSpec(2, 4, 8, 8, chunk=0)
