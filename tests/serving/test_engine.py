"""The continuous-batching engine: each request's tokens are what it would get decoded alone,
while requests come and go; nothing recompiles after `warmup`; faults stay with their request."""

import collections
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GEMMA4_DECODING, count_compiles, jit_apply, random_params, tiny_gemma4, with_experts
from tiny import CONFIG, DIALOGUES, TOKENIZER, trained_params

from jaxformer import Decoder, DecoderConfig, VanillaConfig, VanillaTransformer, generate
from jaxformer.decoding import DecodeOptions
from jaxformer.experts import ExpertsSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttentionSpec
from jaxformer.layers import LayerSpec
from jaxformer.serving import Engine, EngineClosed, QueueFull
from jaxformer.serving.engine import pieces

MODEL = Decoder(CONFIG)
STOP = TOKENIZER.stop_ids
# Prompts of many lengths: whole questions, cut ones, and one past a chunk of 8 several times.
PROMPTS = ([f"<|user|>{q}\n<|assistant|>" for q, _ in DIALOGUES] + ["<|user|>What", "Keys"]
           + [f"<|user|>{DIALOGUES[3][0]}\n<|assistant|>Hello! The cat", f"<|user|>{DIALOGUES[0][0]}"])


@pytest.fixture(scope="module")
def params():
    return trained_params()


@pytest.fixture(scope="module")
def engine(params):
    """Four rows, prefill chunks of 8: 16 requests queue, join as rows free up, and prompts
    longer than 8 tokens are prefilled over several turns."""
    engine = Engine(MODEL, params, max_batch=4, prefill_chunk=8, max_queue=64, stop_ids=STOP)
    engine.warmup()
    yield engine
    engine.close()


def options(max_tokens: int, seed: int | None = None, **sampling) -> DecodeOptions:
    """A request's options; `seed` makes its key."""
    return DecodeOptions(max_new_tokens=max_tokens, key=None if seed is None else jax.random.key(seed), **sampling)


def padded_alone(model, params, ids: list[int], width: int, max_tokens: int, **options) -> list[int]:
    """The new tokens of `generate` of one prompt alone, right-padded to `width` tokens (`prompt_lengths`:
    its padding is never read, test_generation and test_cache check that it decodes as unpadded), so that
    one compiled program serves prompts of every length, not one each."""
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(generate(model, params, padded, prompt_lengths=[len(ids)], max_new_tokens=max_tokens,
                               **options))[0, width:].tolist()


def alone(params, ids: list[int], max_tokens: int) -> list[int]:
    """`generate` of one prompt alone, cut before its first stop id: what the engine must send."""
    out = padded_alone(MODEL, params, ids, 32, max_tokens, eos_id=list(STOP))  # (the prompts are shorter than 32)
    stops = [i for i, token in enumerate(out) if token in STOP]
    return out[:stops[0]] if stops else out


def test_pieces_are_chunks_then_the_rest_padded_unless_the_cache_is_too_short():
    assert pieces(100, 64, 256) == [(64, 64), (64, 36)]
    assert pieces(8, 8, 96) == [(8, 8)]
    assert pieces(5, 8, 96) == [(8, 5)]
    assert pieces(19, 8, 19) == [(8, 8), (8, 8), (2, 2), (1, 1)]  # 16 + 4 padded would pass the room of 19
    for n in range(1, 70):
        for room in (n, n + 3, 200):
            cut = pieces(n, 16, room)
            assert sum(real for _, real in cut) == n and sum(size for size, _ in cut) <= room
            assert all(size & (size - 1) == 0 and real <= size <= 16 for size, real in cut)


def test_sixteen_requests_of_different_lengths_get_what_each_gets_alone(engine, params):
    ids = [TOKENIZER.encode(p) for p in PROMPTS] * 2  # 16 requests on 4 rows
    max_tokens = [12 + 5 * (i % 7) for i in range(len(ids))]
    rode = engine.load()["prefill"]["pieces_with_decode"]
    with count_compiles() as compiles:
        handles = [engine.submit(row, options(n)) for row, n in zip(ids, max_tokens)]
        results = [h.result() for h in handles]
    assert not compiles, "requests coming and going recompiled the engine's programs"
    assert engine.load()["prefill"]["pieces_with_decode"] > rode  # whole chunks rode with decode steps
    assert len(ids) == 16 and len({len(row) for row in ids}) >= 6
    for row, n, (tokens, finish_reason, error) in zip(ids, max_tokens, results):
        want = alone(params, row, max(max_tokens))[:n]  # (greedy: the first n of a longer run; one compile a prompt)
        assert error is None
        assert tokens == want
        assert finish_reason == ("length" if len(want) == n else "stop")
    assert {r[1] for r in results} == {"stop", "length"}


