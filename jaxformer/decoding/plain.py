"""Plain decoding: greedy or sampled, one token per pass of the model."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.decodable import Decodable
from jaxformer.decoding.request import DecodeRequest
from jaxformer.decoding.steps import first_token, pick, span_loops, step_fn


class PlainState(NamedTuple):
    """Between two steps.

    Attributes:
      context: the model's `decode_context`.
      token: `[batch]`, the last token picked, not yet in the cache.
      cache: the cache, holding everything before `token`.
      done: bool `[batch]`, rows that have produced EOS (or `NO_TOKEN`).
      n: int32 scalar, new tokens picked so far.
    """

    context: Any
    token: jax.Array
    cache: Any
    done: jax.Array
    n: jax.Array


@struct.dataclass
class Plain:
    """Greedy decoding or sampling, per row, as `request.sampling` says."""

    @property
    def width(self) -> int:
        """Tokens a round writes into each row's cache."""
        return 1

    def start(self, model: Decodable, params, request: DecodeRequest, mesh=None) -> PlainState:
        """The prefill and token 0 of every row."""
        context, token, cache, done = first_token(model, params, request, mesh)
        return PlainState(context, token, cache, done, jnp.ones((), jnp.int32))

    def round(self, model: Decodable, params, request: DecodeRequest, state: PlainState):
        """New token `state.n` of every row: `(state, tokens [batch, 1], 1)`."""
        logits, cache = step_fn(model, params, state.context)(state.token[:, None], state.cache)
        token, done = pick(request, state.n, logits[:, -1], state.done)
        return PlainState(state.context, token, cache, done, state.n + 1), token[:, None], jnp.ones((), jnp.int32)

    def finish(self, model: Decodable, params, request: DecodeRequest, state: PlainState):
        """From `state`, `round`s until `max_new_tokens` or every row done: `(tokens [batch,
        max_new_tokens], None)`, token 0 first, `pad_id` after a row's stop."""
        max_new_tokens = request.max_new_tokens
        tokens = jnp.full((request.prompt.shape[0], max_new_tokens), request.pad_id, jnp.int32)
        tokens = jax.lax.dynamic_update_slice(tokens, state.token[:, None], (0, state.n - 1))  # [batch, max_new]

        def keep_going(carry):
            state, _ = carry
            return (state.n < max_new_tokens) & ~jnp.all(state.done)

        def body(carry):
            state, tokens = carry
            state, token, _ = self.round(model, params, request, state)
            return state, jax.lax.dynamic_update_slice(tokens, token, (0, state.n - 1))

        return span_loops(keep_going, body, (state, tokens), self.width)[1], None
