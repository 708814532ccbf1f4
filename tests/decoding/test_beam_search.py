"""Beam search on fixed next-token tables (right answer known) and on a real model."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from conftest import GEMMA4_DECODING, SMALL, jit_apply, random_params, tiny_gemma4, with_experts

from jaxformer import Decoder, DecoderConfig, KVCache, VanillaConfig, VanillaTransformer, generate
from jaxformer.decoding.beam import beam_search, gather_beams, length_norm
from jaxformer.experts import ExpertsSpec

EOS, PAD = 0, 9


def _table_step(table):
    """A fake model: the next token's log-probabilities depend only on the last token.
    The cache counts the steps each beam has taken, so a wrong beam gather shows."""
    table = jnp.log(jnp.asarray(table, jnp.float32))  # [vocab, vocab]: row = last token

    def step(tokens, cache):
        return table[tokens[:, 0]][:, None, :], {"steps": cache["steps"] + 1}

    return step


def _search(first, table, num_beams, max_new_tokens, length_penalty=0.0, eos=EOS, batch=1):
    step = _table_step(table)
    logits = jnp.tile(jnp.log(jnp.asarray(first, jnp.float32)), (batch * num_beams, 1))
    cache = {"steps": jnp.zeros((batch * num_beams,), jnp.int32)}
    return beam_search(step, logits, cache, num_beams=num_beams, max_new_tokens=max_new_tokens, eos_id=jnp.int32(eos),
                       pad_id=jnp.int32(PAD), length_penalty=length_penalty)


# Tokens: 0 = EOS, 1 = A, 2 = B, 3..5 = C, D, E. After A the next token is spread out;
# after B it is almost certainly C.
FIRST = [1e-6, 0.6, 0.4, 1e-6, 1e-6, 1e-6]
TABLE = np.full((6, 6), 1e-6)
TABLE[1, 3:6] = [0.4, 0.3, 0.3]  # A -> C, D, E
TABLE[2, 3] = 0.99  # B -> C
TABLE[3:6, 1] = 0.99  # C, D, E -> A
TABLE[0, 0] = 1.0
TABLE /= TABLE.sum(1, keepdims=True)


def test_beam_finds_what_greedy_misses():
    greedy, _ = _search(FIRST, TABLE, num_beams=1, max_new_tokens=2)
    np.testing.assert_array_equal(greedy, [[1, 3]])  # A (0.6), then C (0.4): p = 0.24
    beam, score = _search(FIRST, TABLE, num_beams=2, max_new_tokens=2)
    np.testing.assert_array_equal(beam, [[2, 3]])  # B (0.4), then C (0.99): p = 0.396
    first = np.asarray(FIRST) / np.sum(FIRST)  # (the model's softmax normalises the first step)
    np.testing.assert_allclose(score, [np.log(first[2] * TABLE[2, 3])], rtol=1e-5)
    chex.assert_shape(beam, (1, 2))


def test_length_penalty_decides_between_short_and_long():
    # First step: EOS right away (p 0.45), or A (0.55) followed by a likely tail A -> C -> EOS.
    first = [0.45, 0.55, 1e-6, 1e-6, 1e-6, 1e-6]
    table = np.full((6, 6), 1e-6)
    table[1, 3:5] = [0.8, 0.2]  # A -> C or D
    table[3, [0, 5]] = [0.8, 0.2]  # C -> EOS or E
    table[0, 0] = 1.0
    table /= table.sum(1, keepdims=True)
    first = np.asarray(first) / np.sum(first)
    short_logp = np.log(first[0])
    long_logp = np.log(first[1] * table[1, 3] * table[3, 0])  # A C EOS
    assert long_logp < short_logp  # raw log-probability prefers stopping at once
    tokens, score = _search(first, table, num_beams=2, max_new_tokens=4, length_penalty=0.0)
    np.testing.assert_array_equal(tokens, [[EOS, PAD, PAD, PAD]])
    np.testing.assert_allclose(score, [short_logp], rtol=1e-5)
    length_penalty = 3.0  # long enough outputs win once lengths are normalised
    assert long_logp / float(length_norm(3, length_penalty)) > short_logp / float(length_norm(1, length_penalty))
    tokens, score = _search(first, table, num_beams=2, max_new_tokens=4, length_penalty=length_penalty)
    np.testing.assert_array_equal(tokens, [[1, 3, EOS, PAD]])
    np.testing.assert_allclose(score, [long_logp / float(length_norm(3, length_penalty))], rtol=1e-5)


def test_length_norm_formula():
    np.testing.assert_allclose(length_norm(jnp.arange(1, 4), 0.6), ((5 + np.arange(1, 4)) / 6) ** 0.6, rtol=1e-6)
    np.testing.assert_array_equal(length_norm(jnp.arange(1, 4), 0.0), 1.0)


def test_gather_beams_moves_each_beam_within_its_row():
    tree = {"x": jnp.arange(6) * 10, "shared": jnp.int32(7), "y": jnp.arange(12).reshape(6, 2)}
    out = gather_beams(tree, jnp.array([[2, 2, 0], [1, 0, 0]]), num_beams=3)
    np.testing.assert_array_equal(out["x"], [20, 20, 0, 40, 30, 30])
    np.testing.assert_array_equal(out["y"][:, 0], [4, 4, 0, 8, 6, 6])
    assert int(out["shared"]) == 7


MODEL = Decoder(SMALL)
@functools.cache
def model_params():
    """The model's parameters, drawn at their first use rather than at import (each pytest-xdist
    worker imports every test module)."""
    return random_params(SMALL, seed=11, scale=0.3)


def _prefilled(prompt, num_beams, max_new_tokens, model=MODEL, params=None):
    prompt = jnp.repeat(prompt, num_beams, axis=0)
    cache = KVCache.create(model.config, prompt.shape[0], capacity=prompt.shape[1] + max_new_tokens - 1)
    logits, cache = jit_apply(model, {"params": params or model_params()}, prompt, cache)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnames=("num_beams", "max_new_tokens", "model"))
def _model_beam_search(params, logits, cache, eos_id, *, num_beams, max_new_tokens, model=MODEL):
    """`beam_search` over the model's cached steps (MODEL's, unless given), jitted once per shape
    (the EOS traced)."""
    def step(tokens, cache):
        return jit_apply(model, {"params": params}, tokens, cache)

    return beam_search(step, logits, cache, num_beams=num_beams, max_new_tokens=max_new_tokens, eos_id=eos_id,
                       pad_id=jnp.int32(PAD), length_penalty=0.0)


def _log_prob(out, prompt_len, model=MODEL, params=None):
    """float64 log p of each row's tokens after `prompt_len` under the full forward of `out`."""
    logits = np.asarray(jit_apply(model, {"params": params or model_params()}, jnp.asarray(out))[0], np.float64)
    logits = logits[:, prompt_len - 1:-1]
    logp = logits - scipy.special.logsumexp(logits, axis=-1, keepdims=True)  # predictions of the new tokens
    return np.take_along_axis(logp, np.asarray(out)[:, prompt_len:, None], axis=-1).sum(axis=(1, 2))


