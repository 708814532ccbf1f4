"""Spans: a cached call reads the first `span` slots of the cache, the bucket holding the rows'
positions, and decodes what reading every slot of the capacity decodes (docs/decoding.md, "The span")."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_reordered_equal, count_compiles, float64_config, in_float64, random_params

from jaxformer import Decoder, DecoderConfig, generate, stream
from jaxformer.cache import span_for, spans
from jaxformer.decoding import DecodeOptions, DecodeRequest, PromptLookup
from jaxformer.decoding.front_door import advance, run, start
from jaxformer.decoding.steps import pick
from jaxformer.serving import Engine

# Long enough for three spans (256, 512, then the capacity), small enough for a CPU test.
CONFIG = DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=1024)
MODEL = Decoder(CONFIG)
@functools.cache
def model_params():
    """The model's parameters, drawn at their first use rather than at import (each pytest-xdist
    worker imports every test module)."""
    return random_params(CONFIG, seed=5)
LENGTHS = np.array([230, 170])  # a ragged batch: row 0 crosses 256 at its 27th new token, 512 at its 283rd
NEW = 300
PROMPT = np.where(np.arange(LENGTHS.max()) < LENGTHS[:, None],
                  np.asarray(jax.random.randint(jax.random.key(1), (2, LENGTHS.max()), 1, 64)), 0)


@jax.jit
def _full_step(params, tokens, cache):
    """A call that reads every slot of the capacity (no span): the reference."""
    return MODEL.apply({"params": params}, tokens, cache)


def _full_capacity_tokens(max_new_tokens: int, **sampling) -> np.ndarray:
    """`generate`'s new tokens by a Python loop of `_full_step`s, each token picked as generate picks it."""
    request = DecodeRequest.create(MODEL, PROMPT, max_new_tokens=max_new_tokens, prompt_lengths=LENGTHS, **sampling)
    cache = MODEL.init_cache(2, PROMPT.shape[1] + max_new_tokens - 1).replace(stop=jnp.asarray(LENGTHS, jnp.int32))
    logits, cache = _full_step(model_params(), jnp.asarray(PROMPT), cache)
    last = logits[np.arange(2), LENGTHS - 1]  # [batch, vocab]
    cache = cache.replace(pos=jnp.asarray(LENGTHS, jnp.int32), stop=None)
    done, made = jnp.zeros(2, bool), []
    for i in range(max_new_tokens):
        token, done = pick(request, i, last, done)
        made.append(np.asarray(token))
        if i + 1 < max_new_tokens:
            logits, cache = _full_step(model_params(), token[:, None], cache)
            last = logits[:, -1]
    return np.stack(made, axis=1)


@pytest.fixture(scope="module")
def greedy():
    return _full_capacity_tokens(NEW)


def test_spans_are_powers_of_two_from_256_then_the_capacity():
    assert spans(1000) == (256, 512, 1000) and spans(1024) == (256, 512, 1024)
    assert spans(100) == (100,) and spans(256) == (256,) and spans(257) == (256, 257)
    assert [span_for(n, 1000) for n in (1, 256, 257, 512, 513, 1000, 5000)] == [256, 256, 512, 512, 1000, 1000, 1000]
    assert span_for(10, 100) == 100  # a short cache is read whole


def test_greedy_tokens_across_three_spans_are_the_full_capacity_ones(greedy):
    capacity = PROMPT.shape[1] + NEW - 1
    assert len(spans(capacity)) == 3 and LENGTHS.max() + NEW > 512  # prefill at 256, steps at 256, 512, 529
    programs = run._cache_size()
    out = np.asarray(generate(MODEL, model_params(), PROMPT, max_new_tokens=NEW, prompt_lengths=LENGTHS))
    assert run._cache_size() == programs + 1, "generate is one program, whatever spans its loops read"
    np.testing.assert_array_equal(out[:, PROMPT.shape[1]:], greedy)
    programs = start._cache_size(), advance._cache_size()
    streamed = np.stack(list(stream(MODEL, model_params(), PROMPT, max_new_tokens=NEW, prompt_lengths=LENGTHS)), axis=1)
    # The prefill, and a round per span its rows passed through: 256, 512 and the capacity.
    assert (start._cache_size(), advance._cache_size()) == (programs[0] + 1, programs[1] + len(spans(capacity)))
    np.testing.assert_array_equal(streamed, greedy)
    with count_compiles() as compiles:  # new values, the same programs
        generate(MODEL, model_params(), PROMPT * 7 % 64, max_new_tokens=NEW, prompt_lengths=LENGTHS)
        list(stream(MODEL, model_params(), PROMPT * 7 % 64, max_new_tokens=NEW, prompt_lengths=LENGTHS))
    assert not compiles


def test_sampled_tokens_for_a_key_are_the_full_capacity_ones():
    sampling = dict(temperature=1.5, top_k=20, key=jax.random.key(3))
    want = _full_capacity_tokens(NEW, **sampling)
    out = np.asarray(generate(MODEL, model_params(), PROMPT, max_new_tokens=NEW, prompt_lengths=LENGTHS, **sampling))
    np.testing.assert_array_equal(out[:, PROMPT.shape[1]:], want)
    streamed = np.stack(list(stream(MODEL, model_params(), PROMPT, max_new_tokens=NEW, prompt_lengths=LENGTHS,
                                    **sampling)), axis=1)
    np.testing.assert_array_equal(streamed, want)


