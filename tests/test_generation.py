import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, count_compiles, init_params, scaled_random_params

from jaxformer import Decoder, generate, sample_token

MODEL = Decoder(SMALL)
# Large random weights: greedy continuations vary instead of repeating one token.
PARAMS = scaled_random_params(init_params(SMALL), seed=11, scale=0.3)


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
    out = generate(MODEL, PARAMS, prompt, max_new_tokens=40)
    chex.assert_shape(out, (3, 47))
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :7], prompt)
    np.testing.assert_array_equal(out, _slow_greedy(PARAMS, np.asarray(prompt), 40))
    assert len(np.unique(np.asarray(out[:, 7:]))) > 5  # a varied continuation, not one repeated token


def test_rows_stop_at_eos_and_then_pad():
    prompt = _prompt(0, (3, 7))
    free = np.asarray(generate(MODEL, PARAMS, prompt, max_new_tokens=20))
    eos = int(free[0, 7 + 5])  # a token row 0 emits at its 6th step (or earlier)
    out = np.asarray(generate(MODEL, PARAMS, prompt, max_new_tokens=20, eos_id=eos, pad_id=1))
    for row_free, row in zip(free[:, 7:], out[:, 7:]):
        hits = np.flatnonzero(row_free == eos)
        stop = hits[0] if hits.size else len(row_free)
        np.testing.assert_array_equal(row[:stop + 1], row_free[:stop + 1])  # identical up to and with EOS
        np.testing.assert_array_equal(row[stop + 1:], 1)  # then padding
    assert np.flatnonzero(out[0, 7:] == eos)[0] <= 5


def test_one_new_token_and_full_capacity():
    prompt = _prompt(1, (2, 63))
    out = generate(MODEL, PARAMS, prompt, max_new_tokens=1)  # prompt + new == max_seq_len
    np.testing.assert_array_equal(out, _slow_greedy(PARAMS, np.asarray(prompt), 1))


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    prompt = _prompt(2, (4, 5))
    greedy = generate(MODEL, PARAMS, prompt, max_new_tokens=20)
    top1 = generate(MODEL, PARAMS, prompt, max_new_tokens=20, temperature=1.5, top_k=1, key=jax.random.key(0))
    np.testing.assert_array_equal(top1, greedy)
    a = generate(MODEL, PARAMS, prompt, max_new_tokens=20, temperature=1.0, key=jax.random.key(1))
    b = generate(MODEL, PARAMS, prompt, max_new_tokens=20, temperature=1.0, key=jax.random.key(1))
    c = generate(MODEL, PARAMS, prompt, max_new_tokens=20, temperature=1.0, key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, greedy)


def test_sample_token_frequencies_follow_softmax_over_temperature():
    logits = jnp.array([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    n = 20000
    batch_logits = jnp.broadcast_to(logits, (n, 6))
    for temperature in (0.5, 2.0):
        tokens = sample_token(batch_logits, jax.random.key(3), jnp.float32(temperature), jnp.int32(6))
        freq = np.bincount(np.asarray(tokens), minlength=6) / n
        p = np.asarray(jax.nn.softmax(logits / temperature))
        sigma = np.sqrt(p * (1 - p) / n)
        assert np.all(np.abs(freq - p) < 5 * sigma + 1e-4), (temperature, freq, p)


def test_top_k_keeps_only_the_k_largest():
    logits = jnp.array([2.0, 1.0, 0.0, -1.0, 0.5, -3.0])
    tokens = sample_token(jnp.broadcast_to(logits, (5000, 6)), jax.random.key(4), jnp.float32(10.0), jnp.int32(3))
    chex.assert_shape(tokens, (5000,))
    assert tokens.dtype == jnp.int32
    assert set(np.unique(np.asarray(tokens)).tolist()) == {0, 1, 4}  # all of the top 3, nothing else
    greedy = sample_token(jnp.broadcast_to(logits, (3, 6)), jax.random.key(4), jnp.float32(0.0), jnp.int32(6))
    np.testing.assert_array_equal(greedy, [0, 0, 0])


def test_new_prompt_temperature_or_top_k_does_not_recompile():
    prompt = _prompt(5, (2, 6))
    generate(MODEL, PARAMS, prompt, max_new_tokens=8)  # compiles once
    other_prompt = _prompt(6, (2, 6))
    key = jax.random.key(7)
    with count_compiles() as compiles:
        generate(MODEL, PARAMS, other_prompt, max_new_tokens=8)
        generate(MODEL, PARAMS, other_prompt, max_new_tokens=8, temperature=0.7, key=key)
        generate(MODEL, PARAMS, prompt, max_new_tokens=8, temperature=1.3, top_k=5, key=key)
    assert compiles == []
    with count_compiles() as compiles:  # the guard can fail: a new shape does compile
        generate(MODEL, PARAMS, prompt, max_new_tokens=9)
    assert compiles


@pytest.mark.parametrize("prompt, kwargs, match", [
    (np.zeros((2, 60), np.int32), dict(max_new_tokens=5), r"prompt length \+ max_new_tokens: 60 \+ 5 = 65 .*max_seq_len=64"),
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
])
def test_bad_input_is_rejected_before_jit(prompt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(MODEL, PARAMS, prompt, **kwargs)
