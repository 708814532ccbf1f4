"""Speculative decoding: several tokens per pass of the model, the tokens it would give.

At batch 1 a decode step reads every weight to make one token: its speed is set by
memory bandwidth. Here each round proposes `k` tokens cheaply, then one pass of the
model over `k + 1` positions (the last token and the proposals) scores them all, and the
round keeps the longest prefix of proposals the model agrees with, plus the model's own
next token after it: between 1 and `k + 1` tokens per pass of the weights.

Two proposers share the mechanism:

- `PromptLookup(k, n)`: the `k` tokens that followed the most recent earlier occurrence
  of the context's last `n` tokens (or fewer, where those did not occur), in the prompt
  and generated text: no second model;
- `Draft(model, params, k)`: a smaller `Decoder` over the same vocabulary, with a cache
  of its own, stepping `k` tokens ahead.

Which proposals are kept: a proposal `d` that a proposer drew with probability `q(d)` is
accepted with probability `min(1, p(d) / q(d))`, `p` the model's distribution (after
temperature, top-k and top-p, as plain sampling uses it). At the first rejection the
token is drawn from `max(p - q, 0)` renormalised; after `k` acceptances, from `p`.
Each token then has distribution `p` exactly (speculative sampling: Leviathan et al.
2023, Chen et al. 2023). At temperature 0 both `p` and the proposers' `q` are one-hot,
so the rule is "keep while the proposal is the argmax": greedy decoding's tokens.

A batch shares one cache position, so it advances by the smallest number of tokens any
unfinished row accepted (plus one); a row that accepted more proposes them again next
round. The simplest correct rule: the rows' outputs stay exact, a batch of very
different rows just gains less. Rejected slots of the cache need no undoing: the cache's
`pos` is set back, the slots past it are never attended to and are written over later.
Everything runs in one `jit` with fixed shapes: accepting or rejecting never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decoding.inputs import DecodeOptions, DecodeRequest
from jaxformer.decoding.sampling import filtered_logits
from jaxformer.decoding.steps import NO_TOKEN, as_given, check_picked, finite_logits, first_token, stops
from jaxformer.sharding import mesh_of
from jaxformer.validation import as_int

if TYPE_CHECKING:
    from typing_extensions import Unpack


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Proposes the continuation of the most recent earlier occurrence of the last `n` tokens.

    Where the last `n` tokens did not occur before, the last `n - 1` are looked up, and so
    on down to the last token alone (so the first token after a prompt that ends in a
    separator, say, still finds its continuation).

    Attributes:
      k: tokens proposed per round, >= 1.
      n: the longest n-gram looked up, >= 1.
    """

    k: int = 4
    n: int = 3

    def __post_init__(self):
        as_int(self.k, "PromptLookup.k", minimum=1)
        as_int(self.n, "PromptLookup.n", minimum=1)


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
    """Proposes the tokens a smaller decoder-only model (the draft) decodes.

    The draft samples with the run's own temperature, top-k and top-p (greedy at 0), one
    token at a time from its own KV cache.

    Attributes:
      model: a `Decoder` over the same vocabulary as the model decoded.
      params: its parameters.
      k: tokens proposed per round, >= 1.
    """

    model: Any
    params: Any
    k: int = 4

    def __post_init__(self):
        as_int(self.k, "Draft.k", minimum=1)


class Stats(NamedTuple):
    """What a speculative run did (device scalars).

    Attributes:
      rounds: passes of the model after the prompt's (one per round).
      proposed: proposals scored by unfinished rows.
      accepted: proposals those rows' model accepted.
    """

    rounds: jax.Array
    proposed: jax.Array
    accepted: jax.Array


class State(NamedTuple):
    """Between two rounds (a pytree: `stream` carries it from one jitted round to the next).

    Attributes:
      n: int32 scalar, new tokens emitted so far (the same count in every row).
      token: `[batch]` the last emitted token, not yet in the caches.
      cache: the model's cache, holding everything before `token`.
      draft_cache: the draft's cache, alike; None for prompt lookup.
      done: `[batch]` bool, rows that have emitted EOS.
      sequence: `[batch, prompt_len + max_new_tokens + k]` int32: the (left-padded)
        prompt, then the new tokens, pad after them.
      stats: the run's `Stats` so far.
    """

    n: jax.Array
    token: jax.Array
    cache: Any
    draft_cache: Any
    done: jax.Array
    sequence: jax.Array
    stats: Stats


