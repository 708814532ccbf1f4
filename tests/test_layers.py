"""A decoder layer of kinds: each layer's spec as its config states it, the kinds' parameter
tables against the modules they build, and what one scanned body may run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, filled_layers, jit_apply, numpy_decoder_logits, random_params, with_experts, with_sinks

from jaxformer import Decoder, DecoderConfig, KVCache
from jaxformer.attention import AttentionSpec
from jaxformer.convert import config_to_hf, with_rope_pairing, with_scan_layers
from jaxformer.experts import ExpertsSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.layers import LayerSpec, Segment, distinct, layer_specs, scanned_places, segments

GEMMA3_LIKE = DecoderConfig(vocab_size=64, n_layer=4, n_head=4, n_kv_head=1, d_model=32, head_dim_override=16,
                            layer_types=("sliding", "sliding", "sliding", "full"), sliding_window=8,
                            rope_theta=1e6, local_rope_theta=1e4, qk_norm=True, post_norms=True,
                            mlp_activation="gelu_tanh", query_pre_attn_scalar=24)


def test_each_layer_spec_is_what_the_config_states():
    specs = layer_specs(GEMMA3_LIKE)
    assert len(specs) == 4 and specs[0] == specs[1] == specs[2] != specs[3]
    sliding, full = specs[0].mixer, specs[3].mixer
    assert (sliding.window, sliding.rope_theta, sliding.attention_type) == (8, 1e4, "sliding")
    assert (full.window, full.rope_theta, full.attention_type) == (None, 1e6, "full")
    assert (full.n_head, full.n_kv_head, full.head_dim, full.qk_norm, full.scale) == (4, 1, 16, True, 24 ** -0.5)
    assert specs[0].ffn == GatedMLPSpec(GEMMA3_LIKE.ffn_dim, "gelu_tanh") and specs[0].norms == "sandwich"
    plain = layer_specs(DecoderConfig(n_layer=2))
    assert plain[0] == plain[1] and plain[0].norms == "pre" and plain[0].mixer.window is None
    # The config's own account of each layer's window (what the cache reads) is its specs'.
    for config in (GEMMA3_LIKE, DecoderConfig(n_layer=2), filled_layers(SMALL, windows=[None, 5, None])):
        assert config.windows == tuple(spec.mixer.window for spec in layer_specs(config))
    assert GEMMA3_LIKE.windows == (8, 8, 8, None)


@pytest.mark.parametrize("config", [
    GEMMA3_LIKE, GEMMA3_LIKE.replace(qkv_bias=True, qk_norm=False), with_sinks(GEMMA3_LIKE),
    with_experts(GEMMA3_LIKE, ExpertsSpec(4, 2, 16, activation="clamped_swiglu", routing="topk_softmax",
                                          router_bias=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)),
    with_experts(GEMMA3_LIKE, ExpertsSpec(4, 2, 16, activation="gelu_tanh", routing="sigmoid_grouped", n_group=2,
                                          shared_width=24, shared_gate=True)),
    GEMMA3_LIKE.replace(layers=tuple(
        dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, output_gate=True, partial_rotary_factor=0.25,
                                                            qkv_bias=True)) for spec in layer_specs(GEMMA3_LIKE)))],
    ids=["qk-norm", "biases", "sinks", "experts-biases", "experts-shared", "output-gate"])
def test_the_kinds_tables_are_the_parameters_their_modules_make(config):
    """`spec.weights(d_model)`, which the checkpoint tables read, names and shapes exactly the
    parameters the modules declare (the norms inside a kind are its module's own)."""
    params = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    for i, spec in enumerate(layer_specs(config)):
        for part, kind in (("attn", spec.mixer), ("mlp", spec.ffn)):
            made = {name: leaf.shape for name, leaf in params[f"block_{i}"][part].items() if not isinstance(leaf, dict)}
            assert made == {name: weight.shape for name, weight in kind.weights(config.d_model).items()}


def test_a_layer_spec_refuses_what_is_not_a_kind():
    spec = layer_specs(DecoderConfig(n_layer=1))[0]
    with pytest.raises(ValueError, match="LayerSpec.mixer"):
        LayerSpec(spec.ffn, spec.ffn)
    with pytest.raises(ValueError, match="LayerSpec.ffn"):
        LayerSpec(spec.mixer, spec.mixer)
    with pytest.raises(ValueError, match="LayerSpec.norms"):
        LayerSpec(spec.mixer, spec.ffn, "after")


def test_one_scanned_body_runs_layers_that_differ_in_window_and_rope_alone():
    sliding, full = layer_specs(GEMMA3_LIKE)[0], layer_specs(GEMMA3_LIKE)[3]
    assert distinct((sliding, full, sliding)) == (full, sliding)  # full first: the scan's flag picks the second
    wider = dataclasses.replace(full, mixer=dataclasses.replace(full.mixer, n_head=8))
    with pytest.raises(ValueError, match="scan_layers=True"):
        distinct((sliding, wider))
    other_ffn = dataclasses.replace(sliding, ffn=GatedMLPSpec(64))
    with pytest.raises(ValueError, match="scan_layers=True"):
        distinct((sliding, other_ffn))
    # Two full layers that rotate otherwise (another base, or none: NoPE) share a body; the flag picks the angles.
    for other in (dataclasses.replace(full.mixer, rope_theta=123.0), dataclasses.replace(full.mixer, use_rope=False)):
        assert distinct((full, dataclasses.replace(full, mixer=other)))[1].mixer == other
    wider_window = dataclasses.replace(sliding, mixer=dataclasses.replace(sliding.mixer, window=16))
    with pytest.raises(ValueError, match="scan_layers=True"):  # two masks of one type: not told apart
        distinct((sliding, wider_window))


def test_attention_spec_views_rotate_at_their_own_base():
    """A sliding layer with its own base rotates by it: its view's angles are `p * base ** (-2i/d)`."""
    specs = layer_specs(GEMMA3_LIKE)
    position = jnp.arange(5)
    for spec in (specs[0], specs[3]):
        mixer: AttentionSpec = spec.mixer
        cos, sin, seen = mixer.view(position, position)
        inv_freq = mixer.rope_theta ** (-jnp.arange(0, mixer.head_dim, 2) / mixer.head_dim)
        want = position[:, None] * inv_freq[None, :]
        assert jnp.allclose(cos, jnp.cos(want), atol=1e-6) and jnp.allclose(sin, jnp.sin(want), atol=1e-6)
        assert int(seen.window) == (mixer.window or 2 ** 30)
    nope = dataclasses.replace(specs[3].mixer, use_rope=False)  # a NoPE layer's angles: the identity rotation
    cos, sin, _ = nope.view(jnp.arange(5)[None], position)
    assert cos.shape == (1, 5, 8) and bool((cos == 1).all()) and bool((sin == 0).all())


# SmolLM3's NoPE layers (the second of two: it rotates neither q nor k) and OLMo 2's norms after each
# sublayer alone ("post"), on a small model.
NOPE_POST = SMALL.replace(n_layer=2, layers=tuple(
    dataclasses.replace(spec, norms="post", mixer=dataclasses.replace(spec.mixer, use_rope=i == 0))
    for i, spec in enumerate(layer_specs(SMALL.replace(n_layer=2)))))


def test_nope_layers_and_post_norms_compute_the_numpy_forward_scanned_or_not():
    """Against the float64 forward that rotates no NoPE layer and places the norms where each spec
    says (each of which moves its logits: the check has teeth), and scanned as unrolled, in one body."""
    config, params = NOPE_POST, random_params(NOPE_POST, seed=3)
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (2, 16))
    want = numpy_decoder_logits(params, tokens, config)
    rotating = config.replace(layers=tuple(dataclasses.replace(s, mixer=dataclasses.replace(s.mixer, use_rope=True))
                                           for s in config.layers))
    pre = rotating.replace(layers=tuple(dataclasses.replace(s, norms="pre") for s in config.layers))
    as_pre = {key: {name.replace("_post", ""): leaf for name, leaf in block.items()} if key.startswith("block_")
              else block for key, block in params.items()}  # (the norms after, before)
    assert np.abs(want - numpy_decoder_logits(params, tokens, rotating)).max() > 1.0
    assert np.abs(want - numpy_decoder_logits(as_pre, tokens, pre)).max() > 1.0
    got, _ = jit_apply(Decoder(config), {"params": params}, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    scanned_config, scanned_params = with_scan_layers(config, params, True)
    assert segments(layer_specs(config)) == (Segment(0, (config.layers,), 2),)  # the flag picks the angles
    scanned, _ = jit_apply(Decoder(scanned_config), {"params": scanned_params}, tokens)
    np.testing.assert_allclose(scanned, got, atol=1e-5, rtol=1e-5)


forward = jax.jit(lambda model, params, tokens: model.apply({"params": params}, tokens)[0], static_argnums=0)


def test_filled_specs_are_the_layers_and_the_config_stays_a_static_argument():
    config = filled_layers(SMALL, widths=[32, 32, 96])
    assert layer_specs(config) == config.layers and [s.ffn.width for s in config.layers] == [32, 32, 96]
    assert hash(config) == hash(filled_layers(SMALL, widths=[32, 32, 96])) and config != filled_layers(SMALL)
    assert config.replace(max_seq_len=32).layers == config.layers  # replace keeps them
    assert DecoderConfig(**{**vars(SMALL), "layers": list(config.layers)}).layers == config.layers  # a list: a tuple
    params = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    assert [params[f"block_{i}"]["mlp"]["w_up"].shape for i in range(3)] == [(64, 32), (64, 32), (64, 96)]
    interleaved, _ = with_rope_pairing(config, random_params(config, 0), "interleaved")  # specs pair alike
    assert {spec.mixer.rope_pairing for spec in layer_specs(interleaved)} == {"interleaved"}


@pytest.mark.parametrize("scan_layers", [False, True], ids=["unrolled", "scanned"])
def test_a_filled_spec_equal_to_the_derived_one_computes_the_same_logits(scan_layers):
    config, params = with_scan_layers(SMALL, random_params(SMALL, seed=0), scan_layers)
    tokens = np.random.RandomState(0).randint(0, SMALL.vocab_size, (2, 9))
    np.testing.assert_array_equal(forward(Decoder(filled_layers(config)), params, tokens),
                                  forward(Decoder(config), params, tokens))


def test_a_cache_keeps_the_slots_each_filled_spec_reads():
    """A filled spec's window, not `layer_types`, makes its layer's ring."""
    config = filled_layers(SMALL, windows=[None, 5, None])
    assert config.layer_types is None and KVCache.create(config, 1, 32).layer_shapes == (
        (1, 32, 2, 16), (1, 4, 2, 16), (1, 32, 2, 16))


def test_bad_filled_specs_are_refused():
    spec = layer_specs(SMALL)[0]
    with pytest.raises(ValueError, match=r"DecoderConfig.layers must be \(\) or 3 \(n_layer\) LayerSpecs.*got 2"):
        SMALL.replace(layers=(spec, spec))
    with pytest.raises(ValueError, match="DecoderConfig.layers must be a tuple of LayerSpecs"):
        SMALL.replace(layers=spec)
    with pytest.raises(ValueError, match=r"config.layers\[1\] must be a LayerSpec \(got AttentionSpec\)"):
        layer_specs(SMALL.replace(layers=(spec, spec.mixer, spec)))
    interleaved = dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, rope_pairing="interleaved"))
    with pytest.raises(ValueError, match=r"config.layers\[2\].mixer.rope_pairing must be the config's rope_pairing"):
        layer_specs(SMALL.replace(layers=(spec, spec, interleaved)))
    shared = dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, kv_shared=True))
    with pytest.raises(ValueError, match=r"config.layers\[0\].mixer.kv_shared: no earlier layer of its type \(full\)"):
        layer_specs(SMALL.replace(layers=(shared, spec, spec)))
    with pytest.raises(ValueError, match=r"config.layers\[2\].mixer.kv_shared with scan_layers=True"):
        layer_specs(SMALL.replace(layers=(spec, spec, shared), scan_layers=True))
    with pytest.raises(ValueError, match="config.layers cannot be written as a llama checkpoint"):
        config_to_hf(filled_layers(SMALL, widths=[32, 32, 96]))
    config_to_hf(filled_layers(SMALL))  # the specs the fields state: a llama checkpoint holds them