@pytest.mark.parametrize("eos", [-1, "emitted"])
def test_one_beam_is_greedy_on_a_real_model(eos):
    prompt = jax.random.randint(jax.random.key(0), (3, 7), 0, SMALL.vocab_size)
    greedy = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=20))[:, 7:]
    if eos == "emitted":
        eos = int(greedy[1, 6])
    want = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=20, eos_id=None if eos == -1 else eos,
                               pad_id=PAD))[:, 7:]
    logits, cache = _prefilled(prompt, 1, 20)
    tokens, _ = _model_beam_search(model_params(), logits, cache, jnp.int32(eos), num_beams=1, max_new_tokens=20)
    np.testing.assert_array_equal(tokens, want)


def test_beam_score_is_the_sequence_log_probability():
    """The score equals log p of the returned tokens under an independent full forward."""
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, SMALL.vocab_size)
    out = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=10, num_beams=4))
    chex.assert_shape(out, (2, 15))
    np.testing.assert_array_equal(out[:, :5], prompt)
    logits, cache = _prefilled(prompt, 4, 10)
    tokens, score = _model_beam_search(model_params(), logits, cache, jnp.int32(-1), num_beams=4, max_new_tokens=10)
    np.testing.assert_array_equal(tokens, out[:, 5:])
    np.testing.assert_allclose(score, _log_prob(out, 5), atol=1e-4, rtol=1e-5)
    greedy = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=10))
    assert np.all(np.asarray(score) >= _log_prob(greedy, 5) - 1e-5)  # no worse than greedy here


# A mixture of experts: each layer routes a token to 2 of 4 gated MLPs, dropless.
MOE = with_experts(DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64),
                   ExpertsSpec(4, 2, 16))