@dataclasses.dataclass(frozen=True)
class _DraftSpec:
    """`Draft` less its parameters: the static half (its params are traced)."""

    model: Any
    k: int


def _log_probs(logits: jax.Array, request: DecodeRequest) -> jax.Array:
    """Each row's distribution over its `[batch, ..., vocab]` logits, as log-probabilities:
    plain sampling's for a sampling row, one-hot on the argmax for a greedy one."""
    s = request.sampling
    moved = jnp.moveaxis(logits, 0, -2)  # [..., batch, vocab]: the layout filtered_logits reads
    greedy = jnp.where(jax.nn.one_hot(jnp.argmax(moved, axis=-1), moved.shape[-1]) > 0, 0.0, -jnp.inf)

    def sample(_):
        sampled = jax.nn.log_softmax(filtered_logits(moved, s.temperature, s.top_k, s.top_p), axis=-1)
        return jnp.where((s.temperature > 0)[:, None], sampled, greedy)

    # A cond, as in sample_token: when every row is greedy the vocabulary is not sorted.
    return jnp.moveaxis(jax.lax.cond(jnp.any(s.temperature > 0), sample, lambda _: greedy, None), -2, 0)


def _lookup(sequence: jax.Array, start: jax.Array, length: jax.Array, k: int, n: int) -> jax.Array:
    """Prompt lookup: `[batch, k]` tokens that followed the most recent earlier occurrence
    of each row's last `j` tokens, `j` the longest up to `n` that occurred before.

    Args:
      sequence: `[batch, L]`, the context in slots `start[b] .. length - 1`.
      start: `[batch]` each row's first real slot.
      length: int32 scalar, the slots filled.
    """
    batch, L = sequence.shape
    after = jnp.arange(L)[None, :]  # [1, L]: a candidate slot f, to follow an earlier match ending at f - 1
    # Slot s is padded's n + s; -1 (no token) before slot 0: the j-gram before f is padded[n + f - j: n + f].
    padded = jnp.concatenate([jnp.full((batch, n), -1, sequence.dtype), sequence], axis=1)  # [batch, n + L]
    tail = jax.lax.dynamic_slice_in_dim(padded, length, n, axis=1)[:, ::-1]  # [batch, n]: slots length-1, length-2, ..
    match = jnp.ones((batch, L), bool)  # [batch, L]: the j tokens before f are the context's last j
    follows = jnp.full((batch,), -1)  # [batch]: the slot after the latest match found, -1 none
    for j in range(1, n + 1):
        match &= padded[:, n - j:n - j + L] == tail[:, j - 1:j]
        # An earlier occurrence (ending before the last token), of real tokens, of a j-gram the context has.
        found = match & (after < length) & (after - j >= start[:, None]) & (length - j >= start[:, None])
        latest = jnp.max(jnp.where(found, after, -1), axis=1)
        follows = jnp.where(latest >= 0, latest, follows)  # a longer j-gram's match wins
    slots = follows[:, None] + jnp.arange(k)[None, :]  # [batch, k]
    known = (follows[:, None] >= 0) & (slots < length)
    proposal = jnp.take_along_axis(sequence, jnp.clip(slots, 0, L - 1), axis=1)
    return jnp.where(known, proposal, tail[:, :1])  # nothing found: any guess costs only its rejection


def _draft_proposals(draft: _DraftSpec, draft_params, request: DecodeRequest, token, draft_cache, key):
    """The draft's `k` tokens after `token`, their log-probabilities under the draft
    `[batch, k, vocab]`, and its cache with `token` and the `k` tokens written (k + 1 steps:
    the last only writes the k-th token's K/V, so that a round that accepts all k finds
    them cached)."""
    batch, k = token.shape[0], draft.k

    def step(i, carry):
        token, cache, proposals, q = carry
        logits, cache = draft.model.apply({"params": draft_params}, token[:, None], cache)  # [batch, 1, vocab]
        log_q = _log_probs(logits[:, 0], request)  # [batch, vocab]
        token = jax.random.categorical(jax.random.fold_in(key, i), log_q, axis=-1).astype(jnp.int32)
        return (token, cache, proposals.at[:, i].set(token), q.at[:, i].set(log_q))

    vocab = draft.model.decoding_spec().vocab_size
    init = (token, draft_cache, jnp.zeros((batch, k + 1), jnp.int32), jnp.zeros((batch, k + 1, vocab)))
    _, draft_cache, proposals, log_q = jax.lax.fori_loop(0, k + 1, step, init)
    return proposals[:, :k], log_q[:, :k], draft_cache