def test_warmup_runs_each_program_at_each_shape_it_lists_and_those_name_every_program(params):
    """`Engine._calls`, which `warmup` runs, names every program of `_programs`: a program
    added without its calls fails here. Each call is a shape of its own: after `warmup` a
    program has compiled once per call of it, no more (that serving compiles nothing past
    them, the test of sixteen requests counts)."""
    engine = Engine(MODEL, params, max_batch=3, prefill_chunk=4)  # rows 1, 2, 3; pieces of 1, 2, 4
    try:
        calls = engine._calls()
        assert {name for name, _, _ in calls} == set(engine._programs)
        said = []
        engine.warmup(lambda done, total, what: said.append((done, total, what)))
        assert said == [(done, len(calls), what) for done, (_, what, _) in enumerate(calls, 1)]
        per_program = collections.Counter(name for name, _, _ in calls)
        assert per_program == {"empty_row": 1, "piece": 3, "pick": 1, "step": 3, "fused": 3, "insert": 1}
        assert {name: program._cache_size() for name, program in engine._programs.items()} == per_program
        assert engine.submit([1, 2, 3], options(2)).result()[1] in ("stop", "length")  # (the warmed engine serves)
    finally:
        engine.close()


def test_sliding_window_layers_prefilled_in_padded_pieces_decode_as_alone():
    """Gemma's layout: a ring of the last positions for the sliding layers, which a padded piece
    must not fill with its padding. Prompts past the window and past a chunk, on 4 rows."""
    config = DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64,
                           layer_types=("sliding", "full"), sliding_window=6)
    model, params = Decoder(config), random_params(config, seed=3)
    engine = Engine(model, params, max_batch=4, prefill_chunk=8)
    try:
        prompts = [list(range(1, 1 + n)) for n in (3, 7, 11, 13, 21, 5)]
        handles = [engine.submit(row, options(12)) for row in prompts]
        for row, handle in zip(prompts, handles):
            assert handle.result()[0] == padded_alone(model, params, row, 21, 12)
    finally:
        engine.close()


def test_a_mixture_of_experts_serves_each_request_what_it_gets_alone():
    """Continuous batching on a model whose every layer routes a token to 2 of 4 experts: 8 requests of
    random prompts (3 to 21 tokens) on 4 rows, joining as rows free up, whole chunks of 8 riding with
    the batch's step (one call: the experts route the chunk's tokens and the step's together), each
    row choosing its own experts. Dropless, a row's experts do not depend on who shares its call: each
    greedy request gets the tokens `generate` gives it alone, and a seeded sampled one the tokens it
    draws with the engine to itself."""
    config = with_experts(DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64),
                          ExpertsSpec(4, 2, 16))
    model, params = Decoder(config), random_params(config, seed=3)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 64, n).tolist() for n in (3, 7, 11, 13, 21, 5, 17, 9)]
    engine = Engine(model, params, max_batch=4, prefill_chunk=8)
    try:
        sampled = dict(temperature=1.0, top_k=20)
        lone = engine.submit(prompts[1], options(12, seed=7, **sampled)).result()[0]
        rode = engine.load()["prefill"]["pieces_with_decode"]
        handles = [engine.submit(row, options(12)) for row in prompts]
        crowded = engine.submit(prompts[1], options(12, seed=7, **sampled))
        for row, handle in zip(prompts, handles):
            assert handle.result()[0] == padded_alone(model, params, row, 21, 12)
        assert crowded.result()[0] == lone
        assert engine.load()["prefill"]["pieces_with_decode"] > rode  # chunks rode with steps
    finally:
        engine.close()


def test_a_seeded_request_draws_the_same_tokens_whoever_shares_its_batch(engine):
    row = TOKENIZER.encode(PROMPTS[0])
    sampled = dict(temperature=4.0, top_k=40, top_p=0.95)  # hot: the memorised text is no longer certain
    lone = engine.submit(row, options(30, seed=7, **sampled)).result()[0]
    company = [engine.submit(TOKENIZER.encode(p), options(30, seed=i, **sampled)) for i, p in enumerate(PROMPTS[1:4])]
    crowded = engine.submit(row, options(30, seed=7, **sampled))
    assert crowded.result()[0] == lone
    other_seed = engine.submit(row, options(30, seed=8, **sampled)).result()[0]
    assert other_seed != lone  # (30 draws at temperature 4 from a fresh key: equal by chance only if broken)
    for handle in company:
        handle.result()