def wider_global_heads(config: DecoderConfig, shared_from: int | None = None) -> DecoderConfig:
    """`config` (sliding and full layers) with its full layers' attention of Gemma 4's form: twice the
    head width, one kv head, the keys' projection as the values; layers from `shared_from` on read
    the keys and values of the last earlier layer of their type."""
    def layer(i, spec):
        mixer = spec.mixer
        if mixer.window is None:
            mixer = dataclasses.replace(mixer, head_dim=2 * mixer.head_dim, n_kv_head=1, k_eq_v=True)
        mixer = dataclasses.replace(mixer, v_norm=True, kv_shared=shared_from is not None and i >= shared_from)
        return dataclasses.replace(spec, mixer=mixer)

    return config.replace(layers=tuple(layer(i, spec) for i, spec in enumerate(layer_specs(config))))


ALTERNATING = GEMMA3_LIKE.replace(n_layer=6, layer_types=("sliding", "full") * 3)
GEMMA4_LIKE = wider_global_heads(ALTERNATING)


@pytest.mark.parametrize("shared_from", [None, 2], ids=["own", "shared"])
def test_layers_of_their_own_head_widths_and_shared_keys_decode_through_the_cache_as_the_full_forward(shared_from):
    """Per-layer heads (the full layers' twice as wide, one kv head, k = v) and the last layers
    reading their type's keys and values: the cache keeps each layer's own shape, nothing for a
    sharing layer, and a prefill then one token a step gives the full forward's logits."""
    config = wider_global_heads(ALTERNATING.replace(n_layer=4, layer_types=("sliding", "full") * 2), shared_from)
    params = random_params(config, seed=0)
    assert "wv" not in params["block_1"]["attn"] and params["block_1"]["attn"]["wk"].shape == (32, 1, 32)
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (2, 14))
    full = forward(Decoder(config), params, tokens)
    cache = KVCache.create(config, 2, 16)
    kept = [None if layer is None else layer.k.shape for layer in cache.layers]
    assert kept[:2] == [(2, 7, 1, 16), (2, 16, 1, 32)]
    assert kept[2:] == ([None, None] if shared_from else [(2, 7, 1, 16), (2, 16, 1, 32)])
    step = jax.jit(lambda tokens, cache: Decoder(config).apply({"params": params}, tokens, cache))
    logits, cache = step(jnp.asarray(tokens[:, :10]), cache)
    got = [logits]
    for t in range(10, 14):
        logits, cache = step(jnp.asarray(tokens[:, t:t + 1]), cache)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=2e-5, rtol=0)