def _verify(logits, proposals, log_q, request: DecodeRequest, key):
    """The accept/reject rule over one round.

    Args:
      logits: `[batch, k + 1, vocab]`, the model's after the last token and each proposal.
      proposals: `[batch, k]`.
      log_q: `[batch, k, vocab]` the proposer's log-probabilities; None for a proposer
        that is certain (prompt lookup: q is one-hot on the proposal).

    Returns:
      `(accepted [batch], tokens [batch, k + 1])`: how many leading proposals each row
      accepted, and its tokens: the accepted proposals, then a token drawn from the
      residual (or, after k acceptances, from p), or `NO_TOKEN` where the logits it is
      drawn from hold NaN or inf; past that, unused.
    """
    batch, k = proposals.shape
    vocab = logits.shape[-1]
    position = jnp.arange(k + 1)[None, :]

    def greedy(_):  # p and q one-hot: keep while the proposal is the argmax
        best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch, k + 1]
        return best, proposals == best[:, :k]

    def sample(_):
        p = jnp.exp(_log_probs(logits, request))  # [batch, k + 1, vocab]
        q = jax.nn.one_hot(proposals, vocab) if log_q is None else jnp.exp(log_q)  # [batch, k, vocab]
        p_d, q_d = (jnp.take_along_axis(x, proposals[..., None], axis=-1)[..., 0] for x in (p[:, :k], q))
        u_key, r_key = jax.random.split(key)
        keep = jax.random.uniform(u_key, (batch, k)) * q_d < p_d  # u < p/q, as u q < p (q may be 0)
        residual = jnp.concatenate([jnp.maximum(p[:, :k] - q, 0.0), p[:, k:]], axis=1)  # [batch, k + 1, vocab]
        # p == q at a position leaves nothing, but there the proposal cannot be rejected.
        residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)
        return jax.random.categorical(r_key, jnp.log(residual), axis=-1).astype(jnp.int32), keep

    fresh, keep = jax.lax.cond(jnp.any(request.sampling.temperature > 0), sample, greedy, None)
    # Logits with NaN or inf accept nothing (NaN can equal nothing, yet argmax names an id) and give no token.
    finite = finite_logits(logits)  # [batch, k + 1]
    accepted = jnp.sum(jnp.cumprod(keep & finite[:, :k], axis=1), axis=1)  # [batch], the leading run of acceptances
    padded = jnp.concatenate([proposals, proposals[:, -1:]], axis=1)  # [batch, k + 1]
    return accepted, jnp.where(position < accepted[:, None], padded, jnp.where(finite, fresh, NO_TOKEN))


def _round(model, params, request: DecodeRequest, proposer, draft_params, state: State):
    """One round: propose k, score them in one pass, keep the agreed prefix and one more.

    Returns:
      `(state, block, m)`: the state after the round, the round's `[batch, k + 1]`
      tokens (pad for done rows, after an EOS and past `m`), and the index of its last
      token (`m + 1` tokens were emitted).
    """
    k, max_new = proposer.k, request.max_new_tokens
    prompt_len = request.prompt.shape[1]
    length = prompt_len + state.n  # slots of `sequence` filled
    key = jax.random.fold_in(jax.random.fold_in(request.key, 0x5BEC), state.n)
    draft_key, verify_key = jax.random.split(key)
    if isinstance(proposer, PromptLookup):
        proposals, log_q, draft_cache = _lookup(state.sequence, request.start, length, k, proposer.n), None, None
    else:
        proposals, log_q, draft_cache = _draft_proposals(proposer, draft_params, request, state.token,
                                                         state.draft_cache, draft_key)
    pos = state.cache.pos
    window = jnp.concatenate([state.token[:, None], proposals], axis=1)  # [batch, k + 1]
    logits, cache = model.apply({"params": params}, window, state.cache, None, method="decode_step")
    accepted, block = _verify(logits, proposals, log_q, request, verify_key)

    active = ~state.done
    m = jnp.min(jnp.where(active, accepted, k))  # the batch advances together: by its least
    m = jnp.minimum(m, max_new - state.n - 1)  # never past max_new_tokens
    position = jnp.arange(k + 1)[None, :]
    stop = stops(block, request.eos_id) & (position <= m)  # [batch, k + 1]: an EOS, or NO_TOKEN
    after_stop = (jnp.cumsum(stop, axis=1) - stop) > 0
    block = jnp.where(state.done[:, None] | after_stop | (position > m), request.pad_id, block)
    done = state.done | jnp.any(stop, axis=1)

    # The caches hold everything before the next token: set `pos` back past the rejected slots.
    cache = cache.replace(pos=pos + m + 1)
    if draft_cache is not None:
        draft_cache = draft_cache.replace(pos=pos + m + 1)
    stats = Stats(rounds=state.stats.rounds + 1, proposed=state.stats.proposed + k * jnp.sum(active),
                  accepted=state.stats.accepted + jnp.sum(jnp.where(active, accepted, 0)))
    state = State(n=state.n + m + 1, token=block[:, m], cache=cache, draft_cache=draft_cache, done=done,
                  sequence=jax.lax.dynamic_update_slice(state.sequence, block, (0, length)), stats=stats)
    return state, block, m