def test_beam_search_on_a_mixture_of_experts():
    """On a model whose rows, and a row's beams once they part, route their tokens to experts of
    their own: 4 beams' tokens are generate's, their score the log-probability of those tokens under
    an independent full forward, no worse than greedy's."""
    model, params = Decoder(MOE), random_params(MOE, seed=11, scale=0.3)
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, MOE.vocab_size)
    greedy = np.asarray(generate(model, params, prompt, max_new_tokens=10))
    out = np.asarray(generate(model, params, prompt, max_new_tokens=10, num_beams=4))
    logits, cache = _prefilled(prompt, 4, 10, model, params)
    tokens, score = _model_beam_search(params, logits, cache, jnp.int32(-1), num_beams=4, max_new_tokens=10,
                                       model=model)
    np.testing.assert_array_equal(tokens, out[:, 5:])
    # (Greedy's tokens scored in the same program: the two runs have one shape.)
    log_probs = _log_prob(np.concatenate([out, greedy]), 5, model, params)
    np.testing.assert_allclose(score, log_probs[:2], atol=1e-4, rtol=1e-5)
    assert np.all(np.asarray(score) >= log_probs[2:] - 1e-5)
    assert not np.array_equal(out, greedy)  # the beams found likelier tokens than greedy's


@pytest.mark.parametrize("name", GEMMA4_DECODING)
def test_beam_search_on_gemma_4(name):
    """Gemma 4's tiny E2B (per-layer inputs; its last two layers read the keys and values that the
    layers of their type before them keep; `conftest.GEMMA4_DECODING`), with a ring
    of 8 slots for its sliding layers: one beam is greedy; 4 beams' tokens are generate's, their
    score the log-probability of those tokens under an independent full forward, no worse than
    greedy's; and a ragged batch decoded by 3 beams (which reorder the rows of the caches the shared
    layers read) gives each prompt the tokens it gets alone."""
    model, params = tiny_gemma4(name)
    prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, model.config.vocab_size)
    greedy = np.asarray(generate(model, params, prompt, max_new_tokens=10))
    logits, cache = _prefilled(prompt, 1, 10, model, params)
    one, _ = _model_beam_search(params, logits, cache, jnp.int32(-1), num_beams=1, max_new_tokens=10, model=model)
    np.testing.assert_array_equal(one, greedy[:, 5:])
    out = np.asarray(generate(model, params, prompt, max_new_tokens=10, num_beams=4))
    logits, cache = _prefilled(prompt, 4, 10, model, params)
    tokens, score = _model_beam_search(params, logits, cache, jnp.int32(-1), num_beams=4, max_new_tokens=10,
                                       model=model)
    np.testing.assert_array_equal(tokens, out[:, 5:])
    log_probs = _log_prob(np.concatenate([out, greedy]), 5, model, params)  # (one program, as the MoE test's)
    np.testing.assert_allclose(score, log_probs[:2], atol=1e-4, rtol=1e-5)
    assert np.all(np.asarray(score) >= log_probs[2:] - 1e-5)
    assert not np.array_equal(out, greedy)  # the beams found likelier tokens than greedy's

    lengths = [3, 12]  # (each prompt alone right-padded to 12 as well: one program for the two)
    batch = np.asarray(jax.random.randint(jax.random.key(2), (2, 12), 0, model.config.vocab_size))
    options = dict(max_new_tokens=16, num_beams=3)
    together = np.asarray(generate(model, params, batch, prompt_lengths=lengths, **options))[:, 12:]
    for row, n in enumerate(lengths):
        alone = generate(model, params, np.where(np.arange(12) < n, batch[row], 0)[None], prompt_lengths=[n],
                         **options)
        np.testing.assert_array_equal(together[row], np.asarray(alone)[0, 12:])
    assert len(np.unique(together)) > 5


def test_encoder_decoder_beam_search_runs():
    vconfig = VanillaConfig(src_vocab_size=19, tgt_vocab_size=19, n_layer=1, d_model=32, d_ff=64, n_head=2,
                            max_seq_len=32, tie_embeddings=False)
    model = VanillaTransformer(vconfig)
    src = jax.random.randint(jax.random.key(2), (2, 6), 3, 19)
    params = jax.jit(model.init)(jax.random.key(3), src, src)["params"]
    out = generate(model, params, src, max_new_tokens=8, bos_id=1, eos_id=2, num_beams=3, length_penalty=0.6)
    chex.assert_shape(out, (2, 9))
    np.testing.assert_array_equal(out[:, 0], 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=2, temperature=0.5, key=jax.random.key(0)), "deterministic"),
    (dict(num_beams=2, top_k=3), "deterministic"),
    (dict(num_beams=2, length_penalty=-1.0), "length_penalty"),
])
def test_bad_beam_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(MODEL, model_params(), np.zeros((1, 3), np.int32), max_new_tokens=4, **kwargs)
