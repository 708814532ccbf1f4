"""Speculative decoding: greedy's exact tokens, sampling's exact distribution, the cache
after rejections, and one compile however many proposals are accepted."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats
from conftest import GEMMA4_DECODING, count_compiles, jit_apply, random_params, tiny_gemma4, with_experts

from jaxformer import Decoder, DecoderConfig, generate, stream
from jaxformer.decoding import (
    DecodeRequest,
    Draft,
    PromptLookup,
    advance,
    run,
    speculative,
    speculative_generate,
    start,
)
from jaxformer.decoding.speculative import plan
from jaxformer.decoding.steps import host_reach, with_span
from jaxformer.experts import ExpertsSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttentionSpec
from jaxformer.layers import LayerSpec

TINY = DecoderConfig(vocab_size=48, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)
# (One layer where two add nothing but compile time; the cache test checks both layers.)
CONFIGS = {
    "gqa-split-half-tied": TINY,
    "mha-interleaved-untied": TINY.replace(n_layer=1, n_kv_head=4, rope_pairing="interleaved", tie_embeddings=False),
    "mqa-split-half-untied": TINY.replace(n_layer=1, n_kv_head=1, tie_embeddings=False),
}
DRAFT = TINY.replace(n_layer=1, n_head=2, n_kv_head=1, d_model=16)
# TINY's single layer: for the tests of how rounds advance and fit, which one layer's cache shows.
ONE_LAYER = TINY.replace(n_layer=1)
# The runs on TINY with the target's own weights as its draft share one prompt shape, run
# length and the proposers' k, so that their programs compile once for the file (the greedy
# test's shapes too: its plain runs on TINY are theirs).
SHARED_PROMPT, SHARED_NEW, LOOKUP_K, DRAFT_K = (3, 12), 24, 4, 8


def repetitive_prompts(batch: int, length: int, seed: int = 0) -> np.ndarray:
    """Rows that repeat a short pattern: prompt lookup finds matches in them."""
    pattern = np.random.RandomState(seed).randint(0, TINY.vocab_size, (batch, 5))
    return np.tile(pattern, (1, length // 5 + 1))[:, :length]


# (config, proposer, k): every k from 1 to 8, both proposers, each config (the fast tier: gqa's and
# mha's lookup, mqa's draft; the others in the full tier, tests/conftest.py).
CASES = [("gqa-split-half-tied", "lookup", 1), ("gqa-split-half-tied", "draft", 8),
         ("mha-interleaved-untied", "lookup", 4), ("mha-interleaved-untied", "draft", 2),
         ("mqa-split-half-untied", "lookup", 8), ("mqa-split-half-untied", "draft", 5),
         ("gqa-split-half-tied", "lookup", 3), ("mqa-split-half-untied", "draft", 6),
         ("mha-interleaved-untied", "lookup", 7)]


@pytest.mark.parametrize("name, proposer, k", CASES)
def test_greedy_gives_generates_tokens(name, proposer, k):
    """Token for token plain greedy decoding's: a ragged batch, and again with an EOS that
    plain decoding emits mid-run (rows stop there and pad after it)."""
    config = CONFIGS[name]
    model, params = Decoder(config), random_params(config, seed=1)
    prompt = repetitive_prompts(*SHARED_PROMPT)
    lengths = [12, 7, 9]
    options = dict(max_new_tokens=SHARED_NEW, prompt_lengths=lengths)
    spec = (PromptLookup(k=k, n=2) if proposer == "lookup"
            else Draft(Decoder(DRAFT), random_params(DRAFT, seed=2), k=k))
    want = generate(model, params, prompt, **options)
    got, stats = speculative_generate(model, params, prompt, spec, **options)
    np.testing.assert_array_equal(got, want)
    eos = int(want[0, 12 + 6])  # row 0's 7th new token
    want = generate(model, params, prompt, eos_id=eos, pad_id=47, **options)
    assert (want == 47).any()  # the EOS is met mid-run
    np.testing.assert_array_equal(generate(model, params, prompt, eos_id=eos, pad_id=47, speculative=spec, **options),
                                  want)
    assert stats.rounds < options["max_new_tokens"] or stats.acceptance == 0


# A mixture of experts of TINY's shape (each layer routes a token to 2 of 4 gated MLPs, dropless), and drafts
# for it: DRAFT, dense; DRAFT with experts of its own (2 of 4, 8 wide); the model itself, its own weights.
MOE = with_experts(TINY, ExpertsSpec(4, 2, 16))
MOE_DRAFTS = {"dense-draft": DRAFT, "moe-draft": with_experts(DRAFT, ExpertsSpec(4, 2, 8)), "moe-itself": MOE}


@pytest.mark.parametrize("draft", sorted(MOE_DRAFTS))
def test_greedy_on_a_mixture_of_experts_gives_generates_tokens(draft):
    """A round verifies the k proposals of every row in one call of k + 1 tokens a row, each token
    routed to its own experts, where plain decoding routes one a step: token for token plain greedy
    decoding's, on a ragged batch, and with an EOS met mid-run. The random drafts' proposals are
    mostly rejected; the model as its own draft has every one accepted (the fast tier keeps this one)."""
    model, params = Decoder(MOE), random_params(MOE, seed=1)
    prompt = repetitive_prompts(*SHARED_PROMPT)
    options = dict(max_new_tokens=SHARED_NEW, prompt_lengths=[12, 7, 9])
    itself = draft == "moe-itself"
    spec = Draft(Decoder(MOE_DRAFTS[draft]), params if itself else random_params(MOE_DRAFTS[draft], seed=2), k=4)
    want = generate(model, params, prompt, **options)
    got, stats = speculative_generate(model, params, prompt, spec, **options)
    np.testing.assert_array_equal(got, want)
    assert stats.acceptance == 1.0 if itself else stats.acceptance < 0.5
    eos = int(want[0, 12 + 6])  # row 0's 7th new token
    want = generate(model, params, prompt, eos_id=eos, pad_id=47, **options)
    assert (want == 47).any()
    np.testing.assert_array_equal(generate(model, params, prompt, eos_id=eos, pad_id=47, speculative=spec, **options),
                                  want)
    assert len(np.unique(np.asarray(want)[:, 12:])) > 5


def lookup_by_hand(row, start, length, k, n):
    """Prompt lookup written out: the longest tail j <= n of `row[start:length]` that
    occurred earlier, the k tokens after its latest occurrence (the last token where the
    context ends or nothing matched)."""
    context = list(row[start:length])
    for j in range(min(n, len(context)), 0, -1):
        ends = [e for e in range(j, len(context)) if context[e - j:e] == context[-j:]]
        if ends:
            after = context[max(ends):]
            return after[:k] + [context[-1]] * (k - len(after[:k]))
    return [context[-1]] * k


@pytest.mark.parametrize("n", [1, 2, 3])
def test_lookup_proposes_the_longest_earlier_match(n):
    """`_lookup` against `lookup_by_hand` on random contexts over 3 symbols (repeats of
    every length happen), each row at its own length: the same k proposals."""
    rng = np.random.default_rng(n)
    batch, width, k = 6, 20, 4
    sequence = rng.integers(0, 3, (batch, width)).astype(np.int32)
    offset = np.array([0, 1, 3, 5, 0, 2], np.int32)  # row b's length: the round's, less its offset
    lookup = jax.jit(speculative._lookup, static_argnames=("k", "n"))
    for length in range(6, width + 1):
        lengths = length - offset
        got = np.asarray(lookup(jnp.asarray(sequence), jnp.asarray(lengths), k=k, n=n))
        want = [lookup_by_hand(list(sequence[b]), 0, lengths[b], k, n) for b in range(batch)]
        np.testing.assert_array_equal(got, want, err_msg=f"length {length}")


def test_a_draft_equal_to_the_model_accepts_everything():
    model, params = Decoder(TINY), random_params(TINY, seed=1)
    prompt = repetitive_prompts(*SHARED_PROMPT)
    for k in (1, DRAFT_K):
        got, stats = speculative_generate(model, params, prompt, Draft(model, params, k=k), max_new_tokens=SHARED_NEW)
        np.testing.assert_array_equal(got, generate(model, params, prompt, max_new_tokens=SHARED_NEW))
        assert stats.acceptance == 1.0 and stats.rounds == -(-23 // (k + 1))  # 23 tokens after the prefill's


def test_stream_gives_the_same_tokens():
    model, params = Decoder(TINY), random_params(TINY, seed=1)
    prompt = repetitive_prompts(*SHARED_PROMPT)
    for spec in (PromptLookup(k=LOOKUP_K, n=2), Draft(model, params, k=DRAFT_K)):
        for temperature in (0.0, 1.0):
            options = dict(max_new_tokens=SHARED_NEW, temperature=temperature, key=jax.random.key(3))
            want = generate(model, params, prompt, speculative=spec, **options)[:, SHARED_PROMPT[1]:]
            got = np.stack(list(stream(model, params, prompt, speculative=spec, **options)), axis=1)
            np.testing.assert_array_equal(got, want)


def test_the_cache_after_rejections_holds_plain_decodings_values():
    """After rounds with rejected proposals, every slot before a row's `pos` holds what
    plain decoding's cache holds there; one compiled program serves runs that accept
    everything and runs that accept nothing."""
    model, params = Decoder(TINY), random_params(TINY, seed=1)
    prompt = repetitive_prompts(*SHARED_PROMPT)
    request = DecodeRequest.create(model, prompt, max_new_tokens=SHARED_NEW)
    strategy = plan(model, request, PromptLookup(k=LOOKUP_K, n=2))
    state = start(model, params, request, None, strategy)
    rejected = 0
    while True:  # rounds while every row is unfinished (a finished row's cache is parked)
        before = jax.device_get(state)  # (the state passed to a round is donated)
        # (At the span the round reaches, as `stream` runs it: the stream test's program.)
        state, _, _ = advance(model, params, request, with_span(state, host_reach(state, strategy.width)), strategy)
        if int(state.n.max()) >= SHARED_NEW:
            break
        rejected += int(np.any(np.asarray(state.n) - before.n < LOOKUP_K + 1))
    state = before
    assert rejected > 0
    pos = np.asarray(state.cache.pos)
    np.testing.assert_array_equal(pos, SHARED_PROMPT[1] + np.asarray(state.n) - 1)  # all but each row's last token
    for row in range(SHARED_PROMPT[0]):
        # (Each row's tokens up to the longest pos: one program; a slot's K/V do not see the tokens after it.)
        tokens = state.sequence[row:row + 1, :pos.max()]
        _, plain = jit_apply(model, {"params": params}, tokens, model.init_cache(1, int(pos.max())))
        for got, want in zip(state.cache.layers, plain.layers):
            np.testing.assert_allclose(got.k[row, :pos[row]], want.k[0, :pos[row]], atol=1e-5)
            np.testing.assert_allclose(got.v[row, :pos[row]], want.v[0, :pos[row]], atol=1e-5)

    accepts_all = Draft(model, params, k=DRAFT_K)
    accepts_few = Draft(model, random_params(TINY, seed=5), k=DRAFT_K)
    assert speculative_generate(model, params, prompt, accepts_all, max_new_tokens=SHARED_NEW)[1].acceptance == 1.0
    with count_compiles() as compiles:
        assert speculative_generate(model, params, prompt, accepts_few, max_new_tokens=SHARED_NEW)[1].acceptance < 0.5
        speculative_generate(model, params, prompt, accepts_all, max_new_tokens=SHARED_NEW)
    assert compiles == []


def _sample_joint(model, params, prompt, spec, n_calls: int, seed: int, batch: int = 4) -> np.ndarray:
    """Counts of the first three new tokens over `n_calls * batch` sampled rows (batches
    of identical rows, each call with its own key), and the runs' rounds, proposals and
    acceptances."""
    vocab = model.config.vocab_size
    request = DecodeRequest.create(model, np.repeat(prompt, batch, axis=0), max_new_tokens=3, temperature=1.0,
                                   key=jax.random.key(0))
    strategy = plan(model, request, spec)
    counts, rounds, proposed, accepted = np.zeros((vocab,) * 3, np.int64), 0, 0, 0
    for key in jax.random.split(jax.random.key(seed), n_calls):
        tokens, stats = run(model, params, request.replace(key=key), strategy)
        np.add.at(counts, tuple(np.asarray(tokens)[:, -3:].T), 1)  # the new tokens, after the prompt
        rounds, proposed, accepted = rounds + int(stats.rounds), proposed + int(stats.proposed), \
            accepted + int(stats.accepted)
    return counts, (rounds, proposed, accepted)


def _exact_joint(model, params, prompt) -> np.ndarray:
    """p(t0, t1, t2 | prompt) of plain sampling at temperature 1, every sequence enumerated."""
    vocab = model.config.vocab_size
    t0, t1 = np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij")
    rows = np.concatenate([np.repeat(prompt, vocab * vocab, axis=0), t0.reshape(-1, 1), t1.reshape(-1, 1)], axis=1)
    logits, _ = jit_apply(model, {"params": params}, rows)
    p = scipy.special.softmax(np.asarray(logits[:, -3:], np.float64), axis=-1)  # [V*V, 3, V]
    first = p[0, 0]  # [V]
    second = p[:, 1].reshape(vocab, vocab, vocab)[:, 0]  # [t0, t1]: the same for every t1 of the row
    third = p[:, 2].reshape(vocab, vocab, vocab)  # [t0, t1, t2]
    return first[:, None, None] * second[:, :, None] * third


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs.reshape(-1) / probs.sum() * counts.sum()  # (the sum is 1 but for rounding)
    observed = counts.reshape(-1)
    small = expected < 5  # cells too rare for the test are pooled into one
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    return scipy.stats.chisquare(observed, expected).pvalue


SAMPLING = DecoderConfig(vocab_size=5, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=32)


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_sampling_keeps_the_models_distribution(proposer, monkeypatch):
    """The joint distribution of the first three sampled tokens (125 outcomes) matches the
    model's, enumerated exactly, by a chi-square test (4000 rows, fixed seeds; measured
    p-values 0.57 with the draft, 0.60 with prompt lookup). The same test fails a rule
    that accepts every proposal: then the tokens follow the proposer (measured p-value
    0.0 in double precision, for both)."""
    model, params = Decoder(SAMPLING), random_params(SAMPLING, seed=1, scale=0.6)
    prompt = np.array([[1, 2, 3, 1, 2, 3, 1, 2]])
    spec = (Draft(model, random_params(SAMPLING, seed=7, scale=0.6), k=3) if proposer == "draft"
            else PromptLookup(k=3, n=1))
    exact = _exact_joint(model, params, prompt)
    counts, (rounds, proposed, accepted) = _sample_joint(model, params, prompt, spec, n_calls=1000, seed=11)
    assert _chi2_pvalue(counts, exact) > 1e-3
    # Both paths were taken: rejections, and rounds that kept more than one token (two
    # rounds of one token each would make the three).
    assert 0 < accepted < proposed and rounds < 2 * 1000

    always = speculative._verify

    def accept_everything(logits, proposals, log_q, request, key):
        accepted, tokens = always(logits, proposals, log_q, request, key)
        k = proposals.shape[1]
        return jnp.full_like(accepted, k), jnp.concatenate([proposals, tokens[:, k:]], axis=1)

    monkeypatch.setattr(speculative, "_verify", accept_everything)
    run.clear_cache()  # trace again, with the broken rule
    try:
        broken, _ = _sample_joint(model, params, prompt, spec, n_calls=1000, seed=11)
    finally:
        monkeypatch.undo()
        run.clear_cache()
    assert _chi2_pvalue(broken, exact) < 1e-6


def test_bad_input_is_refused_before_tracing():
    model, params = Decoder(TINY), random_params(TINY, seed=1)
    prompt = repetitive_prompts(1, 8)
    with pytest.raises(ValueError, match="PromptLookup.k"):
        PromptLookup(k=0)
    with pytest.raises(ValueError, match=r"Draft.model's vocab_size \(50\) must be the model's \(48\)"):
        generate(model, params, prompt, max_new_tokens=4,
                 speculative=Draft(Decoder(DRAFT.replace(vocab_size=50)), None, k=2))
    with pytest.raises(ValueError, match=r"Draft.model's max_seq_len \(11\) must hold the prompt and max_new_tokens "
                                         r"\(12\)"):
        generate(model, params, prompt, max_new_tokens=4,
                 speculative=Draft(Decoder(DRAFT.replace(max_seq_len=11)), None, k=2))
    with pytest.raises(ValueError, match="leave num_beams at 1"):
        generate(model, params, prompt, max_new_tokens=4, num_beams=2, speculative=PromptLookup())


def test_k_shrinks_to_fit_max_seq_len():
    """The last round's proposals must fit the positions the model has: k shrinks (to 1
    at worst: a run that fits max_seq_len leaves room for one); a run of one token is
    plain decoding. The tokens are plain decoding's."""
    model, params = Decoder(ONE_LAYER), random_params(ONE_LAYER, seed=1)
    prompt = repetitive_prompts(2, 40)
    # (Greedy: a shorter run's tokens are the first ones of the longest, one program for the three.)
    plain = np.asarray(generate(model, params, prompt, max_new_tokens=24))
    for max_new, k in ((20, 5), (24, 1), (1, None)):
        request = DecodeRequest.create(model, prompt, max_new_tokens=max_new)
        strategy = plan(model, request, PromptLookup(k=8, n=2))
        assert (strategy and strategy.proposer.k) == k
        np.testing.assert_array_equal(
            generate(model, params, prompt, max_new_tokens=max_new, speculative=PromptLookup(k=8, n=2)),
            plain[:, :40 + max_new])