def _start_state(model, params, request: DecodeRequest, proposer, draft_params, mesh=None) -> State:
    """The prefill (the model's and the draft's) and token 0, as plain decoding picks it."""
    k, batch, prompt_len = proposer.k, *request.prompt.shape
    _, token, cache, done = first_token(model, params, request, mesh, extra_capacity=k)
    draft_cache = None
    if isinstance(proposer, _DraftSpec):
        draft_cache = proposer.model.init_cache(batch, cache.capacity).replace(start=request.start)
        _, draft_cache = proposer.model.apply({"params": draft_params}, request.decoder_prompt, draft_cache)
    sequence = jnp.full((batch, prompt_len + request.max_new_tokens + k), request.pad_id, jnp.int32)
    sequence = sequence.at[:, :prompt_len].set(request.prompt).at[:, prompt_len].set(token)
    zero = jnp.zeros((), jnp.int32)
    return State(n=jnp.ones((), jnp.int32), token=token, cache=cache, draft_cache=draft_cache, done=done,
                 sequence=sequence, stats=Stats(rounds=zero, proposed=zero, accepted=zero))


@functools.partial(jax.jit, static_argnames=("model", "proposer", "mesh"))
def speculative_loop(model, params, request: DecodeRequest, proposer, draft_params=None, mesh=None):
    """The whole speculative run as one program: a `while_loop` of rounds that stops at
    `max_new_tokens` or once every row has produced EOS.

    Returns:
      `(tokens, Stats)`: int32 `[batch, P + max_new_tokens]`, the decoder prompt then the
      new tokens, as `decode_loop` returns them.
    """
    def keep_going(state):
        return (state.n < request.max_new_tokens) & ~jnp.all(state.done)

    state = _start_state(model, params, request, proposer, draft_params, mesh)
    state = jax.lax.while_loop(keep_going, lambda s: _round(model, params, request, proposer, draft_params, s)[0],
                               state)
    prompt_len = request.prompt.shape[1]
    new = state.sequence[:, prompt_len:prompt_len + request.max_new_tokens]
    return jnp.concatenate([request.decoder_prompt, new], axis=1), state.stats


_stream_start = jax.jit(_start_state, static_argnames=("model", "proposer", "mesh"))
_stream_round = jax.jit(_round, static_argnames=("model", "proposer"), donate_argnames=("state",))


