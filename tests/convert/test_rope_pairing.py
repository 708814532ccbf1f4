import dataclasses

import jax
import numpy as np
import pytest
from conftest import SMALL, filled_layers, init_params, random_params

from jaxformer import Decoder
from jaxformer.convert import with_rope_pairing

TOKENS = np.arange(3 * 30).reshape(3, 30) * 5 % SMALL.vocab_size


def _logits(config, params):
    return np.asarray(jax.jit(Decoder(config).apply)({"params": params}, TOKENS)[0])


@pytest.mark.parametrize("start, target", [("interleaved", "split_half"), ("split_half", "interleaved")])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_same_model_in_the_other_pairing(start, target, qkv_bias):
    config = SMALL.replace(rope_pairing=start, qkv_bias=qkv_bias)
    params = random_params(config, seed=7)
    new_config, new_params = with_rope_pairing(config, params, target)
    assert new_config == config.replace(rope_pairing=target)
    want = _logits(config, params)
    np.testing.assert_allclose(_logits(new_config, new_params), want, atol=1e-4, rtol=1e-4)  # float32 sums reordered
    # Only the pairing's meaning changed; reading the old weights with the new pairing is wrong.
    assert np.abs(_logits(new_config, params) - want).max() > 1.0
    # V and O are never touched; there and back is the identity.
    np.testing.assert_array_equal(new_params["block_0"]["attn"]["wv"], params["block_0"]["attn"]["wv"])
    back_config, back = with_rope_pairing(new_config, new_params, start)
    assert back_config == config
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_same_pairing_is_a_no_op_and_unknown_is_an_error():
    params = init_params(SMALL)
    assert with_rope_pairing(SMALL, params, "split_half") == (SMALL, params)
    with pytest.raises(ValueError, match=r"pairing must be one of \(.split_half., .interleaved.\) \(got .adjacent.\)"):
        with_rope_pairing(SMALL, params, "adjacent")


def test_layers_whose_q_is_not_all_rope_keep_their_pairing():
    """An output gate's channels (in `wq` after q's) and partial rotary's passed channels are no pair of
    RoPE's: permuting them would change the model, so the move is refused, naming the layer."""
    config = filled_layers(SMALL.replace(rope_pairing="interleaved"))
    gated = config.replace(layers=config.layers[:2] + (dataclasses.replace(
        config.layers[2], mixer=dataclasses.replace(config.layers[2].mixer, output_gate=True)),))
    with pytest.raises(ValueError, match=r"config.layers\[2\]: a mixer other than attention rotating all"):
        with_rope_pairing(gated, {}, "split_half")