class RowwiseDraft(Decoder):
    """The target's own model as a draft, except in the rows whose prompt starts with an odd
    token: there its logits are rolled by one, so its argmax is never the target's. At
    temperature 0 the even rows accept every proposal and the odd rows none."""

    def decode_context(self, prompt):
        return prompt[:, 0] % 2 == 1  # [batch] bool: the rows that disagree

    def decode_step(self, tokens, cache, context):
        logits, cache = self(tokens, cache)
        return jnp.where(context[:, None, None], jnp.roll(logits, 1, axis=-1), logits), cache


def test_each_row_advances_by_its_own_acceptance():
    """Batch 8, a draft that agrees with the model on half the rows: after a round each
    row's position has moved by its own accepted + 1 (k + 1 where it agrees, 1 where it
    does not), not by the batch's least; the tokens are plain greedy decoding's."""
    model, params = Decoder(ONE_LAYER), random_params(ONE_LAYER, seed=1)
    prompt = np.random.RandomState(3).randint(0, ONE_LAYER.vocab_size, (8, 9))
    prompt[:, 0] = np.arange(8)  # even rows agree, odd rows do not
    lengths = [9, 5, 7, 9, 6, 8, 9, 4]
    options = dict(max_new_tokens=20, prompt_lengths=lengths)
    k = 3
    spec = Draft(RowwiseDraft(ONE_LAYER), params, k=k)
    request = DecodeRequest.create(model, prompt, **options)
    strategy = plan(model, request, spec)
    state = start(model, params, request, None, strategy)
    agrees = np.arange(8) % 2 == 0
    for round_ in range(1, 4):
        # (At the span the round reaches, as `stream` runs it: its program serves the stream below too.)
        state, _, _ = advance(model, params, request, with_span(state, host_reach(state, strategy.width)), strategy)
        want_n = 1 + round_ * np.where(agrees, k + 1, 1)
        np.testing.assert_array_equal(state.n, want_n)
        np.testing.assert_array_equal(state.cache.pos, np.asarray(lengths) + want_n - 1)
        np.testing.assert_array_equal(state.draft_cache.pos, state.cache.pos)
    got, stats = speculative_generate(model, params, prompt, spec, **options)
    np.testing.assert_array_equal(got, generate(model, params, prompt, **options))
    # 19 tokens after the prefill's: an odd row takes 19 rounds of 1, an even row 5 rounds of
    # k + 1 = 4 (the last one cut to the 3 it still needs) and accepts all 3 proposals in each.
    row_rounds = 4 * 19 + 4 * 5
    assert stats.rounds == 19
    assert stats.acceptance == pytest.approx(4 * 5 * k / (row_rounds * k))
    assert stats.tokens_per_row_round == pytest.approx((4 * 19 + 4 * 19) / row_rounds)
    streamed = np.stack(list(stream(model, params, prompt, speculative=spec, **options)), axis=1)
    np.testing.assert_array_equal(streamed, np.asarray(got)[:, 9:])


