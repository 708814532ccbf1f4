import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    GEMMA4_DECODING,
    REORDERED,
    SMALL,
    count_compiles,
    float64_config,
    in_float64,
    jit_apply,
    random_params,
    tiny_gemma4,
    with_experts,
)

from jaxformer import Decoder, DecoderConfig, generate, sample_token, stream
from jaxformer.decoding import DecodeRequest, finish, start
from jaxformer.decoding.sampling import check_top_p, filtered_logits
from jaxformer.decoding.steps import prefill, step_fn
from jaxformer.experts import ROUTER_COLLECTION, ExpertsSpec

MODEL = Decoder(SMALL)
# Large random weights: greedy continuations vary instead of repeating one token.
@functools.cache
def model_params():
    """The model's parameters, drawn at their first use rather than at import (each pytest-xdist
    worker imports every test module)."""
    return random_params(SMALL, seed=11, scale=0.3)


def _prompt(seed, shape):
    return jax.random.randint(jax.random.key(seed), shape, 0, SMALL.vocab_size)


def _slow_greedy(params, prompt, n_new):
    """No cache: every step runs the whole sequence again and takes the argmax at its end.
    The sequence is padded to its final length so one compiled forward serves every
    step; causality (tested in test_decoder) makes the padding invisible."""
    total = prompt.shape[1] + n_new
    forward = jax.jit(lambda t: MODEL.apply({"params": params}, t)[0])
    seq = np.zeros((prompt.shape[0], total), np.int32)
    seq[:, :prompt.shape[1]] = prompt
    for t in range(prompt.shape[1], total):
        seq[:, t] = np.asarray(forward(jnp.asarray(seq)))[:, t - 1].argmax(-1)
    return seq


def test_greedy_equals_recompute_the_prefix_loop():
    prompt = _prompt(0, (3, 7))
    out = generate(MODEL, model_params(), prompt, max_new_tokens=40)
    chex.assert_shape(out, (3, 47))
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :7], prompt)
    np.testing.assert_array_equal(out, _slow_greedy(model_params(), np.asarray(prompt), 40))
    assert len(np.unique(np.asarray(out[:, 7:]))) > 5  # a varied continuation, not one repeated token


# (The two tests below run the greedy test's shapes, prompts [3, 7] and 40 new tokens: its program.)


def test_rows_stop_at_eos_and_then_pad():
    prompt = _prompt(0, (3, 7))
    free = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=40))
    eos = int(free[0, 7 + 5])  # a token row 0 emits at its 6th step (or earlier)
    out = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=40, eos_id=eos, pad_id=1))
    for row_free, row in zip(free[:, 7:], out[:, 7:]):
        hits = np.flatnonzero(row_free == eos)
        stop = hits[0] if hits.size else len(row_free)
        np.testing.assert_array_equal(row[:stop + 1], row_free[:stop + 1])  # identical up to and with EOS
        np.testing.assert_array_equal(row[stop + 1:], 1)  # then padding
    assert np.flatnonzero(out[0, 7:] == eos)[0] <= 5


def test_several_eos_ids_stop_a_row_at_the_first_of_any():
    prompt = _prompt(0, (3, 7))
    free = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=40))[:, 7:]
    eos = [int(free[1, 3]), int(free[0, 6])]  # row 1 emits the first by its 4th step, row 0 the second by its 7th
    out = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=40, eos_id=eos, pad_id=1))[:, 7:]
    for row_free, row in zip(free, out):
        hits = np.flatnonzero(np.isin(row_free, eos))
        stop = hits[0] if hits.size else len(row_free)
        np.testing.assert_array_equal(row[:stop + 1], row_free[:stop + 1])
        np.testing.assert_array_equal(row[stop + 1:], 1)
    assert np.isin(out[1, :4], eos).any() and np.isin(out[0, :7], eos).any()
    # One EOS given as a list of one is that EOS.
    np.testing.assert_array_equal(generate(MODEL, model_params(), prompt, max_new_tokens=40, eos_id=[eos[0]]),
                                  generate(MODEL, model_params(), prompt, max_new_tokens=40, eos_id=eos[0]))


