"""Beam search over any step function and any cache pytree.

Each source row keeps `num_beams` alive hypotheses. A step extends every alive beam by
every token and ranks the extensions by log-probability. Those among the `num_beams` best
that end in EOS join the row's finished pool, scored by `log p / length_norm(length, length_penalty)`;
the `num_beams` best that do not end go on (looking at the `2 * num_beams` best is enough to
find them). The caches follow their beams: every cache leaf with a batch axis is gathered
with the beams' parent indices (`jax.tree.map`), so the search works for any model
whose cache is a pytree with the batch first.

A row whose logits (any alive beam's) hold NaN or inf cannot be ranked: it stops there,
its pools kept as they were, and returns its likeliest alive beam so far, then
`NO_TOKEN` (`steps.pick`'s rule for one beam).

The search stops when no alive beam can still beat the worst finished one. A beam's
log-probability only falls as it grows, and with `length_penalty >= 0` the length norm is
largest at the longest length, so `alive_logp / length_norm(max_len, length_penalty)` bounds any score
an alive beam can reach.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.decodable import Decodable
from jaxformer.decoding.request import DecodeRequest, is_eos
from jaxformer.decoding.steps import NO_TOKEN, finite_logits, prefill, step_fn


class BeamState(NamedTuple):
    """After the prefill of every beam.

    Attributes:
      context: the model's `decode_context` of the repeated prompts.
      logits: `[batch * num_beams, vocab]` after the prompt (a row's beams alike).
      cache: the cache after the prefill, batch `batch * num_beams`, a row's beams adjacent.
    """

    context: Any
    logits: jax.Array
    cache: Any


@struct.dataclass
class Beam:
    """Beam search with `request.num_beams` beams per row (`beam_search`): one program,
    no rounds to stream (the best beam is known at the end only)."""

    def start(self, model: Decodable, params, request: DecodeRequest, mesh=None) -> BeamState:
        """Every row as `num_beams` adjacent rows, prefilled: one cache, one batch for all beams."""
        return BeamState(*prefill(model, params, request.repeat_rows(request.num_beams), mesh))

    def round(self, model, params, request, state):
        raise ValueError("beam search picks its tokens at the end: it has no rounds to stream "
                         "(use generate(num_beams=))")

    def finish(self, model: Decodable, params, request: DecodeRequest, state: BeamState):
        """`(tokens [batch, max_new_tokens], score [batch])`: each row's best beam and its score."""
        return beam_search(step_fn(model, params, state.context), state.logits, state.cache,
                           num_beams=request.num_beams, max_new_tokens=request.max_new_tokens,
                           eos_id=request.eos_id, pad_id=request.pad_id, length_penalty=request.length_penalty)


def length_norm(length, length_penalty) -> jax.Array:
    """GNMT's length normalisation `((5 + length) / 6) ** length_penalty` (Wu et al., 2016).

    A finished beam's score is `log p / length_norm(length, length_penalty)`; a penalty
    of 0 compares raw log-probabilities (favouring short outputs), a larger one favours
    longer outputs.
    """
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** length_penalty


def gather_beams(tree, parents: jax.Array, num_beams: int):
    """Reorders the beams of every `[batch * num_beams, ...]` leaf of `tree`.

    Args:
      tree: a pytree (a cache); leaves without a leading `batch * num_beams` axis (a
        shared write position, say) are left as they are.
      parents: int `[batch, num_beams]`, for each new beam the index of the beam it extends.
      num_beams: beams per row.

    Returns:
      The tree with new beam j of row b taken from old beam `parents[b, j]` of row b.
    """
    batch = parents.shape[0]
    flat = (parents + num_beams * jnp.arange(batch)[:, None]).reshape(-1)  # [batch * num_beams]

    def gather(leaf):
        return jnp.take(leaf, flat, axis=0) if leaf.ndim and leaf.shape[0] == batch * num_beams else leaf

    return jax.tree.map(gather, tree)


def beam_search(step: Callable, logits: jax.Array, cache, *, num_beams: int, max_new_tokens: int, eos_id: jax.Array,
                pad_id: jax.Array, length_penalty: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The best `max_new_tokens`-token continuation of each row, by beam search.

    Args:
      step: `(tokens [batch * num_beams, 1], cache) -> (logits [batch * num_beams, 1, vocab], cache)`.
      logits: `[batch * num_beams, vocab]` next-token logits after the prompt (each row's
        `num_beams` copies are identical).
      cache: the cache after the prefill, batch `batch * num_beams`, beams of a row adjacent.
      num_beams: beams per row (static).
      max_new_tokens: tokens to generate (static).
      eos_id: int32 `[n_eos]`, the ids that finish a beam; `[-1]` for none (then every beam
        runs to `max_new_tokens` tokens).
      pad_id: int32 scalar filling a finished beam after its EOS.
      length_penalty: the length normalisation's exponent, >= 0 (a float32 scalar).

    Returns:
      `(tokens, score)`: tokens int32 `[batch, max_new_tokens]` of each row's best beam (padded
      after its EOS); score `[batch]`, its `log p / length_norm(length, length_penalty)`. A row
      whose logits held NaN or inf at step i: its likeliest alive beam's first i tokens, then
      `NO_TOKEN`, then pad; score NaN.
    """
    vocab = logits.shape[-1]
    batch = logits.shape[0] // num_beams
    neg_inf = jnp.float32(-jnp.inf)

    def select(i, logits, alive_logp, alive_tokens, done_tokens, done_score):
        """Extends the alive beams by token i; returns the new pools and the parents."""
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(batch, num_beams, vocab)
        candidates = (alive_logp[:, :, None] + logp).reshape(batch, num_beams * vocab)
        top_logp, top_index = jax.lax.top_k(candidates, 2 * num_beams)  # [batch, 2 * num_beams]
        parent, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        sequences = jnp.take_along_axis(alive_tokens, parent[:, :, None], axis=1)  # [batch, 2K, max_new_tokens]
        sequences = jnp.where(jnp.arange(max_new_tokens) == i, token[:, :, None], sequences)
        ends = is_eos(token, eos_id)
        # A hypothesis finishes when its EOS ranks among the num_beams best extensions (so
        # that one beam is exactly greedy decoding); the finished pool keeps the num_beams
        # best of the old finished and the new ones.
        finishes = ends & (jnp.arange(2 * num_beams) < num_beams)  # top_k sorts, best first
        new_score = jnp.where(finishes, top_logp / length_norm(i + 1, length_penalty), neg_inf)
        pool_score = jnp.concatenate([done_score, new_score], axis=1)
        pool_tokens = jnp.concatenate([done_tokens, sequences], axis=1)
        done_score, keep = jax.lax.top_k(pool_score, num_beams)
        done_tokens = jnp.take_along_axis(pool_tokens, keep[:, :, None], axis=1)
        # Alive pool: the best num_beams candidates that did not end in EOS.
        alive_logp, keep = jax.lax.top_k(jnp.where(ends, neg_inf, top_logp), num_beams)
        alive_tokens = jnp.take_along_axis(sequences, keep[:, :, None], axis=1)
        parents = jnp.take_along_axis(parent, keep, axis=1)  # [batch, num_beams]
        last = jnp.take_along_axis(token, keep, axis=1).reshape(-1)  # [batch * num_beams]
        return alive_logp, alive_tokens, done_tokens, done_score, parents, last

    def extend(i, logits, pools, failed_at):
        """`select`, but a row whose logits hold NaN or inf (any beam's) keeps its pools and
        records step i in `failed_at` (`[batch]`, -1 while its logits are finite)."""
        *new_pools, parents, last = select(i, logits, *pools)
        stopped = (failed_at >= 0) | ~finite_logits(logits.reshape(batch, num_beams * vocab))  # [batch]
        pools = [jnp.where(stopped.reshape(-1, *[1] * (new.ndim - 1)), old, new) for new, old in zip(new_pools, pools)]
        return pools, parents, last, jnp.where(stopped & (failed_at < 0), i, failed_at)

    # All copies of a row start identical: only beam 0 may expand at first, or the row
    # would fill its beams with num_beams copies of one hypothesis.
    alive_logp = jnp.tile(jnp.array([0.0] + [-jnp.inf] * (num_beams - 1), jnp.float32), (batch, 1))
    alive_tokens = jnp.full((batch, num_beams, max_new_tokens), pad_id, jnp.int32)
    done_tokens, done_score = alive_tokens, jnp.full((batch, num_beams), neg_inf)
    pools, parents, last, failed_at = extend(0, logits, [alive_logp, alive_tokens, done_tokens, done_score],
                                             jnp.full((batch,), -1, jnp.int32))
    cache = gather_beams(cache, parents, num_beams)

    def keep_going(state):
        i, (alive_logp, _, _, done_score), _, _, failed_at = state
        best_possible = alive_logp.max(axis=1) / length_norm(max_new_tokens, length_penalty)  # [batch]
        can_improve = (best_possible > done_score.min(axis=1)) & (failed_at < 0)  # a stopped row is over
        return (i < max_new_tokens) & jnp.any(can_improve)

    def body(state):
        i, pools, last, cache, failed_at = state
        logits, cache = step(last[:, None], cache)
        pools, parents, last, failed_at = extend(i, logits[:, -1], pools, failed_at)
        return i + 1, pools, last, gather_beams(cache, parents, num_beams), failed_at

    state = (1, pools, last, cache, failed_at)
    i, (alive_logp, alive_tokens, done_tokens, done_score), _, _, failed_at = jax.lax.while_loop(
        keep_going, body, state)
    # Beams still alive at the end compete too, scored at the length they reached.
    scores = jnp.concatenate([done_score, alive_logp / length_norm(i, length_penalty)], axis=1)  # [batch, 2K]
    tokens = jnp.concatenate([done_tokens, alive_tokens], axis=1)
    best = jnp.argmax(scores, axis=1)  # [batch]
    tokens, score = tokens[jnp.arange(batch), best], scores[jnp.arange(batch), best]  # [batch, max_new_tokens]
    # A stopped row: its likeliest alive beam (top_k sorts them) up to its step, then NO_TOKEN; pad after.
    stopped = jnp.where(jnp.arange(max_new_tokens) == failed_at[:, None], NO_TOKEN, alive_tokens[:, 0])
    failed = (failed_at >= 0)[:, None]  # [batch, 1]
    return jnp.where(failed, stopped, tokens), jnp.where(failed[:, 0], jnp.nan, score)