def plan(model, request: DecodeRequest, speculative):
    """Checks a `PromptLookup` or `Draft` against the model and the run, on the host.

    The proposals of the last round must fit `max_seq_len` (the model's and the draft's):
    `k` shrinks to fit, and where not even one fits the run is plain decoding.

    Returns:
      `(proposer, draft_params)`: the static proposer (k fitted), or `(None, None)` for
      plain decoding.

    Raises:
      ValueError: naming what does not fit (not a decoder-only model, beam search, a
        draft of another vocabulary, shorter `max_seq_len` or not a decoder-only model).
    """
    from jaxformer.decoder import Decoder  # (the model imports decoding: imported here, not at the top)

    if not isinstance(speculative, (PromptLookup, Draft)):
        raise ValueError(f"speculative must be a PromptLookup or a Draft (got {type(speculative).__name__})")
    if not isinstance(model, Decoder):
        raise ValueError(f"speculative decoding is for the decoder-only Decoder (got {type(model).__name__})")
    if request.num_beams != 1:
        raise ValueError("speculative decoding picks one continuation per row: leave num_beams at 1")
    spec = model.decoding_spec()
    # The last round starts at position prompt_len + max_new_tokens - 2 and writes k + 1 slots.
    limit = spec.max_seq_len - request.prompt.shape[1] - request.max_new_tokens + 1
    if isinstance(speculative, Draft):
        if not isinstance(speculative.model, Decoder):
            raise ValueError(f"Draft.model must be a Decoder (got {type(speculative.model).__name__})")
        draft_spec = speculative.model.decoding_spec()
        if draft_spec.vocab_size != spec.vocab_size:
            raise ValueError(f"Draft.model's vocab_size ({draft_spec.vocab_size}) must be the model's "
                             f"({spec.vocab_size}): the draft proposes the model's token ids")
        needed = request.prompt.shape[1] + request.max_new_tokens
        if draft_spec.max_seq_len < needed:
            raise ValueError(f"Draft.model's max_seq_len ({draft_spec.max_seq_len}) must hold the prompt and "
                             f"max_new_tokens ({needed}), as the model's does")
        limit = min(limit, draft_spec.max_seq_len - needed + 1)
    k = min(speculative.k, limit)
    if k < 1 or request.max_new_tokens == 1:
        return None, None
    if isinstance(speculative, PromptLookup):
        return dataclasses.replace(speculative, k=k), None
    return _DraftSpec(model=speculative.model, k=k), speculative.params


class RunStats(NamedTuple):
    """A speculative run's figures, on the host.

    Attributes:
      k: proposals per round (the proposer's `k`, less where `max_seq_len` left less
        room; 0: plain decoding, for a single new token).
      rounds: passes of the model after the prompt's.
      acceptance: accepted proposals / proposals scored (by unfinished rows).
      new_tokens: tokens emitted per row (EOS and the padding after it included).
    """

    k: int
    rounds: int
    acceptance: float
    new_tokens: int

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per pass of the model, the prefill's pass (token 0) included."""
        return self.new_tokens / (self.rounds + 1)


def speculative_generate(model, params, prompt, speculative, **options: Unpack[DecodeOptions]):
    """`generate(model, params, prompt, speculative=..., **options)`, with the run's figures.

    Returns:
      `(tokens, RunStats)`: `generate`'s output, and what the rounds did.

    Raises:
      ValueError, NonFiniteLogitsError: as `generate`.
    """
    request = DecodeRequest.create(model, prompt, **options)
    proposer, draft_params = plan(model, request, speculative)
    out, device_stats = speculative_decode(model, params, request, proposer, draft_params)
    rounds, proposed, accepted = (int(x) for x in device_stats)
    stats = RunStats(k=proposer.k if proposer else 0, rounds=rounds, acceptance=accepted / max(proposed, 1),
                     new_tokens=request.max_new_tokens)
    out = as_given(out, prompt, options)
    check_picked(out, request.max_new_tokens, request.pad_id)
    return out, stats


def speculative_decode(model, params, request: DecodeRequest, proposer, draft_params):
    """`plan`'s proposer run by `speculative_loop`, or, without one, plain decoding (with
    its `Stats`: a round per token, nothing proposed)."""
    if proposer is not None:
        return speculative_loop(model, params, request, proposer, draft_params, mesh_of(params))
    from jaxformer.decoding.loop import decode_loop  # (loop imports this module)

    rounds = jnp.int32(request.max_new_tokens - 1)
    return decode_loop(model, params, request, mesh_of(params)), Stats(rounds, jnp.int32(0), jnp.int32(0))


def stream_rounds(model, params, request: DecodeRequest, proposer, draft_params) -> Iterator[np.ndarray]:
    """`stream`'s tokens from `plan`'s proposer, a round of them per jitted call: the same
    tokens as `speculative_loop`'s (the same keys). Token 0 comes from the prefill."""
    state = _stream_start(model, params, request, proposer, draft_params, mesh_of(params))
    yield np.asarray(state.token)
    while int(state.n) < request.max_new_tokens and not np.asarray(state.done).all():
        state, block, m = _stream_round(model, params, request, proposer, draft_params, state)
        block = np.asarray(block)
        yield from (block[:, j] for j in range(int(m) + 1))