@pytest.mark.parametrize("kwargs", [
    dict(),  # greedy
    dict(temperature=[1.0, 0.0, 2.0], top_k=[5, 64, 64], top_p=[1.0, 1.0, 0.8], key=jax.random.key(9)),
    dict(eos_id=41),  # every row's greedy continuation of this prompt emits 41 within 12 steps
])
def test_stream_yields_what_generate_returns(kwargs):
    prompt = _prompt(6, (3, 5))
    want = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=16, **kwargs))[:, 5:]
    steps = list(stream(MODEL, model_params(), prompt, max_new_tokens=16, **kwargs))
    assert all(t.shape == (3,) and t.dtype == np.int32 for t in steps)
    got = np.stack(steps, axis=1)  # [batch, steps taken]
    np.testing.assert_array_equal(got, want[:, :got.shape[1]])
    if "eos_id" in kwargs:  # stopped once every row was done; generate padded the rest
        assert got.shape[1] <= 12 and np.all(want[:, got.shape[1]:] == 0)
        assert all((row == 41).any() for row in got)
    else:
        assert got.shape[1] == 16


@pytest.mark.parametrize("kwargs", [
    dict(),  # greedy
    dict(temperature=[1.0, 0.0, 2.0], top_k=[5, 64, 64], top_p=[1.0, 1.0, 0.8], key=jax.random.key(9)),
    dict(eos_id=41),
])
def test_start_then_finish_is_generate(kwargs):
    prompt = _prompt(6, (3, 5))
    want = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=16, **kwargs))[:, 5:]
    request = DecodeRequest.create(MODEL, prompt, max_new_tokens=16, **kwargs)
    state = start(MODEL, model_params(), request)
    np.testing.assert_array_equal(finish(MODEL, model_params(), request, state)[0], want)


def test_stream_compiles_its_step_once():
    prompt = _prompt(4, (3, 5))  # (the shapes of the tests above: their programs, where they ran first)
    list(stream(MODEL, model_params(), prompt, max_new_tokens=16))
    with count_compiles() as compiles:
        steps = list(stream(MODEL, model_params(), _prompt(5, (3, 5)), max_new_tokens=16, temperature=0.5,
                            key=jax.random.key(1)))
    assert len(steps) == 16 and compiles == []


def test_ragged_batch_decodes_each_row_as_if_alone():
    lengths = [3, 7, 5]  # (the batch of the greedy test's shapes, prompts [3, 7] and 40 new tokens: its program)
    rows = [np.asarray(_prompt(10 + i, (1, n)))[0] for i, n in enumerate(lengths)]
    prompt = np.full((3, 7), -7, np.int32)  # right-padded; the filler is ignored, even if not an id
    for b, row in enumerate(rows):
        prompt[b, :len(row)] = row
    out = np.asarray(generate(MODEL, model_params(), prompt, max_new_tokens=40, prompt_lengths=lengths))
    chex.assert_shape(out, (3, 7 + 40))
    np.testing.assert_array_equal(out[:, :7], prompt)  # the prompt as given, then the new tokens
    for b, row in enumerate(rows):
        alone = np.asarray(generate(MODEL, model_params(), row[None], max_new_tokens=40))[0, len(row):]
        np.testing.assert_array_equal(out[b, 7:], alone)
    streamed = np.stack(list(stream(MODEL, model_params(), prompt, max_new_tokens=40, prompt_lengths=lengths)), axis=1)
    np.testing.assert_array_equal(streamed, out[:, 7:])


def test_one_new_token_and_full_capacity():
    prompt = _prompt(1, (2, 63))
    out = generate(MODEL, model_params(), prompt, max_new_tokens=1)  # prompt + new == max_seq_len
    np.testing.assert_array_equal(out, _slow_greedy(model_params(), np.asarray(prompt), 1))


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    prompt = _prompt(2, (3, 7))  # (the greedy test's shapes: its program)
    greedy = generate(MODEL, model_params(), prompt, max_new_tokens=40)
    top1 = generate(MODEL, model_params(), prompt, max_new_tokens=40, temperature=1.5, top_k=1, key=jax.random.key(0))
    np.testing.assert_array_equal(top1, greedy)
    a = generate(MODEL, model_params(), prompt, max_new_tokens=40, temperature=1.0, key=jax.random.key(1))
    b = generate(MODEL, model_params(), prompt, max_new_tokens=40, temperature=1.0, key=jax.random.key(1))
    c = generate(MODEL, model_params(), prompt, max_new_tokens=40, temperature=1.0, key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, greedy)


def _draw(probs, n=20000, temperature=1.0, top_k=None, top_p=1.0, seed=3):
    """n samples from logits log(probs), one row each, all rows with the same knobs."""
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (n, len(probs)))
    knob = lambda v, dtype: jnp.full((n,), v, dtype)  # noqa: E731
    tokens = sample_token(logits, jax.random.key(seed), knob(temperature, jnp.float32),
                          knob(len(probs) if top_k is None else top_k, jnp.int32), knob(top_p, jnp.float32))
    chex.assert_shape(tokens, (n,))
    assert tokens.dtype == jnp.int32
    return np.bincount(np.asarray(tokens), minlength=len(probs)) / n


