"""Speculative decoding: several tokens per pass of the model, the tokens it would give.

Each round proposes `k` tokens cheaply, one pass of the model over the last token and the
proposals scores them all, and each row keeps the proposals the model agrees with, up to
the first it does not, plus the model's own next token. A proposal `d` drawn with
probability `q(d)` is kept with probability `min(1, p(d) / q(d))`, and at the first one
rejected the token is drawn from `max(p - q, 0)` renormalised, so each token has the
model's distribution `p` (at temperature 0: greedy decoding's tokens). docs/decoding.md
("Speculative decoding") says why it is faster, when it is not, and how rows advance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.decodable import Decodable
from jaxformer.decoding.request import DecodeRequest
from jaxformer.decoding.steps import NO_TOKEN, finite_logits, first_token, prefill, span_loops, stops
from jaxformer.validation import as_int


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Proposes what followed the most recent earlier occurrence of the last `n` tokens (or of
    fewer, down to the last token alone, where those did not occur).

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
    """Proposes what a smaller model (the draft) decodes with the run's sampling, from its own cache.

    Attributes:
      model: a model with `DecodingSpec.supports_speculative` (a `Decoder`), the same vocabulary.
      params: its parameters.
      k: tokens proposed per round, >= 1.
    """

    model: Any
    params: Any
    k: int = 4

    def __post_init__(self):
        as_int(self.k, "Draft.k", minimum=1)


class Stats(NamedTuple):
    """What a speculative run did (device scalars), over the rows still unfinished: `rounds`
    (passes of the model after the prompt's), proposals `proposed` and `accepted`,
    `row_rounds` (rounds summed over rows) and `kept` (tokens, each row its accepted + 1)."""

    rounds: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    row_rounds: jax.Array
    kept: jax.Array


class State(NamedTuple):
    """Between two rounds (a pytree, carried by `stream` from one jitted round to the next).

    Attributes:
      n: int32 `[batch]`, new tokens each row has made.
      token: `[batch]`, each row's last new token, not yet in the caches.
      context: the model's `decode_context`.
      cache: the model's cache, row b holding everything before its `token` (`pos[b] =
        lengths[b] + n[b] - 1`), or parked at `pos[b] = 0` once finished.
      draft_context, draft_cache: the draft's alike; None for prompt lookup.
      done: bool `[batch]`, rows that have emitted EOS (or `NO_TOKEN`).
      sequence: int32 `[batch, prompt_len + max_new_tokens]`: row b's `lengths[b]` prompt
        tokens, its new tokens, then pad.
      emitted: int32 scalar, the new-token columns complete in every row (what `stream` handed out).
      stats: the run's `Stats` so far.
    """

    n: jax.Array
    token: jax.Array
    context: Any
    cache: Any
    draft_context: Any
    draft_cache: Any
    done: jax.Array
    sequence: jax.Array
    emitted: jax.Array
    stats: Stats


@dataclasses.dataclass(frozen=True)
class _DraftSpec:
    """`Draft` less its parameters: the static half (its params are traced)."""

    model: Any
    k: int


def _log_probs(logits: jax.Array, request: DecodeRequest) -> jax.Array:
    """Log-probabilities over `[batch, ..., vocab]` logits: plain sampling's distribution for a
    sampling row, one-hot on the argmax for a greedy one."""
    s = request.sampling
    moved = jnp.moveaxis(logits, 0, -2)  # [..., batch, vocab]: the layout filtered_logits reads
    greedy = jnp.where(jax.nn.one_hot(jnp.argmax(moved, axis=-1), moved.shape[-1]) > 0, 0.0, -jnp.inf)

    def sample(_):
        sampled = jax.nn.log_softmax(s.filtered(moved), axis=-1)
        return jnp.where((s.temperature > 0)[:, None], sampled, greedy)

    # A cond, as in sample_token: when every row is greedy the vocabulary is not sorted.
    return jnp.moveaxis(jax.lax.cond(jnp.any(s.temperature > 0), sample, lambda _: greedy, None), -2, 0)


def _lookup(sequence: jax.Array, length: jax.Array, k: int, n: int) -> jax.Array:
    """Prompt lookup: `[batch, k]` tokens that followed the latest earlier occurrence of each
    row's last `j` tokens, `j` the longest up to `n` that occurred.

    Args:
      sequence: `[batch, L]`, row b's context in slots `0 .. length[b] - 1`.
      length: int32 `[batch]`, the slots each row has filled.
    """
    batch, L = sequence.shape
    length = length[:, None]  # [batch, 1]
    after = jnp.arange(L)[None, :]  # [1, L]: a candidate slot f, to follow an earlier match ending at f - 1
    # Slot s is padded's n + s; -1 (no token) before slot 0: the j-gram before f is padded[n + f - j: n + f].
    padded = jnp.concatenate([jnp.full((batch, n), -1, sequence.dtype), sequence], axis=1)  # [batch, n + L]
    tail = jnp.take_along_axis(padded, length + n - 1 - jnp.arange(n)[None, :], axis=1)  # [batch, n]: slots
    # length-1, length-2, ..
    match = jnp.ones((batch, L), bool)  # [batch, L]: the j tokens before f are the context's last j
    follows = jnp.full((batch,), -1)  # [batch]: the slot after the latest match found, -1 none
    for j in range(1, n + 1):
        match &= padded[:, n - j:n - j + L] == tail[:, j - 1:j]
        # An earlier occurrence (ending before the last token), of real tokens, of a j-gram the context has.
        found = match & (after < length) & (after - j >= 0) & (length - j >= 0)
        latest = jnp.max(jnp.where(found, after, -1), axis=1)
        follows = jnp.where(latest >= 0, latest, follows)  # a longer j-gram's match wins
    slots = follows[:, None] + jnp.arange(k)[None, :]  # [batch, k]
    known = (follows[:, None] >= 0) & (slots < length)
    proposal = jnp.take_along_axis(sequence, jnp.clip(slots, 0, L - 1), axis=1)
    return jnp.where(known, proposal, tail[:, :1])  # nothing found: any guess costs only its rejection


def _draft_proposals(draft: _DraftSpec, draft_params, request: DecodeRequest, token, context, draft_cache, key):
    """The draft's `k` tokens after `token`, their log-probabilities `[batch, k, vocab]`, and its
    cache. It takes k + 1 steps: the last writes the k-th token's K/V, so that a round that
    accepts all k finds them cached."""
    batch, k = token.shape[0], draft.k

    def step(i, carry):
        token, cache, proposals, q = carry
        logits, cache = draft.model.apply({"params": draft_params}, token[:, None], cache, context,
                                          method="decode_step")  # [batch, 1, vocab]
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
      log_q: `[batch, k, vocab]`, the proposer's; None for prompt lookup (q one-hot).

    Returns:
      `(accepted [batch], tokens [batch, k + 1])`: the leading proposals accepted, then a token
      drawn from the residual (from p after k), `NO_TOKEN` where its logits are not finite.
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


@struct.dataclass
class Speculative:
    """Speculative decoding with a proposer that `plan` fitted to the run.

    Attributes:
      proposer: a `PromptLookup`, or a draft model's static half (static).
      draft_params: the draft's parameters (traced); None for prompt lookup.
    """

    proposer: Any = struct.field(pytree_node=False)
    draft_params: Any = None

    @property
    def width(self) -> int:
        """Tokens a round writes into each row's caches: the last token and k proposals (the
        draft's k + 1 steps write as many)."""
        return self.proposer.k + 1

    def start(self, model: Decodable, params, request: DecodeRequest, mesh=None) -> State:
        """The prefill (the model's and the draft's) and token 0, as plain decoding picks it."""
        k, (batch, prompt_len) = self.proposer.k, request.prompt.shape
        context, token, cache, done = first_token(model, params, request, mesh, extra_capacity=k)
        draft_context = draft_cache = None
        if isinstance(self.proposer, _DraftSpec):
            draft_context, _, draft_cache = prefill(self.proposer.model, self.draft_params, request, mesh,
                                                    extra_capacity=k)
        slot = jnp.arange(prompt_len + request.max_new_tokens)[None, :]  # [1, L]
        lengths = jnp.asarray(request.lengths)[:, None]  # [batch, 1]
        prompt = jnp.pad(request.prompt, ((0, 0), (0, request.max_new_tokens)))  # [batch, L]
        sequence = jnp.where(slot < lengths, prompt, jnp.where(slot == lengths, token[:, None], request.pad_id))
        zero = jnp.zeros((), jnp.int32)
        return State(n=jnp.ones((batch,), jnp.int32), token=token, context=context, cache=cache,
                     draft_context=draft_context, draft_cache=draft_cache, done=done,
                     sequence=sequence.astype(jnp.int32), emitted=jnp.ones((), jnp.int32),
                     stats=Stats(zero, zero, zero, zero, zero))

    def round(self, model: Decodable, params, request: DecodeRequest, state: State):
        """One round: `(state, tokens [batch, max_new_tokens], count)`, the new tokens from column
        `state.emitted` on, the first `count` complete in every row."""
        k, max_new = self.proposer.k, request.max_new_tokens
        lengths = jnp.asarray(request.lengths)
        length = lengths + state.n  # [batch], slots of `sequence` each row has filled
        active = ~state.done & (state.n < max_new)  # [batch]
        key = jax.random.fold_in(jax.random.fold_in(request.key, 0x5BEC), state.stats.rounds)
        draft_key, verify_key = jax.random.split(key)
        if isinstance(self.proposer, PromptLookup):
            proposals, log_q, draft_cache = _lookup(state.sequence, length, k, self.proposer.n), None, None
        else:
            proposals, log_q, draft_cache = _draft_proposals(self.proposer, self.draft_params, request, state.token,
                                                             state.draft_context, state.draft_cache, draft_key)
        window = jnp.concatenate([state.token[:, None], proposals], axis=1)  # [batch, k + 1]
        logits, cache = model.apply({"params": params}, window, state.cache, state.context, method="decode_step")
        accepted, block = _verify(logits, proposals, log_q, request, verify_key)  # [batch], [batch, k + 1]

        m = jnp.where(active, jnp.minimum(accepted, max_new - state.n - 1), 0)  # [batch]: a row's last kept token
        position = jnp.arange(k + 1)[None, :]
        stop = stops(block, request.eos_id) & (position <= m[:, None])  # [batch, k + 1]: an EOS, or NO_TOKEN
        after_stop = (jnp.cumsum(stop, axis=1) - stop) > 0
        block = jnp.where(~active[:, None] | after_stop | (position > m[:, None]), request.pad_id, block)
        kept = jnp.where(active, m + 1, 0)  # [batch], tokens each row keeps
        done = state.done | (active & jnp.any(stop, axis=1))
        n = state.n + kept
        finished = done | (n >= max_new)

        # Each row's caches hold everything before its next token: `pos` set back past its
        # rejected slots; a finished row parked at 0.
        def moved(old, new):
            return new.replace(pos=jnp.where(finished, 0, old.pos + kept))

        cache = moved(state.cache, cache)
        if draft_cache is not None:
            draft_cache = moved(state.draft_cache, draft_cache)
        offset = jnp.arange(state.sequence.shape[1])[None, :] - length[:, None]  # [batch, L]: index into block
        new_slot = (offset >= 0) & (offset < kept[:, None])
        sequence = jnp.where(new_slot, jnp.take_along_axis(block, jnp.clip(offset, 0, k), axis=1), state.sequence)
        stats = Stats(rounds=state.stats.rounds + 1, proposed=state.stats.proposed + k * jnp.sum(active),
                      accepted=state.stats.accepted + jnp.sum(jnp.where(active, accepted, 0)),
                      row_rounds=state.stats.row_rounds + jnp.sum(active), kept=state.stats.kept + jnp.sum(kept))
        # Complete in every row: up to the slowest unfinished row; all finished, up to the longest.
        ready = jnp.where(jnp.all(finished), jnp.max(n), jnp.min(jnp.where(finished, max_new, n)))
        columns = jnp.take_along_axis(sequence, jnp.minimum(lengths[:, None] + state.emitted + jnp.arange(max_new),
                                                            sequence.shape[1] - 1), axis=1)
        columns = jnp.where(state.emitted + jnp.arange(max_new) < max_new, columns, request.pad_id)
        count = ready - state.emitted
        state = State(n=n, token=jnp.take_along_axis(block, m[:, None], axis=1)[:, 0], context=state.context,
                      cache=cache, draft_context=state.draft_context, draft_cache=draft_cache, done=done,
                      sequence=sequence, emitted=ready, stats=stats)
        return state, columns, count

    def finish(self, model: Decodable, params, request: DecodeRequest, state: State):
        """From `state`, rounds until every row is finished: `(tokens [batch, max_new_tokens], Stats)`."""
        def keep_going(state):
            return jnp.any(~state.done & (state.n < request.max_new_tokens))

        state = span_loops(keep_going, lambda state: self.round(model, params, request, state)[0], state, self.width)
        slot = jnp.asarray(request.lengths)[:, None] + jnp.arange(request.max_new_tokens)[None, :]
        return jnp.take_along_axis(state.sequence, slot, axis=1), state.stats


def plan(model: Decodable, request: DecodeRequest, speculative) -> Speculative | None:
    """The `Speculative` strategy with `k` shrunk so the last round fits `max_seq_len` (the
    model's and the draft's), or None (plain decoding) where not one proposal fits.

    Raises:
      ValueError: a model that cannot be driven, beam search, a draft of another vocabulary
        or a shorter `max_seq_len`.
    """
    if not isinstance(speculative, (PromptLookup, Draft)):
        raise ValueError(f"speculative must be a PromptLookup or a Draft (got {type(speculative).__name__})")
    spec = model.decoding_spec()
    if not spec.supports_speculative:
        raise ValueError(f"speculative decoding needs a model that continues its prompt "
                         f"(DecodingSpec.supports_speculative, as the decoder-only Decoder); "
                         f"{type(model).__name__} does not")
    if spec.keeps_state or (isinstance(speculative, Draft) and speculative.model.decoding_spec().keeps_state):
        raise ValueError("speculative decoding sets a row back past its rejected proposals, which a linear-attention "
                         "layer's state cannot be (DecodingSpec.keeps_state): decode without `speculative`")
    if request.num_beams != 1:
        raise ValueError("speculative decoding picks one continuation per row: leave num_beams at 1")
    # The last round starts at position prompt_len + max_new_tokens - 2 and writes k + 1 slots.
    limit = spec.max_seq_len - request.prompt.shape[1] - request.max_new_tokens + 1
    if isinstance(speculative, Draft):
        draft_spec = speculative.model.decoding_spec()
        if not draft_spec.supports_speculative:
            raise ValueError(f"Draft.model must continue its prompt (DecodingSpec.supports_speculative, as a "
                             f"Decoder); {type(speculative.model).__name__} does not")
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
        return None
    if isinstance(speculative, PromptLookup):
        return Speculative(proposer=dataclasses.replace(speculative, k=k))
    return Speculative(proposer=_DraftSpec(model=speculative.model, k=k), draft_params=speculative.params)
