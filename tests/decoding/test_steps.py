"""The serving engine's pieces of `decoding/steps.py`: a prompt prefilled in padded pieces
leaves the cache and logits `prefill` leaves, and `pick_rows` draws each row from its own key."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_params

from jaxformer import Decoder, DecoderConfig
from jaxformer.decoding import NO_TOKEN, DecodeRequest, Sampling
from jaxformer.decoding.steps import pick_rows, prefill, prefill_piece, step_fn

VOCAB = 64


@pytest.mark.parametrize("layer_types", [None, ("sliding", "full")])
def test_a_prompt_prefilled_in_padded_pieces_decodes_as_prefill_left_it(layer_types):
    """13 tokens as a piece of 8 and 5 padded to 8 (a sliding window of 6: the ring must not
    take the padding), then two steps: the same logits as after `prefill` of the whole prompt."""
    config = DecoderConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64,
                           layer_types=layer_types, sliding_window=layer_types and 6)
    model, params = Decoder(config), random_params(config, seed=4)
    prompt = np.arange(3, 16, dtype=np.int32)[None]  # [1, 13]
    request = DecodeRequest.create(model, prompt, max_new_tokens=8)
    _, want, cache = jax.jit(functools.partial(prefill, model))(params, request)

    piece = jax.jit(functools.partial(prefill_piece, model))
    pieces = model.init_cache(1, cache.capacity)
    _, pieces = piece(params, prompt[:, :8], pieces, np.int32(8))
    padded = np.concatenate([prompt[:, 8:], np.full((1, 3), 63, np.int32)], axis=1)  # 5 real, 3 of padding
    logits, pieces = piece(params, padded, pieces, np.int32(5))  # [1, 8, vocab]: the last real one is 4
    np.testing.assert_allclose(logits[:, 4], want, rtol=1e-5, atol=1e-5)
    assert int(pieces.pos[0]) == 13 and pieces.stop is None

    step = jax.jit(lambda params, tokens, cache: step_fn(model, params, None)(tokens, cache))
    for token in (7, 9):
        want, cache = step(params, jnp.array([[token]]), cache)
        logits, pieces = step(params, jnp.array([[token]]), pieces)
        np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_pick_rows_draws_each_row_from_its_own_key_and_token_index():
    logits = jax.random.normal(jax.random.key(0), (3, VOCAB)) * 2
    sampling = Sampling.create(3, VOCAB, temperature=[1.0, 1.0, 0.0], top_k=[50, VOCAB, 5])
    keys = jax.random.split(jax.random.key(1), 3)
    made = jnp.array([4, 0, 2], jnp.int32)
    tokens = np.asarray(pick_rows(sampling, keys, made, logits))
    for row in range(3):  # alone, with its key folded with its index: the same token
        alone = jax.tree.map(lambda x, row=row: x[row:row + 1], sampling)
        key = jax.random.fold_in(keys[row], made[row])
        assert tokens[row] == int(alone.pick(logits[row:row + 1], key[None])[0])
    assert tokens[2] == int(jnp.argmax(logits[2]))  # the greedy row

    # Other rows' keys and indices change nothing in row 0; its own index changes its draws.
    others = jax.random.split(jax.random.key(2), 3).at[0].set(keys[0])
    draws = [pick_rows(sampling, others, made.at[1:].set(i), logits)[0] for i in range(20)]
    assert {int(d) for d in draws} == {int(tokens[0])}
    own = {int(pick_rows(sampling, keys, made.at[0].set(i), logits)[0]) for i in range(20)}
    assert len(own) > 1  # (20 draws from a spread-out distribution: one token only if the index were ignored)

    broken = logits.at[1, 3].set(jnp.nan)
    assert np.asarray(pick_rows(sampling, keys, made, broken)).tolist() == [tokens[0], NO_TOKEN, tokens[2]]