def _assert_frequencies(freq, p, n=20000):
    sigma = np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(freq - p) < 5 * sigma + 1e-4), (freq, p)


def test_sample_token_frequencies_follow_softmax_over_temperature():
    logits = np.array([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    for temperature in (0.5, 2.0):
        freq = _draw(np.exp(logits), temperature=temperature)  # log(exp(x)) = x
        _assert_frequencies(freq, np.asarray(jax.nn.softmax(logits / temperature)))


def test_top_k_keeps_only_the_k_largest():
    probs = np.array([0.3, 0.2, 0.1, 0.05, 0.25, 0.1])
    freq = _draw(probs, temperature=10.0, top_k=3)
    assert set(np.flatnonzero(freq)) == {0, 1, 4}  # all of the top 3, nothing else
    tempered = np.where(np.isin(np.arange(6), [0, 1, 4]), probs ** (1 / 10.0), 0.0)  # softmax(log p / T) on the top 3
    _assert_frequencies(freq, tempered / tempered.sum())


def test_top_p_keeps_exactly_the_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    for top_p, nucleus in [(0.5, {0}), (0.75, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})]:
        freq = _draw(probs, top_p=top_p)
        assert set(np.flatnonzero(freq)) == nucleus, (top_p, freq)
        kept = np.array([probs[i] if i in nucleus else 0.0 for i in range(4)])
        _assert_frequencies(freq, kept / kept.sum())  # renormalised over the nucleus


def test_top_p_applies_to_the_top_k_distribution():
    """HF's order: top-k first, then the nucleus of the renormalised top k."""
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    # Renormalised over the top 3, tokens 0 and 1 hold 0.78 >= 0.75: token 2 is out (over the
    # whole distribution they would hold 0.7 and token 2 would stay).
    assert set(np.flatnonzero(_draw(probs, top_k=3, top_p=0.75))) == {0, 1}
    assert set(np.flatnonzero(_draw(probs, top_p=0.75))) == {0, 1, 2}


def test_temperature_to_zero_is_greedy_and_knobs_are_per_row():
    logits = jax.random.normal(jax.random.key(5), (6, 50)) * 3
    greedy = np.asarray(jnp.argmax(logits, -1))
    near_zero = sample_token(logits, jax.random.key(6), jnp.full((6,), 1e-4), jnp.full((6,), 50), jnp.ones(6))
    np.testing.assert_array_equal(near_zero, greedy)
    # Rows 0-2 greedy, rows 3-5 hot: one call, per-row temperatures.
    temperature = jnp.array([0.0, 0.0, 0.0, 50.0, 50.0, 50.0])
    draws = np.stack([np.asarray(sample_token(logits, jax.random.key(i), temperature, jnp.full((6,), 50), jnp.ones(6)))
                      for i in range(20)])
    np.testing.assert_array_equal(draws[:, :3], np.broadcast_to(greedy[:3], (20, 3)))
    assert all(len(np.unique(draws[:, r])) > 3 for r in range(3, 6))
    # Per-row top-k: row 0 may only take its argmax.
    top_k = jnp.array([1, 50, 50, 50, 50, 50])
    hot = jnp.full((6,), 50.0)
    firsts = [int(sample_token(logits, jax.random.key(i), hot, top_k, jnp.ones(6))[0]) for i in range(20)]
    assert set(firsts) == {int(greedy[0])}


def test_sample_token_called_eagerly_compiles_once_per_shape():
    """A token-by-token loop in Python (a reader's own decoding loop) calls it once a step: its
    cond's branches are new closures each call, so without its own jit each call would compile
    again, and every program compiled stays mapped in the process."""
    logits, knobs = jax.random.normal(jax.random.key(5), (3, 50)), (jnp.ones(3), jnp.full((3,), 5), jnp.ones(3))
    inputs = [(logits * i, jax.random.key(i)) for i in range(5)]
    sample_token(*inputs[0], *knobs)
    with count_compiles() as compiles:
        for step_logits, key in inputs[1:]:
            sample_token(step_logits, key, *knobs)
    assert compiles == []
    with count_compiles() as compiles:  # the guard can fail: a new shape does compile
        sample_token(logits[:2], jax.random.key(0), *(knob[:2] for knob in knobs))
    assert compiles


@pytest.mark.parametrize("temperature", [1e-30, 2e-38, 1.2e-38])
def test_a_temperature_whose_scaled_logits_pass_float32_is_still_greedy(temperature):
    """Logits of hundreds over a temperature near float32's smallest number pass its range
    (300 / 2e-38 = 1.5e40): scaled as they are they would be inf and the softmax NaN. The
    row's largest logit comes off first, so the likeliest token stays the one drawn."""
    logits = jnp.array([[10.0, 300.0, 200.0, -100.0], [-50.0, 20.0, 400.0, 399.0]])
    draws = [np.asarray(sample_token(logits, jax.random.key(i), jnp.full((2,), temperature, jnp.float32),
                                     jnp.full((2,), 4), jnp.full((2,), 0.9))) for i in range(16)]
    np.testing.assert_array_equal(np.stack(draws), np.broadcast_to([1, 2], (16, 2)))


def test_a_top_p_below_float32s_smallest_number_keeps_the_likeliest_token():
    """p = 1e-300 is in (0, 1] but float32 holds it as 0, which no token's predecessors are
    below: it is kept as float32's smallest normal number, the top token alone, as any p that
    small keeps."""
    assert check_top_p(1e-300) == np.finfo(np.float32).tiny
    assert check_top_p([0.5, 1e-300]).tolist() == [0.5, np.finfo(np.float32).tiny]
    probs = np.array([0.2, 0.5, 0.3])
    assert set(np.flatnonzero(_draw(probs, top_p=float(check_top_p(1e-300))))) == {1}


def test_new_prompt_or_knob_values_do_not_recompile():
    prompt = _prompt(5, (3, 7))
    generate(MODEL, model_params(), prompt, max_new_tokens=40)  # compiles once (or the tests above did: their shapes)
    other_prompt = _prompt(6, (3, 7))
    key = jax.random.key(7)
    with count_compiles() as compiles:
        generate(MODEL, model_params(), other_prompt, max_new_tokens=40)
        generate(MODEL, model_params(), other_prompt, max_new_tokens=40, temperature=0.7, key=key)
        generate(MODEL, model_params(), prompt, max_new_tokens=40, temperature=1.3, top_k=5, key=key)
        generate(MODEL, model_params(), prompt, max_new_tokens=40, temperature=[0.0, 0.9, 0.4], top_k=[3, 64, 10],
                 top_p=[0.9, 0.5, 1.0], key=key, eos_id=3)
    assert compiles == []
    with count_compiles() as compiles:  # the guard can fail: a new shape does compile
        generate(MODEL, model_params(), prompt, max_new_tokens=41)
    assert compiles


@pytest.mark.parametrize("prompt, kwargs, match", [
    (np.zeros((2, 60), np.int32), dict(max_new_tokens=5),
     r"prompt length \+ max_new_tokens: 60 \+ 5 = 65 .*max_seq_len=64"),
    (np.full((2, 3), 64), dict(max_new_tokens=5), r"prompt holds ids outside \[0, vocab_size=64\)"),
    (np.array([[1, -2, 3]]), dict(max_new_tokens=5), r"prompt holds ids outside"),
    (np.zeros((2, 3), np.float32), dict(max_new_tokens=5), "integer"),
    (np.zeros((3,), np.int32), dict(max_new_tokens=5), "2-D"),
    (np.zeros((2, 0), np.int32), dict(max_new_tokens=5), "at least one token"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=0), "max_new_tokens"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=-0.1), "temperature"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=float("nan")), "temperature"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=1.0, top_k=0, key=jax.random.key(0)), "top_k"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=1.0, top_k=65, key=jax.random.key(0)), "top_k"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=1.0), "key is required"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=[0.0, 1.0]), "key is required"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=[0.5, -1.0]), "temperature must be >= 0"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, temperature=[0.5, 0.5, 0.5]), "one value per row"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, top_k=2.5), "top_k"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, top_p=0.0), r"top_p must be None or in \(0, 1\]"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, top_p=1.5), "top_p"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, eos_id=64), "eos_id"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, prompt_lengths=[0, 3]),
     r"prompt_lengths must be ints in \[1, prompt_len=3\]"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, prompt_lengths=[2, 4]), "prompt_lengths"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, prompt_lengths=[2, 2, 2]), "one value per row"),
    (np.zeros((2, 3), np.int32), dict(max_new_tokens=5, prompt_lengths=[2.5, 3]), "prompt_lengths must be ints"),
    (np.array([[1, 99, 0], [1, 2, 3]]), dict(max_new_tokens=5, prompt_lengths=[2, 3]), "prompt holds ids outside"),
])
def test_bad_input_is_rejected_before_jit(prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(MODEL, model_params(), prompt, **kwargs)


def test_sample_token_with_a_key_per_row_draws_each_row_from_its_own_distribution():
    """A key per row (a server's requests, each with its seed): frequencies are the filtered
    softmax, and a row's draw does not move when the other rows' keys do."""
    logits = jax.random.normal(jax.random.key(0), (3, 6)) * 2  # [rows, vocab]
    temperature, top_k, top_p = jnp.array([0.7, 1.0, 0.0]), jnp.array([6, 3, 6]), jnp.array([1.0, 1.0, 1.0])
    draws = 20000
    keys = jax.random.split(jax.random.key(1), (draws, 3))  # [draws, rows]
    tokens = jax.vmap(lambda k: sample_token(logits, k, temperature, top_k, top_p))(keys)  # [draws, rows]
    want = jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1)  # [rows, vocab]
    for r in range(2):
        freq = np.bincount(np.asarray(tokens[:, r]), minlength=6) / draws
        np.testing.assert_allclose(freq, want[r], atol=0.015)  # ~4 standard errors at 20000 draws
    assert np.all(np.asarray(tokens[:, 2]) == int(jnp.argmax(logits[2])))  # temperature 0: the argmax
    # Row 0's draw depends on row 0's key alone: changing the other rows' keys changes nothing.
    other = keys.at[:, 1:].set(jax.random.split(jax.random.key(2), (draws, 2)))
    again = jax.vmap(lambda k: sample_token(logits, k, temperature, top_k, top_p))(other)
    np.testing.assert_array_equal(again[:, 0], tokens[:, 0])


