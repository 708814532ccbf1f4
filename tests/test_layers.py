"""A decoder layer of kinds: each layer's spec as its config states it, the kinds' parameter
tables against the modules they build, and what one scanned body may run."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, random_params

from jaxformer import Decoder, DecoderConfig, KVCache
from jaxformer.attention import AttentionSpec
from jaxformer.convert import config_to_hf, with_rope_pairing
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.layers import LayerSpec, distinct, layer_specs

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


@pytest.mark.parametrize("config", [GEMMA3_LIKE, GEMMA3_LIKE.replace(qkv_bias=True, qk_norm=False)],
                         ids=["qk-norm", "biases"])
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
        LayerSpec(spec.mixer, spec.ffn, "post")


def test_one_scanned_body_runs_layers_that_differ_in_window_and_rope_alone():
    sliding, full = layer_specs(GEMMA3_LIKE)[0], layer_specs(GEMMA3_LIKE)[3]
    assert distinct((sliding, full, sliding)) == (full, sliding)  # full first: the scan's flag picks the second
    wider = dataclasses.replace(full, mixer=dataclasses.replace(full.mixer, n_head=8))
    with pytest.raises(ValueError, match="scan_layers=True"):
        distinct((sliding, wider))
    other_ffn = dataclasses.replace(sliding, ffn=GatedMLPSpec(64))
    with pytest.raises(ValueError, match="scan_layers=True"):
        distinct((sliding, other_ffn))
    two_full = dataclasses.replace(full, mixer=dataclasses.replace(full.mixer, rope_theta=123.0))
    with pytest.raises(ValueError, match="scan_layers=True"):
        distinct((full, two_full))


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


def filled(config: DecoderConfig, widths=None, windows=None) -> DecoderConfig:
    """`config` with its derived specs filled in as `layers`, layer i's FFN `widths[i]` wide and
    its attention sliding over `windows[i]` positions (None: full) where given."""
    specs = layer_specs(config)
    widths = widths or [spec.ffn.width for spec in specs]
    windows = windows or [spec.mixer.window for spec in specs]
    return config.replace(layers=tuple(
        dataclasses.replace(spec, ffn=dataclasses.replace(spec.ffn, width=width),
                            mixer=dataclasses.replace(spec.mixer, window=window))
        for spec, width, window in zip(specs, widths, windows)))


forward = jax.jit(lambda model, params, tokens: model.apply({"params": params}, tokens)[0], static_argnums=0)


def test_filled_specs_are_the_layers_and_the_config_stays_a_static_argument():
    config = filled(SMALL, widths=[32, 32, 96])
    assert layer_specs(config) == config.layers and [s.ffn.width for s in config.layers] == [32, 32, 96]
    assert hash(config) == hash(filled(SMALL, widths=[32, 32, 96])) and config != filled(SMALL)
    assert config.replace(max_seq_len=32).layers == config.layers  # replace keeps them
    assert DecoderConfig(**{**vars(SMALL), "layers": list(config.layers)}).layers == config.layers  # a list: a tuple
    params = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    assert [params[f"block_{i}"]["mlp"]["w_up"].shape for i in range(3)] == [(64, 32), (64, 32), (64, 96)]
    interleaved, _ = with_rope_pairing(config, random_params(config, 0), "interleaved")  # specs pair alike
    assert {spec.mixer.rope_pairing for spec in layer_specs(interleaved)} == {"interleaved"}


def test_a_filled_spec_equal_to_the_derived_one_computes_the_same_logits():
    params = random_params(SMALL, seed=0)
    tokens = np.random.RandomState(0).randint(0, SMALL.vocab_size, (2, 9))
    np.testing.assert_array_equal(forward(Decoder(filled(SMALL)), params, tokens),
                                  forward(Decoder(SMALL), params, tokens))


def test_a_cache_keeps_the_slots_each_filled_spec_reads():
    """A filled spec's window, not `layer_types`, makes its layer's ring."""
    config = filled(SMALL, windows=[None, 5, None])
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
    wide = dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, head_dim=32))
    with pytest.raises(ValueError, match=r"config.layers\[2\].mixer.head_dim must be the config's head_dim=16"):
        Decoder(SMALL.replace(layers=(spec, spec, wide))).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    fewer_kv = dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, n_kv_head=1))
    with pytest.raises(ValueError, match=r"config.layers\[0\].mixer.n_kv_head must be the config's n_kv_head=2"):
        layer_specs(SMALL.replace(layers=(fewer_kv, spec, spec)))
    with pytest.raises(ValueError, match="config.layers cannot be written as a llama checkpoint"):
        config_to_hf(filled(SMALL, widths=[32, 32, 96]))
    config_to_hf(filled(SMALL))  # the specs the fields state: a llama checkpoint holds them
