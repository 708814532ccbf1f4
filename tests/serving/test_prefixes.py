"""Prefix caching: a prompt that begins as a cached one copies those positions and prefills the
rest, with the tokens (and logprobs) it gets without the cache; memory stays within its bytes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GEMMA4_DECODING, random_params, tiny_gemma4
from tiny import CONFIG, DIALOGUES, TOKENIZER

from jaxformer import Decoder, generate
from jaxformer.decoding import DecodeOptions
from jaxformer.deltanet import GatedDeltaNetSpec
from jaxformer.layers import layer_specs
from jaxformer.serving import Engine
from jaxformer.serving.prefixes import PrefixCache

STOP = TOKENIZER.stop_ids
TURN = f"<|user|>{DIALOGUES[2][0]}\n<|assistant|>{DIALOGUES[2][1]}\n"  # an earlier turn, 62 tokens
# A model with sliding layers (a window of 8), whose rings drop what their window no longer reads.
SLIDING = dataclasses.replace(CONFIG, n_layer=2, layer_types=("sliding", "full"), sliding_window=8)


@pytest.fixture(scope="module")
def params():
    """Random weights drawn large (`random_params`): sharp attention, so a wrong key or position
    changes the tokens; exactness needs no trained model (and training one takes half a minute)."""
    return random_params(CONFIG, 3)


def engine_of(model, params, prefix_cache_bytes=1 << 26) -> Engine:
    return Engine(model, params, max_batch=4, prefill_chunk=8, stop_ids=STOP, prefix_cache_bytes=prefix_cache_bytes)


def greedy(handle) -> list[int]:
    tokens, finish_reason, error = handle.result()
    assert error is None
    return tokens


def alone(model, params, ids: list[int], max_tokens: int) -> list[int]:
    out = np.asarray(generate(model, params, jnp.asarray([ids]), max_new_tokens=max_tokens, eos_id=list(STOP)))
    out = out[0, len(ids):].tolist()
    stops = [i for i, token in enumerate(out) if token in STOP]
    return out[:stops[0]] if stops else out


@pytest.mark.parametrize("config", [CONFIG, SLIDING], ids=["full", "sliding"])
def test_a_prompt_beginning_as_a_cached_one_prefills_only_the_rest_and_decodes_the_same(params, config):
    model = Decoder(config)
    params = params if config is CONFIG else random_params(config, 3)  # (the sliding model's own tree)
    engine = engine_of(model, params)
    first = TOKENIZER.encode(TURN)
    second = TOKENIZER.encode(TURN + f"<|user|>{DIALOGUES[3][0]}\n<|assistant|>")  # the conversation goes on
    try:
        greedy(engine.submit(first, DecodeOptions(max_new_tokens=4)))
        handle = engine.submit(second, DecodeOptions(max_new_tokens=16))
        tokens = greedy(handle)
        counts = engine.load()["prefill"]
    finally:
        engine.close()
    assert tokens == alone(model, params, second, 16)
    assert handle.cached == len(first)  # the whole earlier prompt (longer than the window: an entry used whole)
    assert {key: counts[key] for key in ("prompts", "prefix_hits", "cached_tokens", "prefilled_tokens")} == {
        "prompts": 2, "prefix_hits": 1, "cached_tokens": len(first), "prefilled_tokens": len(second)}


def test_a_ring_that_has_moved_past_the_shared_start_is_not_reused(params):
    model, params = Decoder(SLIDING), random_params(SLIDING, 3)
    engine = engine_of(model, params)
    first, second = TOKENIZER.encode(TURN), TOKENIZER.encode(TURN[:40] + "something else")
    try:
        greedy(engine.submit(first, DecodeOptions(max_new_tokens=2)))
        handle = engine.submit(second, DecodeOptions(max_new_tokens=12))
        tokens = greedy(handle)
    finally:
        engine.close()
    assert handle.cached == 0 and tokens == alone(model, params, second, 12)


def test_requests_sharing_a_prompt_prefill_it_once(params):
    """Arriving together (a request's n choices), the later ones wait for the first's entry."""
    model = Decoder(CONFIG)
    engine = engine_of(model, params)
    prompt = TOKENIZER.encode(f"<|user|>{DIALOGUES[1][0]}\n<|assistant|>")
    try:
        handles = [engine.submit(prompt, DecodeOptions(max_new_tokens=30, temperature=1.0, key=jax.random.key(i)))
                   for i in range(4)]
        results = [greedy(h) for h in handles]
        counts = engine.load()["prefill"]
    finally:
        engine.close()
    assert [h.cached for h in handles] == [0] + [len(prompt) - 1] * 3
    assert counts["prefilled_tokens"] == len(prompt) + 3
    no_cache = engine_of(model, params, prefix_cache_bytes=0)
    try:  # each choice is what it is without the cache
        assert [greedy(no_cache.submit(prompt, DecodeOptions(max_new_tokens=30, temperature=1.0,
                                                             key=jax.random.key(i)))) for i in range(4)] == results
    finally:
        no_cache.close()


def test_scoring_requests_reuse_a_shared_contexts_logprobs(params):
    """lm-evaluation-harness's log-likelihoods: one context, several endings, each scored whole."""
    model = Decoder(CONFIG)
    engine = engine_of(model, params)
    context = f"<|user|>{DIALOGUES[3][0]}\n<|assistant|>"
    prompts = [TOKENIZER.encode(context + ending) for ending in ("Hello! The cat", "Hello! The dog", "Goodbye.")]
    try:
        handles = [engine.submit(p, DecodeOptions(max_new_tokens=0), logprobs=1, prompt_logprobs=True)
                   for p in prompts]
        scored = [list(h.events())[0].prompt_logprobs for h in handles]
    finally:
        engine.close()
    assert handles[0].cached == 0 and all(h.cached > 0 for h in handles[1:])
    for prompt, records in zip(prompts, scored):
        logits, _ = model.apply({"params": params}, jnp.asarray([prompt]))
        want = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))
        assert len(records) == len(prompt) and records[0] is None
        np.testing.assert_allclose([r.logprob for r in records[1:]], want[np.arange(len(prompt) - 1), prompt[1:]],
                                   atol=2e-5, rtol=0)
        assert [r.top[0][0] for r in records[1:]] == np.argmax(want[:-1], axis=-1).tolist()
        assert all(len(r.top) == 1 for r in records[1:])


