"""Autoregressive generation: prefill the prompt once, then one token per step.

The loop speaks to the model only through the `Decodable` protocol: its context
(computed once per prompt), its cache and its step `(tokens, cache) -> (logits, cache)`.
The decoder-only model steps itself; the encoder-decoder encodes the source once and
steps its decoder from BOS. The whole loop (prefill, every step, every sample, the stop
at EOS) runs inside one `jit`; the sampling settings are traced arrays, so a new
temperature or top-k reuses the compiled loop.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decoding.beam_search import beam_search
from jaxformer.decoding.inputs import DecodeOptions, DecodeRequest
from jaxformer.decoding.protocol import Decodable
from jaxformer.decoding.speculative import Draft, PromptLookup, plan, speculative_decode, stream_rounds
from jaxformer.decoding.steps import as_given, check_picked, checked_steps, first_token, pick, prefill, step_fn
from jaxformer.sharding import mesh_of

if TYPE_CHECKING:
    from typing_extensions import Unpack


@functools.partial(jax.jit, static_argnames=("model", "mesh"))
def decode_loop(model: Decodable, params, request: DecodeRequest, mesh=None) -> jax.Array:
    """The whole decoding run as one program.

    A `while_loop` that stops at `max_new_tokens` or once every row has produced EOS
    (the remaining slots hold `pad_id`); or, with `num_beams > 1`, beam search.

    Args:
      model: a `Decodable` model.
      params: its parameters.
      request: from `DecodeRequest.create`.
      mesh: the mesh the parameters live on (`sharding.mesh_of(params)`), or None.

    Returns:
      int32 `[batch, P + max_new_tokens]`: the decoder prompt, then the new tokens; a row
      whose logits held NaN or inf has `NO_TOKEN` there, then `pad_id`.
    """
    max_new_tokens, num_beams = request.max_new_tokens, request.num_beams
    if num_beams > 1:
        # Every row becomes num_beams adjacent rows: one cache, one batch for all beams.
        beams = request.repeat_rows(num_beams)
        context, logits, cache = prefill(model, params, beams, mesh)
        tokens, _ = beam_search(step_fn(model, params, context), logits, cache, num_beams=num_beams,
                                max_new_tokens=max_new_tokens, eos_id=request.eos_id, pad_id=request.pad_id,
                                length_penalty=request.length_penalty)
        return jnp.concatenate([request.decoder_prompt, tokens], axis=1)

    tokens = _continue(model, params, request, *first_token(model, params, request, mesh))
    return jnp.concatenate([request.decoder_prompt, tokens], axis=1)


def _continue(model: Decodable, params, request: DecodeRequest, context, token, cache, done) -> jax.Array:
    """From each row's token 0: the `while_loop` that stops at `max_new_tokens` or once
    every row is done. Returns int32 `[batch, max_new_tokens]`, token 0 first."""
    max_new_tokens = request.max_new_tokens
    step = step_fn(model, params, context)
    tokens = jnp.full((request.prompt.shape[0], max_new_tokens), request.pad_id, jnp.int32).at[:, 0].set(token)

    def keep_going(state):
        i, _, _, done, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, token, cache, done, tokens = state
        logits, cache = step(token[:, None], cache)
        token, done = pick(request, i, logits[:, -1], done)
        return i + 1, token, cache, done, tokens.at[:, i].set(token)

    return jax.lax.while_loop(keep_going, body, (1, token, cache, done, tokens))[-1]


# Streaming: the same start and the same step as the loop above, one jitted call per
# token. `stream` drives them; a caller with its own loop (a server, say) can too. Or
# `decode_rest` runs the loop above from the start's state.

@functools.partial(jax.jit, static_argnames=("model", "mesh"))
def stream_start(model: Decodable, params, request: DecodeRequest, mesh=None):
    """The prefill and token 0 of every row: `(context, token, cache, done)`."""
    return first_token(model, params, request, mesh)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def stream_step(model: Decodable, params, request: DecodeRequest, context, i, token, cache, done):
    """Token `i` of every row from token `i - 1`: `(token, cache, done)`.

    The cache is donated: XLA writes the new K/V into its buffers instead of copying it,
    so the cache passed in must not be used again.
    """
    logits, cache = step_fn(model, params, context)(token[:, None], cache)
    token, done = pick(request, i, logits[:, -1], done)
    return token, cache, done


@functools.partial(jax.jit, static_argnames=("model",))
def decode_rest(model: Decodable, params, request: DecodeRequest, context, token, cache, done) -> jax.Array:
    """After `stream_start`, the rest of the run as one program: `generate`'s loop.

    `stream_start` then `decode_rest` give `generate`'s new tokens (greedy decoding and
    sampling) in two programs, so that a caller can time the prefill apart without a
    trip to the host per token.

    Returns:
      int32 `[batch, max_new_tokens]`: every row's new tokens, token 0 first (`pad_id`
      after a row's EOS, and after the `NO_TOKEN` of a row whose logits held NaN or inf).
    """
    return _continue(model, params, request, context, token, cache, done)


def generate(model: Decodable, params, prompt, *, speculative: PromptLookup | Draft | None = None,
             **options: Unpack[DecodeOptions]) -> jax.Array:
    """Continues each prompt by up to `max_new_tokens` tokens with a KV-cached decode loop.

    The whole loop (prefill, every step, every sample) is one jitted function.

    Args:
      model: a `Decoder`, or a `VanillaTransformer` (then `prompt` is the source, and the
        decoder starts from `bos_id`).
      params: its parameter tree (`variables['params']`), on one device or placed on a
        mesh (`jaxformer.sharding`); the cache is then placed alike.
      prompt: int `[batch, prompt_len]` token ids, `prompt_len >= 1` (for the
        encoder-decoder: the source, right-padded with `pad_id`).
      speculative: decoder-only: `PromptLookup(k, n)` or `Draft(model, params, k)` to
        decode speculatively (`jaxformer.decoding.speculative`): the same tokens at
        temperature 0, the same distribution when sampling, in fewer passes of the model
        when the proposals are accepted. None decodes a token per pass.
      **options: `max_new_tokens` (required), `key`, `temperature`, `top_k`, `top_p`,
        `eos_id`, `pad_id`, `bos_id`, `prompt_lengths`, `num_beams`, `length_penalty`;
        see `DecodeOptions`.

    Returns:
      int32 `[batch, decoder_prompt_len + max_new_tokens]`: the decoder's prompt (`prompt`
      as given, or the BOS column for the encoder-decoder) followed by the new tokens.

    Changing the prompt's values or any setting but `max_new_tokens` and `num_beams`
    reuses the compiled loop; a new prompt shape, `max_new_tokens` or `num_beams`
    compiles a new one.

    Raises:
      ValueError: a bad argument, before anything is compiled.
      NonFiniteLogitsError: rows whose logits held NaN or inf, read once the run is done
        (the tokens made, the other rows' whole, are its `tokens`).
    """
    request = DecodeRequest.create(model, prompt, **options)
    if speculative is None:
        out = decode_loop(model, params, request, mesh_of(params))
    else:
        out, _ = speculative_decode(model, params, request, *plan(model, request, speculative))
    # The prompt as the caller gave it (right-padded rows included), then the new tokens.
    out = as_given(out, prompt, options)
    check_picked(out, request.max_new_tokens, request.pad_id)
    return out


def stream(model: Decodable, params, prompt, *, speculative: PromptLookup | Draft | None = None,
           **options: Unpack[DecodeOptions]) -> Iterator[np.ndarray]:
    """Yields the new tokens one step at a time, as `generate` would produce them.

    Takes `generate`'s arguments (without beam search) and gives the same tokens (the
    same key gives the same samples): the prefill and each step are jitted once and
    driven from Python, with the cache donated to each step. Stops after
    `max_new_tokens` steps, or once every row has produced an `eos_id`. With
    `speculative`, each jitted call is a round, and its tokens are yielded one by one.

    Yields:
      int32 `[batch]` numpy arrays: step i's token of each row (`pad_id` once a row is done).

    Raises:
      ValueError: a bad argument, before anything is compiled.
      NonFiniteLogitsError: at the step where a row's logits held NaN or inf, instead of
        yielding it (the steps so far, that one's included, are its `tokens`).
    """
    request = DecodeRequest.create(model, prompt, **options)
    if request.num_beams != 1:
        raise ValueError("stream decodes one token per step for each row: beam search needs generate(num_beams=)")
    pad_id = request.pad_id
    request = jax.device_put(request)  # once, rather than its host arrays at every step
    yield from checked_steps(_steps(model, params, request, speculative), pad_id)


def _steps(model: Decodable, params, request: DecodeRequest, speculative) -> Iterator[np.ndarray]:
    """`stream`'s tokens as the device makes them, a step (or a speculative round) per jitted call."""
    if speculative is not None:
        proposer, draft_params = plan(model, request, speculative)
        if proposer is not None:
            yield from stream_rounds(model, params, request, proposer, draft_params)
            return
    context, token, cache, done = stream_start(model, params, request, mesh_of(params))
    for i in range(1, request.max_new_tokens + 1):
        yield np.asarray(token)
        if i == request.max_new_tokens or np.asarray(done).all():  # (on the host: no extra device op)
            return
        token, cache, done = stream_step(model, params, request, context, jnp.int32(i), token, cache, done)