def test_a_scanned_model_of_per_layer_head_widths_stacks_one_shape_per_kind():
    """Scanned, the wider full layers are a body of their own and a stack of the cache of their own:
    the same logits, and a prefill through the stacked cache the same."""
    config = GEMMA4_LIKE
    params = random_params(config, seed=1)
    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (1, 12))
    scanned, scanned_params = with_scan_layers(config, params, True)
    want = forward(Decoder(config), params, tokens)
    np.testing.assert_allclose(forward(Decoder(scanned), scanned_params, tokens), want, atol=2e-5, rtol=0)
    cache = KVCache.create(scanned, 1, 16)
    assert cache.layer_shapes == ((1, 3, 16, 1, 32), (1, 3, 7, 1, 16))  # the full stack, then the rings
    logits, _ = jax.jit(lambda t, c: Decoder(scanned).apply({"params": scanned_params}, t, c))(jnp.asarray(tokens),
                                                                                              cache)
    np.testing.assert_allclose(logits, want, atol=2e-5, rtol=0)
    mixed = config.replace(layer_types=None, sliding_window=None, local_rope_theta=None, layers=tuple(
        dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, window=None)) for spec in config.layers))
    with pytest.raises(ValueError, match="a stacked cache holds one shape of full layer"):
        KVCache.create(mixed.replace(scan_layers=True), 1, 16)