# A mixture of experts: 2 layers, each routing a token to 2 of 4 gated MLPs 16 wide (Qwen3-MoE's rule: the
# softmax's top 2, renormalised), dropless.
MOE = with_experts(DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64),
                   ExpertsSpec(4, 2, 16))


@functools.cache
def moe_params():
    return random_params(MOE, seed=11, scale=0.3)


def _ragged(lengths, width, seed):
    """Rows of `lengths` random ids, right-padded with -7 (never read) to `width`."""
    prompt = np.full((len(lengths), width), -7, np.int32)
    for b, n in enumerate(lengths):
        prompt[b, :n] = np.asarray(_prompt(seed + b, (1, n)))[0]
    return prompt


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_mixture_of_experts_cached_steps_give_the_full_forwards_logits(sampled):
    """Ragged prompts of 4 and 9 tokens, 12 new tokens each, greedy or sampled at temperature 1: the
    logits each new token was picked from (the prefill's at the row's last prompt token, then a cached
    step a token) are those of one forward of the whole rows, teacher-forced; greedy's tokens are their
    argmax. (The prefill routes the padding too, and each step one token a row: dropless, none of it
    changes a real token's experts.)"""
    assert_cached_steps_give_the_full_forwards_logits(Decoder(MOE), moe_params(), sampled)


