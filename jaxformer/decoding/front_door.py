"""The front door: `generate` and `stream` check a request once, choose a strategy and run it.

A strategy (`plain.Plain`, `beam.Beam`, `speculative.Speculative`) is a small pytree with
three traceable methods, `start`, `round` and `finish`; the four jitted entry points below
drive any of them. docs/decoding.md ("Strategies") describes the layout. This module alone
knows every strategy.
"""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.decodable import Decodable
from jaxformer.decoding.beam import Beam
from jaxformer.decoding.plain import Plain
from jaxformer.decoding.request import DecodeRequest
from jaxformer.decoding.speculative import Draft, PromptLookup, Speculative, plan
from jaxformer.decoding.steps import as_given, check_picked, checked_steps, host_reach, with_span
from jaxformer.sharding import mesh_of

PLAIN = Plain()
# XLA:CPU gathers bfloat16 rows, or slices a bfloat16 array, through a float32 copy of the
# whole array; in a loop XLA's loop-invariant code motion lifts the copy of an array the loop
# does not change out of the loop, so the program holds the array again at twice its bytes:
# the embedding table a decoding loop gathers from (1 GB for a 128k x 2048 bf16 table), and
# the stacked weights a scanned model's loop over its layers slices (OLMoE-1B-7B's prefill
# asked for 27.7 GB). Kept in the loop, the conversion folds into the rows or the layer read.
# The programs below loop (`start` over a scanned model's layers).
NO_LOOP_HOISTING = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


@functools.partial(jax.jit, static_argnames=("model", "mesh"), compiler_options=NO_LOOP_HOISTING)
def run(model: Decodable, params, request: DecodeRequest, strategy=PLAIN, mesh=None):
    """The whole decoding run as one program: the strategy's `start`, then its `finish`.

    Args:
      request: from `DecodeRequest.create`.
      strategy: `Plain()`, `Beam()` or a `Speculative` from `plan`.
      mesh: the mesh the parameters live on (`sharding.mesh_of(params)`), or None.

    Returns:
      `(tokens int32 [batch, P + max_new_tokens], figures)`: the decoder prompt, the new
      tokens (`NO_TOKEN` where a row's logits were not finite, `pad_id` after); the
      strategy's figures (speculative `Stats`, beam scores, or None).
    """
    state = strategy.start(model, params, request, mesh)
    tokens, figures = strategy.finish(model, params, request, state)
    return jnp.concatenate([request.decoder_prompt, tokens], axis=1), figures


@functools.partial(jax.jit, static_argnames=("model", "mesh"), compiler_options=NO_LOOP_HOISTING)
def start(model: Decodable, params, request: DecodeRequest, mesh=None, strategy=PLAIN):
    """The strategy's prefill and first tokens: its state (`Plain`'s: `PlainState`)."""
    return strategy.start(model, params, request, mesh)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("state",), compiler_options=NO_LOOP_HOISTING)
def advance(model: Decodable, params, request: DecodeRequest, state, strategy=PLAIN):
    """One round from `state`: `(state, tokens [batch, W], count)`, the first `count` columns new.

    The state is donated, so the cache is updated in place: do not use it again.
    """
    return strategy.round(model, params, request, state)


@functools.partial(jax.jit, static_argnames=("model",), compiler_options=NO_LOOP_HOISTING)
def finish(model: Decodable, params, request: DecodeRequest, state, strategy=PLAIN):
    """After `start`, the rest of the run: `(tokens [batch, max_new_tokens], figures)`, as `run`."""
    return strategy.finish(model, params, request, state)


def choose(model: Decodable, request: DecodeRequest, speculative: PromptLookup | Draft | None):
    """The strategy for a checked request: beams for `num_beams > 1`, speculative where asked
    for and `plan` leaves room for a proposal, else plain decoding."""
    if speculative is not None:
        strategy = plan(model, request, speculative)
        return PLAIN if strategy is None else strategy
    return Beam() if request.num_beams > 1 else PLAIN


def generate(model: Decodable, params, prompt, *, speculative: PromptLookup | Draft | None = None,
             **options) -> jax.Array:
    """Continues each prompt by up to `max_new_tokens` tokens, the whole loop one jitted program.

    Args:
      model: a `Decoder`, or a `VanillaTransformer` (then `prompt` is the source).
      params: its parameters, on one device or placed on a mesh (the cache is placed alike).
      prompt: int `[batch, prompt_len]` token ids, `prompt_len >= 1`.
      speculative: `PromptLookup(k, n)`, `Draft(model, params, k)` or None (a token per pass).
      **options: `DecodeOptions`' fields (`max_new_tokens` required).

    Returns:
      int32 `[batch, decoder_prompt_len + max_new_tokens]`: the decoder's prompt (`prompt` as
      given, or the BOS column for the encoder-decoder), then the new tokens.

    Raises:
      ValueError: a bad argument, before anything is compiled.
      NonFiniteLogitsError: rows whose logits were not finite, once the run is done.

    docs/decoding.md describes the options, what recompiles, and each strategy.
    """
    return _generate(model, params, prompt, speculative, options)[0]