def test_beam_search_and_prompt_lookup_across_spans_keep_their_tokens(greedy):
    one_beam = generate(MODEL, model_params(), PROMPT, max_new_tokens=NEW, prompt_lengths=LENGTHS, num_beams=1)
    np.testing.assert_array_equal(np.asarray(one_beam)[:, PROMPT.shape[1]:], greedy)
    beams = generate(MODEL, model_params(), PROMPT[:1], max_new_tokens=NEW, num_beams=2)
    assert np.asarray(beams).shape == (1, PROMPT.shape[1] + NEW)
    lookup = generate(MODEL, model_params(), PROMPT, max_new_tokens=NEW, prompt_lengths=LENGTHS,
                      speculative=PromptLookup(k=3, n=2))  # rounds of 4 writes, rows advancing unevenly
    np.testing.assert_array_equal(np.asarray(lookup)[:, PROMPT.shape[1]:], greedy)


def test_the_engine_decodes_across_spans_as_generate_with_a_program_per_span(greedy):
    engine = Engine(MODEL, model_params(), max_batch=2, prefill_chunk=64)
    try:
        handles = [engine.submit(PROMPT[row, :LENGTHS[row]].tolist(), DecodeOptions(max_new_tokens=NEW))
                   for row in range(2)]
        for row, handle in enumerate(handles):
            assert handle.result()[0] == greedy[row].tolist()
    finally:
        engine.close()
    # Every span of 1024 read, by 2 rows (and by 1 where one request ran on alone): at most a
    # compile per row count and span, no more.
    assert engine._row_counts == [1, 2] and len(spans(1024)) == 3
    assert len(spans(1024)) <= engine._programs["step"]._cache_size() <= 2 * len(spans(1024))


@pytest.mark.parametrize("layer_types, scan", [(None, False), (None, True), (("sliding", "full"), False),
                                               (("sliding", "full"), True)])
def test_a_step_at_its_span_gives_the_full_capacity_logits(layer_types, scan):
    config = CONFIG.replace(layer_types=layer_types, sliding_window=layer_types and 40, scan_layers=scan)
    model, params = Decoder(config), random_params(config, seed=2)
    step = jax.jit(lambda params, tokens, cache: model.apply({"params": params}, tokens, cache))
    cache = model.init_cache(2, 1024)
    _, cache = step(params, jnp.asarray(np.tile(PROMPT[:, :200], (1, 2))[:, :300]), cache)
    cache = cache.replace(pos=jnp.array([300, 20], jnp.int32))
    tokens = jnp.array([[3, 4], [5, 6]])
    full_logits, full = step(params, tokens, cache)
    logits, spanned = step(params, tokens, cache.spanning(302))
    assert spanned.span == 512 and full.span is None
    np.testing.assert_allclose(logits, full_logits, rtol=1e-5, atol=1e-5)
    # The same slots written, with the same values: the two programs (of other shapes) compute the
    # same float32 sums, bitwise alike on a CPU, in other orders on a GPU (conftest's REORDERED).
    model64 = Decoder(float64_config(config))
    _, full64 = in_float64(lambda params, cache: model64.apply({"params": params}, tokens, cache), params, cache)
    assert_reordered_equal(spanned.layers, full.layers, full64.layers)


def _attention_shapes(span_needed: int, capacity: int) -> list[tuple[int, ...]]:
    """The shapes of every dot_general operand in the one-token step's program."""
    cache = MODEL.init_cache(1, capacity).replace(pos=jnp.array([200], jnp.int32)).spanning(span_needed)
    text = jax.jit(lambda p, t, c: MODEL.apply({"params": p}, t, c)).lower(
        model_params(), jnp.ones((1, 1), jnp.int32), cache).as_text()
    lines = [line for line in text.splitlines() if "dot_general" in line]
    return [tuple(int(n) for n in dims.split("x")[:-1]) for line in lines
            for dims in re.findall(r"tensor<([0-9x]+x[a-z0-9]+)>", line)]


def test_a_step_reads_its_span_not_the_capacity():
    """The attention's einsums take `[batch, span, ...]` keys: 256 slots of a 1024 cache, not 1024."""
    shapes = _attention_shapes(201, 1024)
    assert any(256 in shape for shape in shapes) and not any(1024 in shape for shape in shapes)
    assert any(1024 in shape for shape in _attention_shapes(None, 1024))  # no span: every slot


def test_a_row_past_its_span_is_refused_or_nan():
    cache = MODEL.init_cache(1, 1024).replace(pos=jnp.array([256], jnp.int32), span=256)
    with pytest.raises(ValueError, match=r"cache.pos\[0\] \+ tokens: 256 \+ 1 = 257 positions exceed cache span=256"):
        MODEL.apply({"params": model_params()}, jnp.ones((1, 1), jnp.int32), cache)
    logits, _ = _full_step(model_params(), jnp.ones((1, 1), jnp.int32), cache)  # inside jit: NaN, loud
    assert np.isnan(np.asarray(logits)).all()
    with pytest.raises(ValueError, match=r"cache.span must be an int in \[1, cache capacity=1024\]"):
        MODEL.apply({"params": model_params()}, jnp.ones((1, 1), jnp.int32), cache.replace(span=2048))