def test_cancel_frees_the_slot_at_the_next_step(params):
    engine = Engine(MODEL, params, max_batch=1, prefill_chunk=8, stop_ids=())  # no stop id: runs to max_tokens
    try:
        started = threading.Event()
        long = engine.submit(TOKENIZER.encode(PROMPTS[0]), options(70), listener=lambda event: started.set())
        started.wait(60)
        long.cancel()
        short = engine.submit(TOKENIZER.encode(PROMPTS[1]), options(5))
        assert short.result()[1] == "length"
        assert long.made < 70
    finally:
        engine.close()


def test_a_full_queue_refuses_and_a_failing_request_fails_alone(params):
    engine = Engine(MODEL, params, max_batch=2, prefill_chunk=8, max_queue=0, stop_ids=STOP)
    try:
        row = TOKENIZER.encode(PROMPTS[0])

        heard = []

        def broken(event):  # a listener that fails at the request's first token
            heard.append(event)
            if event.finish_reason is None:
                raise RuntimeError("the client went away")

        engine.submit(row, options(60), listener=broken)
        healthy = engine.submit(row, options(60))
        with pytest.raises(QueueFull, match=r"max_queue 0"):
            engine.submit(row, options(60))
        tokens, finish_reason, error = healthy.result()
        assert finish_reason == "stop" and error is None and len(tokens) > 5
        assert engine.submit(row, options(60)).result()[0] == tokens  # the failed one's slot is free again
        assert heard[-1].finish_reason == "error" and "RuntimeError: the client went away" in heard[-1].error
    finally:
        engine.close()
    with pytest.raises(EngineClosed):
        engine.submit(row, options(20))


@pytest.mark.parametrize("prompt, max_tokens, sampling, message", [
    ([], 4, {}, r"prompt must hold at least one token"),
    ([5, 2.5], 4, {}, r"prompt must hold integer token ids"),
    ([5, CONFIG.vocab_size], 4, {}, rf"token id {CONFIG.vocab_size}, outside the model's vocabulary \[0, 320\)"),
    ([5, -1], 4, {}, r"token id -1, outside"),
    ([5] * 90, 7, {}, r"the prompt's 90 tokens and max_new_tokens 7 make 97, past the server's max_seq_len 96"),
    ([5], -1, {}, r"max_new_tokens must be an int >= 0 \(got -1\)"),
    ([5], 4, {"top_k": 321}, r"top_k must be None or an int in \[1, vocab_size=320\]"),
    ([5], 4, {"top_p": 0.0}, r"top_p must be None or in \(0, 1\]"),
    ([5], 4, {"temperature": -1.0}, r"temperature must be >= 0"),
    ([5], 4, {"temperature": 0.5}, r"key is required when temperature > 0"),
    ([5], 4, {"key": 7}, r"key must be one PRNG key, jax.random.key\(seed\) \(got 7\)"),
    ([5], 4, {"key": jax.random.key(7, impl="rbg")}, r"key must be one PRNG key"),
    ([5], 4, {"num_beams": 2}, r"the engine does not take num_beams: leave it at 1 \(got 2\)"),
    ([5], 4, {"eos_id": 3}, r"the engine does not take eos_id: leave it at None"),
])
def test_bad_requests_are_refused_before_they_queue(engine, prompt, max_tokens, sampling, message):
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, DecodeOptions(max_new_tokens=max_tokens, **sampling))


def test_logprob_requests_are_checked(engine):
    with pytest.raises(ValueError, match=r"logprobs must be an int in \[0, 20\] \(got 21\)"):
        engine.submit([5], options(2), logprobs=21)
    with pytest.raises(ValueError, match=r"prompt_logprobs needs logprobs"):
        engine.submit([5], options(2), prompt_logprobs=True)


def direct_logprobs(params, ids: list[int], temperature: float = 0.0) -> np.ndarray:
    """`[len(ids), vocab]`: log_softmax of the `Decoder`'s logits over the whole sequence at once
    (no cache, no pieces), after the temperature: what position i says of token i + 1."""
    logits, _ = jit_apply(MODEL, {"params": params}, jnp.asarray([ids]))
    logits = logits[0].astype(jnp.float32)  # [len(ids), vocab]
    return np.asarray(jax.nn.log_softmax(logits / (temperature if temperature > 0 else 1.0), axis=-1))


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.7, 3)])
def test_logprobs_are_the_log_softmax_of_the_decoders_logits_for_prompt_and_tokens(engine, params, temperature,
                                                                                     seed):
    prompt = TOKENIZER.encode(PROMPTS[-2])  # 20-odd tokens: three pieces of 8
    handle = engine.submit(prompt, options(10, seed, temperature=temperature), logprobs=5, prompt_logprobs=True)
    events = list(handle.events())
    assert events[0].prompt_logprobs is not None and not events[0].tokens  # the prompt's, before any token
    scored = events[0].prompt_logprobs
    made = [record for event in events[1:] for record in event.logprobs]
    tokens = [token for event in events for token in event.tokens]
    assert [r.token for r in made] == tokens and len(tokens) >= 5
    want = direct_logprobs(params, prompt + tokens, temperature)
    assert len(scored) == len(prompt) and scored[0] is None  # nothing predicts the first token
    for i, record in enumerate(list(scored[1:]) + made, start=1):  # position i - 1 scores token i
        row = want[i - 1]
        assert record.token == (prompt + tokens)[i]
        np.testing.assert_allclose(record.logprob, row[record.token], atol=2e-5, rtol=0)
        best = np.argsort(-row, kind="stable")[:5]
        assert [t for t, _ in record.top] == best.tolist()
        np.testing.assert_allclose([v for _, v in record.top], row[best], atol=2e-5, rtol=0)


