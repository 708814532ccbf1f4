"""The front door: `generate` and `stream` check a request once, choose a strategy and run it.

A strategy (`plain.Plain`, `beam.Beam`, `speculative.Speculative`) is a small pytree (its
static settings and traced inputs) with the same three methods, all traceable:

- `start(model, params, request, mesh) -> state`: the prefill and each row's first token;
- `round(model, params, request, state) -> (state, tokens, count)`: one pass of the
  model; `tokens [batch, W]`'s first `count` columns are the next new tokens of every row;
- `finish(model, params, request, state) -> (tokens [batch, max_new_tokens], figures)`:
  the rest of the run as one `while_loop`.

Four jitted entry points drive any of them: `run` (the whole run, one program: what
`generate` calls), `start`, `advance` (one round, the state donated: what `stream` calls)
and `finish` (the rest after `start`, so that the prefill can be timed apart). A strategy's
static settings are part of the pytree's structure, so each compiles once; its traced
inputs (a draft's parameters), the prompt's values and the sampling knobs never
recompile. A strategy module imports no other strategy: this module alone knows them all.
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
from jaxformer.decoding.steps import as_given, check_picked, checked_steps
from jaxformer.sharding import mesh_of

PLAIN = Plain()


@functools.partial(jax.jit, static_argnames=("model", "mesh"))
def run(model: Decodable, params, request: DecodeRequest, strategy=PLAIN, mesh=None):
    """The whole decoding run as one program.

    Args:
      model: a `Decodable` model.
      params: its parameters.
      request: from `DecodeRequest.create`.
      strategy: `Plain()`, `Beam()` or a `Speculative` from `plan`.
      mesh: the mesh the parameters live on (`sharding.mesh_of(params)`), or None.

    Returns:
      `(tokens, figures)`: int32 `[batch, P + max_new_tokens]`, the decoder prompt then the
      new tokens (a row whose logits held NaN or inf has `NO_TOKEN` there, then `pad_id`);
      and the strategy's figures (speculative `Stats`, beam scores, or None).
    """
    state = strategy.start(model, params, request, mesh)
    tokens, figures = strategy.finish(model, params, request, state)
    return jnp.concatenate([request.decoder_prompt, tokens], axis=1), figures


@functools.partial(jax.jit, static_argnames=("model", "mesh"))
def start(model: Decodable, params, request: DecodeRequest, mesh=None, strategy=PLAIN):
    """The strategy's prefill and first tokens: its state (`Plain`'s: `PlainState`)."""
    return strategy.start(model, params, request, mesh)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("state",))
def advance(model: Decodable, params, request: DecodeRequest, state, strategy=PLAIN):
    """One round from `state`: `(state, tokens, count)` (see the module docstring).

    The state is donated: XLA writes the new K/V into its cache's buffers instead of
    copying them, so the state passed in must not be used again.
    """
    return strategy.round(model, params, request, state)


@functools.partial(jax.jit, static_argnames=("model",))
def finish(model: Decodable, params, request: DecodeRequest, state, strategy=PLAIN):
    """After `start`, the rest of the run as one program: `(new tokens [batch,
    max_new_tokens], figures)`, token 0 first, as `run` makes them."""
    return strategy.finish(model, params, request, state)


def choose(model: Decodable, request: DecodeRequest, speculative: PromptLookup | Draft | None):
    """The strategy for a checked request: beam search for `num_beams > 1`, speculative
    decoding where asked for and `plan` finds room for a proposal, else plain decoding.

    Raises:
      ValueError: what `plan` refuses.
    """
    if speculative is not None:
        strategy = plan(model, request, speculative)
        return PLAIN if strategy is None else strategy
    return Beam() if request.num_beams > 1 else PLAIN


def generate(model: Decodable, params, prompt, *, speculative: PromptLookup | Draft | None = None,
             **options) -> jax.Array:
    """Continues each prompt by up to `max_new_tokens` tokens with a KV-cached decode loop.

    The whole loop (prefill, every step, every sample) is one jitted function.

    Args:
      model: a `Decoder`, or a `VanillaTransformer` (then `prompt` is the source, and the
        decoder starts from `bos_id`).
      params: its parameter tree (`variables['params']`), on one device or placed on a
        mesh (`jaxformer.sharding`); the cache is then placed alike.
      prompt: int `[batch, prompt_len]` token ids, `prompt_len >= 1` (for the
        encoder-decoder: the source, right-padded with `pad_id`).
      speculative: `PromptLookup(k, n)` or `Draft(model, params, k)` to decode
        speculatively (`jaxformer.decoding.speculative`), for a model that supports it
        (`DecodingSpec.supports_speculative`): the same tokens at temperature 0, the same
        distribution when sampling, in fewer passes of the model when the proposals are
        accepted. None decodes a token per pass.
      **options: `DecodeOptions`' fields: `max_new_tokens` (required), `key`,
        `temperature`, `top_k`, `top_p`, `eos_id`, `pad_id`, `bos_id`, `prompt_lengths`,
        `num_beams`, `length_penalty` (`DecodeOptions(...).keywords()` gives them).

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
    return _generate(model, params, prompt, speculative, options)[0]


class RunStats(NamedTuple):
    """A speculative run's figures, on the host.

    Attributes:
      k: proposals per round (the proposer's `k`, less where `max_seq_len` left less
        room; 0: plain decoding, for a single new token).
      rounds: passes of the model after the prompt's.
      acceptance: accepted proposals / proposals scored (by unfinished rows).
      new_tokens: tokens emitted per row (EOS and the padding after it included).
      tokens_per_row_round: tokens an unfinished row kept per round, on average (its own
        accepted + 1: each row advances by its own acceptance).
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
    """`generate(model, params, prompt, speculative=..., **options)`, with the run's figures.

    Returns:
      `(tokens, RunStats)`: `generate`'s output, and what the rounds did.

    Raises:
      ValueError, NonFiniteLogitsError: as `generate`.
    """
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
    """Yields the new tokens one step at a time, as `generate` would produce them.

    Takes `generate`'s arguments (without beam search) and gives the same tokens (the
    same key gives the same samples): the prefill and each round are jitted once and
    driven from Python, with the state donated to each round. Stops after
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
        state, tokens, count = advance(model, params, request, state, strategy)
        tokens, count = np.asarray(tokens), min(int(count), request.max_new_tokens - made)
        yield from (tokens[:, j] for j in range(count))
        made += count