def test_the_cache_keeps_the_most_recently_used_within_its_bytes(params):
    row = Decoder(CONFIG).init_cache(1, CONFIG.max_seq_len)
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(row))
    cache = PrefixCache(2 * size)
    cache.add([1, 2, 3], row)
    cache.add([4, 5, 6], row)
    assert cache.longest([1, 2, 3, 9], None)[1] == 3  # [1, 2, 3] is now the most recently used
    cache.add([7, 8], row)  # one must go: [4, 5, 6]
    assert len(cache) == 2 and cache.nbytes == 2 * size
    assert cache.longest([4, 5, 6, 9], None) == (None, 0)
    assert cache.longest([1, 2, 3], None)[1] == 2  # the last prompt token is always run
    assert cache.longest([7, 8, 1], None)[1] == 2
    PrefixCache(size - 1).add([1], row)  # an entry larger than the whole cache is not kept
    tiny = PrefixCache(size - 1)
    tiny.add([1], row)
    assert len(tiny) == 0 and tiny.nbytes == 0


def test_a_linear_attention_hybrid_reuses_a_cached_prompt_only_whole(params):
    """A hybrid's rows keep states (`cache.LinearState`), which hold every token read and cannot be
    cut back: a prompt that goes on from a cached one starts from its whole entry; one that shares
    only a part of it, or is the same prompt (whose last token must run again), prefills from scratch;
    rows join and leave the batch (`insert`, `evict`) among others: each request gets its tokens alone."""
    base = dataclasses.replace(CONFIG, n_layer=4)
    attention = layer_specs(base)[0]
    linear = dataclasses.replace(attention, mixer=GatedDeltaNetSpec(2, 4, 8, 8, chunk=8))
    config = base.replace(layers=(linear,) * 3 + (attention,))
    model, params = Decoder(config), random_params(config, 3)
    first = TOKENIZER.encode(TURN)
    later = [TOKENIZER.encode(TURN + f"<|user|>{DIALOGUES[3][0]}\n<|assistant|>"),  # goes on: the whole entry
             TOKENIZER.encode(TURN[:40] + "something else"),  # shares a part: none of it
             first]  # the same prompt: none of it
    assert_reuses_whole_entries_alone(model, params, first, later)


def assert_reuses_whole_entries_alone(model, params, first, later):
    """`first` decoded, then `later` (one going on from it, one sharing a part, `first` again) among each
    other: the first starts from `first`'s whole entry, the others from nothing; each gets its tokens alone."""
    engine = engine_of(model, params)
    try:
        greedy(engine.submit(first, DecodeOptions(max_new_tokens=4)))
        handles = [engine.submit(ids, DecodeOptions(max_new_tokens=12)) for ids in later]
        tokens = [greedy(h) for h in handles]
    finally:
        engine.close()
    assert [h.cached for h in handles] == [len(first), 0, 0]
    assert tokens == [alone(model, params, ids, 12) for ids in later]


@pytest.mark.parametrize("name", GEMMA4_DECODING)
def test_gemma_4_reuses_a_cached_prompt_and_decodes_the_same(name):
    """Gemma 4's tiny E2B (its last two layers read the keys and values of the layers before them, which an
    entry holds for them; `conftest.GEMMA4_DECODING`): a prompt that goes on from a cached one of 20
    tokens starts from its whole entry; one that shares a part of it past its sliding layers' window of 8, or
    is the same prompt, prefills from scratch; rows join and leave the batch among others: each request gets
    its tokens alone."""
    model, params = tiny_gemma4(name)
    rng = np.random.RandomState(0)
    first = rng.randint(1, model.config.vocab_size, 20).tolist()
    later = [first + rng.randint(1, model.config.vocab_size, 5).tolist(), first[:15] + [3, 4, 5], first]
    assert_reuses_whole_entries_alone(model, params, first, later)