def test_segments_scan_each_run_of_repeated_specs():
    """The shortest period that repeats over the most layers, from the first layer on."""
    a = layer_specs(SMALL)[0]
    b = dataclasses.replace(a, ffn=GatedMLPSpec(96))
    assert segments((a,) * 4) == (Segment(0, ((a,),), 4),)  # uniform: one body, as before segments
    gemma3 = layer_specs(GEMMA3_LIKE.replace(n_layer=8, layer_types=("sliding",) * 5 + ("full",) + ("sliding",) * 2))
    full, sliding = gemma3[5], gemma3[0]
    assert segments(gemma3) == (Segment(0, ((full, sliding),), 8),)  # one body of both, the flag picks
    assert segments((a,) * 2 + (b,) * 3) == (Segment(0, ((a,),), 2), Segment(2, ((b,),), 3))  # dense, then wider
    assert segments((a, a, a, b) * 3) == (Segment(0, ((a,), (a,), (a,), (b,)), 3),)  # a period of four bodies
    assert segments((a, a, a, b) * 3 + (a, a)) == (Segment(0, ((a,), (a,), (a,), (b,)), 3), Segment(12, ((a,),), 2))
    assert segments((a, b)) == (Segment(0, ((a,),), 1), Segment(1, ((b,),), 1))  # nothing repeats: a layer each
    rotated = dataclasses.replace(a, mixer=dataclasses.replace(a.mixer, rope_theta=123.0))  # one window: one body
    assert segments((a, rotated) * 2) == (Segment(0, ((a, rotated),), 4),)
    eight, four = (dataclasses.replace(a, mixer=dataclasses.replace(a.mixer, window=w)) for w in (8, 4))
    assert segments((eight, four) * 2) == (Segment(0, ((eight,), (four,)), 2),)  # two sliding masks: bodies apart
    assert scanned_places((a, a, a, b) * 2 + (a,)) == (
        *[(("blocks", f"block_{j}"), r, 2) for r in range(2) for j in range(4)], (("blocks_1",), 0, 1))