def test_max_tokens_0_scores_the_prompt_and_makes_nothing(engine, params):
    prompt = TOKENIZER.encode(PROMPTS[0])
    events = list(engine.submit(prompt, options(0), logprobs=0, prompt_logprobs=True).events())
    assert [e.finish_reason for e in events] == [None, "length"] and not any(e.tokens for e in events)
    want = direct_logprobs(params, prompt)
    got = [r.logprob for r in events[0].prompt_logprobs[1:]]
    np.testing.assert_allclose(got, want[np.arange(len(prompt) - 1), prompt[1:]], atol=2e-5, rtol=0)
    assert all(r.top == () for r in events[0].prompt_logprobs[1:])  # logprobs=0: the tokens' own alone


def test_engine_arguments_are_checked(params):
    with pytest.raises(ValueError, match=r"prefill_chunk must be a power of two \(got 12\)"):
        Engine(MODEL, params, prefill_chunk=12)
    with pytest.raises(ValueError, match=r"capacity must be an int in \[1, max_seq_len=96\] \(got 97\)"):
        Engine(MODEL, params, capacity=97)
    with pytest.raises(ValueError, match=r"the engine serves a model that continues its prompt"):
        Engine(VanillaTransformer(VanillaConfig(src_vocab_size=32, tgt_vocab_size=32, d_model=16, n_head=2, d_ff=32,
                                                n_layer=1)), params)  # (an encoder-decoder: its decoder starts at BOS)


def test_latent_attention_serves_each_request_what_it_gets_alone():
    """Continuous batching on a model of latent attention layers (a ring of 6 keys, then a full layer): 8
    requests of random prompts on 4 rows, chunks of 8 riding with the batch's step, each row's latent
    cache inserted and evicted as a slot: each greedy request gets the tokens `generate` gives it alone,
    and a seeded sampled one the tokens it draws with the engine to itself."""
    latent = LatentAttentionSpec(n_head=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                 v_head_dim=6, rope_theta=10000.0, rope_scaling=None, rope_pairing="split_half")
    config = DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64,
                           layers=(LayerSpec(dataclasses.replace(latent, window=6), GatedMLPSpec(48)),
                                   LayerSpec(latent, GatedMLPSpec(48))))
    assert_serves_each_request_what_it_gets_alone(Decoder(config), random_params(config, seed=3, scale=0.5))


@pytest.mark.parametrize("name", GEMMA4_DECODING)
def test_gemma_4_serves_each_request_what_it_gets_alone(name):
    """The same on Gemma 4's tiny E2B (per-layer inputs; its last two layers read the keys and values of the
    layers before them, which a slot's insert and evict carry; `conftest.GEMMA4_DECODING`), prompts past its
    sliding layers' window of 8."""
    assert_serves_each_request_what_it_gets_alone(*tiny_gemma4(name))


def assert_serves_each_request_what_it_gets_alone(model, params):
    """The tests above: 8 requests of random prompts (3 to 21 tokens) on 4 rows, chunks of 8 riding with the
    batch's step: each greedy request gets the tokens `generate` gives it alone, and a seeded sampled one the
    tokens it draws with the engine to itself."""
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 64, n).tolist() for n in (3, 7, 11, 13, 21, 5, 17, 9)]
    engine = Engine(model, params, max_batch=4, prefill_chunk=8)
    try:
        sampled = dict(temperature=1.0, top_k=20)
        lone = engine.submit(prompts[1], options(12, seed=7, **sampled)).result()[0]
        handles = [engine.submit(row, options(12)) for row in prompts]
        crowded = engine.submit(prompts[1], options(12, seed=7, **sampled))
        for row, handle in zip(prompts, handles):
            assert handle.result()[0] == padded_alone(model, params, row, 21, 12)
        assert crowded.result()[0] == lone
    finally:
        engine.close()