# Latent attention (MLA) on TINY's widths: a layer sliding over 6 keys (its latent cache a ring) and a full one.
# Its cache holds no state past the keys, so a round's rejected proposals are rewound as attention's are.
_LATENT = LatentAttentionSpec(n_head=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                              v_head_dim=6, rope_theta=10000.0, rope_scaling=None, rope_pairing="split_half")
LATENT = TINY.replace(layers=(LayerSpec(dataclasses.replace(_LATENT, window=6), GatedMLPSpec(48)),
                              LayerSpec(_LATENT, GatedMLPSpec(48))))


@pytest.mark.parametrize("proposer", ["lookup", "itself"])
def test_greedy_on_latent_attention_gives_generates_tokens(proposer):
    """Over latent attention's cache (a ring and a full layer): token for token plain greedy decoding's, on a
    ragged batch and with an EOS met mid-run; the model as its own draft has every proposal accepted."""
    assert_greedy_tokens_of_generate(Decoder(LATENT), random_params(LATENT, seed=1, scale=0.5), proposer)


@pytest.mark.parametrize("proposer", ["lookup", "itself"])
@pytest.mark.parametrize("name", GEMMA4_DECODING)
def test_greedy_on_gemma_4_gives_generates_tokens(name, proposer):
    """The same on Gemma 4's tiny E2B (per-layer inputs; its last two layers read the keys and values of the
    layers before them, which a round's rejected proposals set back; `conftest.GEMMA4_DECODING`),
    their sliding layers' window of 8 shorter than a round's 9 tokens when the model is its own draft."""
    assert_greedy_tokens_of_generate(*tiny_gemma4(name), proposer)


def assert_greedy_tokens_of_generate(model, params, proposer: str):
    """The tests above: speculative greedy decoding by prompt lookup or by the model as its own draft
    gives `generate`'s tokens, on a ragged batch and with an EOS met mid-run."""
    prompt = repetitive_prompts(*SHARED_PROMPT)
    options = dict(max_new_tokens=SHARED_NEW, prompt_lengths=[12, 7, 9])
    spec = PromptLookup(k=LOOKUP_K, n=2) if proposer == "lookup" else Draft(model, params, k=DRAFT_K)
    want = generate(model, params, prompt, **options)
    got, stats = speculative_generate(model, params, prompt, spec, **options)
    np.testing.assert_array_equal(got, want)
    assert stats.acceptance == 1.0 if proposer == "itself" else 0 < stats.acceptance < 1
    eos = int(want[0, 12 + 6])
    want = generate(model, params, prompt, eos_id=eos, pad_id=47, **options)
    assert (want == 47).any()
    np.testing.assert_array_equal(generate(model, params, prompt, eos_id=eos, pad_id=47, speculative=spec, **options),
                                  want)
    assert len(np.unique(np.asarray(want)[:, 12:])) > 5
