"""What every decoding loop shares: the model's step, the prompt's prefill, and picking
each row's token (`loop`'s plain loop and stream, `speculative`'s rounds)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decoding.inputs import DecodeRequest, is_eos
from jaxformer.decoding.protocol import Decodable
from jaxformer.sharding import cache_shardings


def step_fn(model: Decodable, params, context) -> Callable:
    """`step(tokens [batch, T], cache) -> (logits [batch, T, vocab], cache)`."""
    return lambda tokens, cache: model.apply({"params": params}, tokens, cache, context, method="decode_step")


def prefill(model: Decodable, params, request: DecodeRequest, mesh=None, extra_capacity: int = 0):
    """Runs the decoder's whole prompt through the model once.

    Args:
      extra_capacity: cache slots beyond the run's own (a speculative round writes k
        proposals past the last token it keeps).

    Returns:
      `(context, logits, cache)`: the step's context, logits `[batch, vocab]` at the
      prompt's last position, and the cache holding the prompt.
    """
    context = model.apply({"params": params}, request.prompt, method="decode_context")
    # Capacity: the prompt plus every new token but the last (which is never fed back).
    capacity = request.decoder_prompt.shape[1] + request.max_new_tokens - 1 + extra_capacity
    cache = model.init_cache(request.prompt.shape[0], capacity).replace(start=request.start)
    if mesh is not None:  # rows over `data`, kv heads over `model`: each device keeps its own part
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
    logits, cache = step_fn(model, params, context)(request.decoder_prompt, cache)
    return context, logits[:, -1], cache


def pick(request: DecodeRequest, i, logits: jax.Array, done: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token `i` of each row from `logits` `[batch, vocab]`: sampled with `fold_in(key, i)`,
    or `pad_id` for rows already done; and the rows done after it."""
    token = request.sampling.pick(logits, jax.random.fold_in(request.key, i))
    token = jnp.where(done, request.pad_id, token)  # [batch]
    return token, done | is_eos(token, request.eos_id)


def first_token(model: Decodable, params, request: DecodeRequest, mesh=None, extra_capacity: int = 0):
    """The prefill and the first token: `(context, token, cache, done)`."""
    context, logits, cache = prefill(model, params, request, mesh, extra_capacity)
    token, done = pick(request, 0, logits, jnp.zeros(request.prompt.shape[0], bool))
    return context, token, cache, done


def as_given(out: jax.Array, prompt, options: dict) -> jax.Array:
    """`out` with the prompt as the caller gave it (a ragged batch's right padding)."""
    if options.get("prompt_lengths") is None:
        return out
    return out.at[:, :np.shape(prompt)[1]].set(jnp.asarray(prompt))