@pytest.mark.parametrize("name", GEMMA4_DECODING)
def test_gemma_4_sampled_steps_give_the_full_forwards_logits(name):
    """The same on Gemma 4's tiny E2B (per-layer inputs; its last two layers read the keys and values of
    the layers before them, from the cache at each step; `conftest.GEMMA4_DECODING`), the
    rows past their sliding layers' ring of 8: sampled at temperature 1, each token was drawn from the
    logits the full forward gives at its position."""
    assert_cached_steps_give_the_full_forwards_logits(*tiny_gemma4(name), sampled=True)


def assert_cached_steps_give_the_full_forwards_logits(model, params, sampled: bool):
    """The tests above: `generate`'s tokens, then the logits they were picked from, recomputed by the
    prefill and a cached step a token, against one teacher-forced forward of the whole rows."""
    lengths = [4, 9]
    prompt = _ragged(lengths, 9, seed=30)
    options = dict(max_new_tokens=12, prompt_lengths=lengths)
    if sampled:
        options.update(temperature=1.0, key=jax.random.key(5))
    new = np.asarray(generate(model, params, prompt, **options))[:, 9:]  # [2, 12]
    request = DecodeRequest.create(model, prompt, **options)
    _, logits, cache = jax.jit(functools.partial(prefill, model))(params, request)
    step = jax.jit(lambda params, tokens, cache: step_fn(model, params, None)(tokens, cache))
    cached = [logits]
    for t in range(11):  # (the 12th token is never fed back)
        logits, cache = step(params, jnp.asarray(new[:, t:t + 1]), cache)
        cached.append(logits[:, 0])
    cached = np.stack(cached, axis=1)  # [2, 12, vocab]
    rows = np.zeros((2, 9 + 12), np.int32)  # each row's prompt and new tokens, then padding
    for b, n in enumerate(lengths):
        rows[b, :n + 12] = np.concatenate([prompt[b, :n], new[b]])
    full = np.asarray(jit_apply(model, {"params": params}, jnp.asarray(rows))[0])
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(cached[b], full[b, n - 1:n + 11], rtol=1e-5, atol=1e-5)
    picked_best = cached.argmax(-1) == new
    assert picked_best.all() if not sampled else not picked_best.all()
    assert len(np.unique(new)) > 5


