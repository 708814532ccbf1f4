"""Beam search over any step function and any cache pytree.

Each row keeps `num_beams` alive hypotheses. A step ranks every alive beam's extensions by
log-probability; those among the `num_beams` best that end in EOS join the row's finished
pool, and the `num_beams` best that do not go on (the `2 * num_beams` best hold them). Every
cache leaf with a batch axis follows its beams (`gather_beams`), so any pytree cache works.

The search stops when no alive beam can beat the worst finished one: a log-probability
only falls as the beam grows, and with `length_penalty >= 0` the norm is largest at the
longest length, so `alive_logp / length_norm(max_len)` bounds what an alive beam can reach.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.decodable import Decodable
from jaxformer.decoding.request import DecodeRequest, is_eos
from jaxformer.decoding.steps import NO_TOKEN, finite_logits, prefill, span_loops, step_fn


class BeamState(NamedTuple):
    """After the prefill of every beam (a row's beams adjacent, `batch * num_beams` rows).

    Attributes:
      context: the model's `decode_context` of the repeated prompts.
      logits: `[batch * num_beams, vocab]` after the prompt (a row's beams alike).
      cache: the cache after the prefill.
    """

    context: Any
    logits: jax.Array
    cache: Any


@struct.dataclass
class Beam:
    """Beam search with `request.num_beams` beams per row: one program, nothing to stream."""

    def start(self, model: Decodable, params, request: DecodeRequest, mesh=None) -> BeamState:
        """Every row as `num_beams` adjacent rows, prefilled in one batch."""
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
    """GNMT's length normalisation `((5 + length) / 6) ** length_penalty` (Wu et al., 2016)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** length_penalty


def gather_beams(tree, parents: jax.Array, num_beams: int):
    """New beam j of row b from old beam `parents[b, j]` (int `[batch, num_beams]`), in every
    `[batch * num_beams, ...]` leaf of `tree`; other leaves are left as they are."""
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
      logits: `[batch * num_beams, vocab]` after the prompt (a row's copies identical).
      cache: the cache after the prefill, a row's beams adjacent.
      num_beams, max_new_tokens: static ints.
      eos_id, pad_id, length_penalty: as `DecodeRequest` holds them.

    Returns:
      `(tokens int32 [batch, max_new_tokens], score [batch])`: each row's best beam and its
      `log p / length_norm(length)`. A row whose logits were not finite at step i: its
      likeliest alive beam's first i tokens, `NO_TOKEN`, then pad; score NaN.
    """
    vocab = logits.shape[-1]
    batch = logits.shape[0] // num_beams
    neg_inf = jnp.float32(-jnp.inf)

    def select(i, logits, alive_logp, alive_tokens, done_tokens, done_score):
        """Extends the alive beams by token i: the new pools and the parents."""
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
        """`select`, but a row whose logits are not finite keeps its pools; `failed_at` `[batch]`
        records its step (-1 while finite)."""
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
    i, (alive_logp, alive_tokens, done_tokens, done_score), _, _, failed_at = span_loops(
        keep_going, body, state, width=1)  # (a step writes one token per beam)
    # Beams still alive at the end compete too, scored at the length they reached.
    scores = jnp.concatenate([done_score, alive_logp / length_norm(i, length_penalty)], axis=1)  # [batch, 2K]
    tokens = jnp.concatenate([done_tokens, alive_tokens], axis=1)
    best = jnp.argmax(scores, axis=1)  # [batch]
    tokens, score = tokens[jnp.arange(batch), best], scores[jnp.arange(batch), best]  # [batch, max_new_tokens]
    # A stopped row: its likeliest alive beam (top_k sorts them) up to its step, then NO_TOKEN; pad after.
    stopped = jnp.where(jnp.arange(max_new_tokens) == failed_at[:, None], NO_TOKEN, alive_tokens[:, 0])
    failed = (failed_at >= 0)[:, None]  # [batch, 1]
    return jnp.where(failed, stopped, tokens), jnp.where(failed[:, 0], jnp.nan, score)