def compile_generate(model: Decodable, params, prompt, *, speculative: PromptLookup | Draft | None = None,
                     **options) -> None:
    """Compiles the program `generate(model, params, prompt, ...)` runs, and runs nothing.

    Takes `generate`'s arguments; only the shapes and types of `params` count (the host
    arrays of a model that is still training will do). Called on a thread while other work
    goes on, it takes the compile off a later `generate` of the same shapes, which runs the
    program at once (or, still compiling, waits for this compile rather than repeating it).

    Raises:
      ValueError: as `generate`, before anything is compiled.
    """
    request = DecodeRequest.create(model, prompt, **options)
    run.lower(model, params, request, choose(model, request, speculative), mesh_of(params)).compile()


class RunStats(NamedTuple):
    """A speculative run's figures, on the host.

    Attributes:
      k: proposals per round (less where `max_seq_len` left less room; 0: plain decoding).
      rounds: passes of the model after the prompt's.
      acceptance: accepted proposals / proposals scored (by unfinished rows).
      new_tokens: tokens emitted per row (EOS and the padding after it included).
      tokens_per_row_round: an unfinished row's tokens per round (its accepted + 1), on average.
    """

    k: int
    rounds: int
    acceptance: float
    new_tokens: int
    tokens_per_row_round: float

    @property
    def tokens_per_pass(self) -> float:
        """New tokens per pass of the model, the prefill's pass (token 0) included."""
        return self.new_tokens / (self.rounds + 1)


def speculative_generate(model: Decodable, params, prompt, speculative: PromptLookup | Draft,
                         **options):
    """`generate(..., speculative=speculative)`, and the run's `RunStats`: `(tokens, stats)`."""
    out, strategy, figures, request = _generate(model, params, prompt, speculative, options)
    if isinstance(strategy, Speculative):
        rounds, proposed, accepted, row_rounds, kept = (int(x) for x in figures)
        return out, RunStats(k=strategy.proposer.k, rounds=rounds, acceptance=accepted / max(proposed, 1),
                             new_tokens=request.max_new_tokens, tokens_per_row_round=kept / max(row_rounds, 1))
    # Plain decoding: a pass per token after the prefill's, nothing proposed.
    return out, RunStats(k=0, rounds=request.max_new_tokens - 1, acceptance=0.0, new_tokens=request.max_new_tokens,
                         tokens_per_row_round=1.0)


def _generate(model, params, prompt, speculative, options: dict):
    """`generate`'s work: `(tokens, strategy, figures, request)`, the tokens checked."""
    request = DecodeRequest.create(model, prompt, **options)
    strategy = choose(model, request, speculative)
    out, figures = run(model, params, request, strategy, mesh_of(params))
    # The prompt as the caller gave it (right-padded rows included), then the new tokens.
    out = as_given(out, prompt, options)
    check_picked(out, request.max_new_tokens, request.pad_id)
    return out, strategy, figures, request


def stream(model: Decodable, params, prompt, *, speculative: PromptLookup | Draft | None = None,
           **options) -> Iterator[np.ndarray]:
    """Yields each step's new tokens, int32 numpy `[batch]`, the same tokens `generate` makes.

    Takes `generate`'s arguments but beam search; the prefill and each round are jitted once
    and driven from Python. Raises as `generate` does, `NonFiniteLogitsError` at the step
    where a row's logits were not finite (its `tokens` are the steps so far).
    """
    request = DecodeRequest.create(model, prompt, **options)
    if request.num_beams != 1:
        raise ValueError("stream decodes one token per step for each row: beam search needs generate(num_beams=)")
    strategy = choose(model, request, speculative)
    pad_id = request.pad_id
    request = jax.device_put(request)  # once, rather than its host arrays at every round
    yield from checked_steps(_steps(model, params, request, strategy), pad_id)


def _steps(model: Decodable, params, request: DecodeRequest, strategy) -> Iterator[np.ndarray]:
    """`stream`'s tokens as the device makes them, a round per jitted call."""
    state = start(model, params, request, mesh_of(params), strategy)
    yield np.asarray(state.token)  # every strategy's state holds token 0 after its start
    made = 1
    while made < request.max_new_tokens and not np.asarray(state.done).all():  # (host reads, no device op)
        # The round reads the span that holds its writes: a program per bucket, compiled once each.
        state = with_span(state, host_reach(state, strategy.width))
        state, tokens, count = advance(model, params, request, state, strategy)
        tokens, count = np.asarray(tokens), min(int(count), request.max_new_tokens - made)
        yield from (tokens[:, j] for j in range(count))
        made += count