def test_a_row_of_a_mixture_of_experts_decodes_alone_as_in_a_batch():
    """Dropless routing: a token's experts are its own router's choice, whatever the other rows
    choose. Row 0 (7 tokens) alone and in a ragged batch of 3 (9, 5) whose rows spread their tokens
    over the experts otherwise: in every layer the same experts for each of its tokens, the same
    logits to float32's rounding, the same 20 greedy tokens; so too rows 1 and 2.

    Not bitwise: the two calls are programs of other shapes, whose float32 sums XLA orders
    otherwise (the dense model's do too, on a CPU: its row alone and in a batch differ in the last
    bits), and the experts' grouped product takes blocks of rows sized by the call's tokens
    (`grouped.block_size`). So the logits are compared within conftest's bound for two such programs
    (`REORDERED` times the row's float32 error against its float64 twin, twice). With a capacity
    (`capacity_factor`), the batch's tokens crowd the row's out of their experts: its logits move by
    whole units, which the comparison would catch."""
    lengths = [7, 9, 5]
    batch = _ragged(lengths, 9, seed=40)
    alone = batch[:1, :7]
    model, params = Decoder(MOE), moe_params()
    (mine, _), sown_alone = jit_apply(model, {"params": params}, jnp.asarray(alone), mutable=ROUTER_COLLECTION)
    filled = np.where(batch < 0, 0, batch)
    (theirs, _), sown_batch = jit_apply(model, {"params": params}, jnp.asarray(filled), mutable=ROUTER_COLLECTION)
    for i in range(MOE.n_layer):
        ids_alone, ids_batch = (np.asarray(jax.lax.top_k(sown[ROUTER_COLLECTION][f"block_{i}"]["mlp"]["logits"][0],
                                                         2)[1]) for sown in (sown_alone, sown_batch))
        np.testing.assert_array_equal(ids_batch[0, :7], ids_alone[0])  # the same experts, token by token
        load = [np.bincount(ids_batch[b, :n].reshape(-1), minlength=4) / n for b, n in enumerate(lengths)]
        assert not np.allclose(load[1], load[0]) and not np.allclose(load[2], load[0])  # the others route elsewhere
    model64 = Decoder(float64_config(MOE))
    mine64 = in_float64(lambda params, tokens: model64.apply({"params": params}, tokens)[0], params, alone)
    bound = 2 * REORDERED * float(np.abs(np.asarray(mine, np.float64) - mine64).max())
    assert bound <= 1e-4 * float(np.abs(mine64).max())  # float32's rounding, not another result
    np.testing.assert_allclose(theirs[0, :7], mine[0], rtol=0, atol=bound)

    crowded = MOE.replace(layers=tuple(dataclasses.replace(spec, ffn=dataclasses.replace(spec.ffn, capacity_factor=1.0))
                                       for spec in MOE.layers))
    capped = [jit_apply(Decoder(crowded), {"params": params}, jnp.asarray(tokens))[0] for tokens in (alone, filled)]
    assert np.abs(capped[1][0, :7] - capped[0][0]).max() > 100 * bound

    options = dict(max_new_tokens=20)
    together = np.asarray(generate(model, params, batch, prompt_lengths=lengths, **options))[:, 9:]
    for b, n in enumerate(lengths):  # (each row alone padded to 9: one program for the three)
        padded = np.where(np.arange(9) < n, batch[b], -7)[None]
        np.testing.assert_array_equal(
            np.asarray(generate(model, params, padded, prompt_lengths=[n], **options))[0, 9:], together[b])
    assert len(np.unique(together)) > 5
