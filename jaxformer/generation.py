"""Autoregressive generation: prefill the prompt once, then one token per step.

The loop is written against a step function `step(tokens, cache) -> (logits, cache)`,
so it does not care which model produced the logits or what the cache holds: the
decoder-only model steps itself; the encoder-decoder encodes the source once and steps
its decoder from BOS. The whole loop (prefill, every step, every sample, the stop at
EOS) runs inside one `jit`; the sampling knobs are traced arrays, so a new temperature
or top-k reuses the compiled loop.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxformer.beam_search import beam_search
from jaxformer.cache import KVCache
from jaxformer.sharding import cache_shardings, mesh_of
from jaxformer.validation import check_fits, check_token_ids
from jaxformer.vanilla import VanillaTransformer


def sample_token(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
                 top_p: jax.Array) -> jax.Array:
    """Picks one token per row: greedy, or sampled after temperature, top-k and top-p.

    Every knob is a traced array, one value per row, so new values never recompile.
    The filters run in the order HF transformers uses: scale by the temperature, keep
    the k largest logits, then keep the smallest set of those whose probability
    (renormalised among them) reaches p, and sample from what is left.

    Args:
      logits: `[batch, vocab]` next-token logits.
      key: PRNG key for this step.
      temperature: `[batch]`; 0 takes the argmax for that row, > 0 samples from
        `softmax(logits / temperature)`.
      top_k: int `[batch]` in `[1, vocab]`; `vocab` keeps every token.
      top_p: `[batch]` in `(0, 1]`; 1 keeps every token.

    Returns:
      `[batch]` int32 token ids. Tokens tied with the last one kept are kept too.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch]

    def sample(_):
        scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        ranked = -jnp.sort(-scaled, axis=-1)  # [batch, vocab], largest first
        rank = jnp.arange(scaled.shape[-1])[None, :]  # [1, vocab]
        in_top_k = rank < top_k[:, None]
        probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)  # renormalised over the top k
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        # The nucleus: tokens whose predecessors hold less than p (the first always does).
        # p = 1 is "off" outright, so a cumulative sum that rounds below 1 cannot cut a token.
        in_nucleus = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        n_keep = jnp.sum(in_top_k & in_nucleus, axis=-1)  # [batch], >= 1
        cutoff = jnp.take_along_axis(ranked, n_keep[:, None] - 1, axis=-1)  # [batch, 1], the last kept logit
        sampled = jax.random.categorical(key, jnp.where(scaled < cutoff, -jnp.inf, scaled), axis=-1)
        return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

    # A cond, not a where: when every row is greedy the sort and the sampling are skipped.
    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)


@struct.dataclass
class _Knobs:
    """The traced settings of one decoding run (arrays, so new values never recompile)."""

    key: jax.Array
    temperature: jax.Array  # [batch] float32
    top_k: jax.Array  # [batch] int32
    top_p: jax.Array  # [batch] float32
    eos_id: jax.Array  # [] int32, -1 for none
    pad_id: jax.Array  # [] int32
    bos_id: jax.Array  # [] int32
    start: jax.Array  # [batch] int32, each prompt's left padding (its first real slot)
    length_penalty: jax.Array  # [] float32, beam search's alpha


def _pick(knobs: _Knobs, i, logits: jax.Array, done: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token `i` of each row from `logits` `[batch, vocab]`: sampled with `fold_in(key, i)`,
    or `pad_id` for rows already done; and the rows done after it."""
    token = sample_token(logits, jax.random.fold_in(knobs.key, i), knobs.temperature, knobs.top_k, knobs.top_p)
    token = jnp.where(done, knobs.pad_id, token)  # [batch]
    return token, done | (token == knobs.eos_id)


def _context(model, params, prompt):
    """What every step reads besides the cache: for the encoder-decoder, the cross-attention
    K/V of the source, encoded and projected once; nothing for the decoder-only model."""
    if isinstance(model, VanillaTransformer):
        memory = model.apply({"params": params}, prompt, method="encode")  # [batch, S, d_model]
        return model.apply({"params": params}, memory, method="cross_kv")
    return None


def _step_fn(model, params, prompt, context) -> Callable:
    """`step(tokens [batch, T], cache) -> (logits [batch, T, vocab], cache)` for either model."""
    if isinstance(model, VanillaTransformer):
        return lambda tokens, cache: model.apply({"params": params}, tokens, None, prompt, cache=cache,
                                                 memory_kv=context, method="decode")
    return lambda tokens, cache: model.apply({"params": params}, tokens, cache)


def _prefill(model, params, prompt, knobs: _Knobs, max_new_tokens: int, mesh=None):
    """Runs the decoder's whole prompt through the model once.

    Returns:
      `(decoder_prompt, logits, cache, context)`: logits `[batch, vocab]` at the prompt's
      last position, the cache holding the prompt, and the step's context.
    """
    batch = prompt.shape[0]
    # The encoder-decoder's decoder starts from BOS; the decoder-only model from the prompt.
    decoder_prompt = (jnp.full((batch, 1), knobs.bos_id, jnp.int32) if isinstance(model, VanillaTransformer)
                      else prompt)
    context = _context(model, params, prompt)
    # Capacity: the prompt plus every new token but the last (which is never fed back).
    cache = KVCache.create(model.config, batch, capacity=decoder_prompt.shape[1] + max_new_tokens - 1)
    cache = cache.replace(start=knobs.start)
    if mesh is not None:  # rows over `data`, kv heads over `model`: each device keeps its own part
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
    logits, cache = _step_fn(model, params, prompt, context)(decoder_prompt, cache)
    return decoder_prompt, logits[:, -1], cache, context


def _start(model, params, prompt, knobs: _Knobs, max_new_tokens: int, mesh=None):
    """The prefill and the first token: `(decoder_prompt, token, cache, done, context)`."""
    decoder_prompt, logits, cache, context = _prefill(model, params, prompt, knobs, max_new_tokens, mesh)
    token, done = _pick(knobs, 0, logits, jnp.zeros(prompt.shape[0], bool))
    return decoder_prompt, token, cache, done, context


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "num_beams", "mesh"))
def _generate_jit(model, params, prompt, knobs: _Knobs, max_new_tokens: int, num_beams: int = 1, mesh=None):
    """The whole decoding run in one program: a `while_loop` that stops at `max_new_tokens`
    or once every row has produced EOS (the remaining slots hold `pad_id`); or, with
    `num_beams > 1`, beam search."""
    if num_beams > 1:
        # Every row becomes num_beams adjacent rows: one cache, one batch for all beams.
        prompt = jnp.repeat(prompt, num_beams, axis=0)
        knobs = knobs.replace(start=jnp.repeat(knobs.start, num_beams))
        decoder_prompt, logits, cache, context = _prefill(model, params, prompt, knobs, max_new_tokens, mesh)
        tokens, _ = beam_search(_step_fn(model, params, prompt, context), logits, cache, n_beams=num_beams,
                                n_new=max_new_tokens, eos_id=knobs.eos_id, pad_id=knobs.pad_id,
                                alpha=knobs.length_penalty)
        return jnp.concatenate([decoder_prompt[::num_beams], tokens], axis=1)

    decoder_prompt, token, cache, done, context = _start(model, params, prompt, knobs, max_new_tokens, mesh)
    step = _step_fn(model, params, prompt, context)
    tokens = jnp.full((prompt.shape[0], max_new_tokens), knobs.pad_id, jnp.int32).at[:, 0].set(token)

    def keep_going(state):
        i, _, _, done, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, token, cache, done, tokens = state
        logits, cache = step(token[:, None], cache)
        token, done = _pick(knobs, i, logits[:, -1], done)
        return i + 1, token, cache, done, tokens.at[:, i].set(token)

    tokens = jax.lax.while_loop(keep_going, body, (1, token, cache, done, tokens))[-1]  # [batch, max_new_tokens]
    return jnp.concatenate([decoder_prompt, tokens], axis=1)


# Streaming: the same start and the same step as the loop above, one jitted call per token.
_stream_start = jax.jit(_start, static_argnames=("model", "max_new_tokens", "mesh"))


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def _stream_next(model, params, prompt, context, knobs: _Knobs, i, token, cache, done):
    # The cache is donated: XLA writes the new K/V into its buffers instead of copying it.
    logits, cache = _step_fn(model, params, prompt, context)(token[:, None], cache)
    token, done = _pick(knobs, i, logits[:, -1], done)
    return token, cache, done


def _per_row(value, batch: int, name: str, dtype) -> np.ndarray:
    """A knob given as a scalar or one value per row, as a `[batch]` array."""
    array = np.asarray(value, dtype)
    if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or hold one value per row ({batch}), got shape {array.shape}")
    return np.broadcast_to(array, (batch,))


def generate(model, params, prompt, *, max_new_tokens: int, key: jax.Array | None = None,
             temperature=0.0, top_k=None, top_p=None, eos_id: int | None = None,
             pad_id: int | None = None, bos_id: int | None = None, prompt_lengths=None, num_beams: int = 1,
             length_penalty: float = 0.0) -> jax.Array:
    """Continues each prompt by up to `max_new_tokens` tokens with a KV-cached decode loop.

    The whole loop (prefill, every step, every sample) is one jitted function.

    Args:
      model: a `Decoder`, or a `VanillaTransformer` (then `prompt` is the source, and the
        decoder starts from `bos_id`).
      params: its parameter tree (`variables['params']`).
      prompt: int `[batch, prompt_len]` token ids, `prompt_len >= 1` (for the
        encoder-decoder: the source, right-padded with `pad_id`).
      max_new_tokens: tokens to generate, >= 1. The output (decoder prompt plus new
        tokens) must fit `config.max_seq_len`.
      key: PRNG key (`jax.random.key(seed)`); required when a temperature is > 0. The same
        key gives the same tokens.
      temperature: 0 for greedy argmax, > 0 to sample from `softmax(logits / temperature)`.
        A scalar, or one value per row (as are `top_k` and `top_p`).
      top_k: sample only among the k most likely tokens, `1 <= top_k <= vocab`; None keeps
        them all.
      top_p: nucleus sampling: only among the most likely tokens whose probability adds up
        to `top_p`, in `(0, 1]`; None (or 1) keeps them all.
      eos_id: a row that produces it is finished: it emits `pad_id` afterwards, and the
        loop stops once every row is finished. None never stops early.
      pad_id: filler after EOS; defaults to the config's `pad_id`, or 0.
      bos_id: the encoder-decoder's first decoder token (required for it, unused otherwise).
      prompt_lengths: decoder-only: each row's prompt length, `1 .. prompt_len`, for a
        batch of prompts of different lengths, right-padded (what follows a row's length
        is ignored). Each row then decodes as it would alone. None: every row is full.
      num_beams: 1 decodes greedily or samples; > 1 runs beam search (deterministic: the
        temperature must be 0, top-k and top-p unset) and returns each row's best beam.
      length_penalty: beam search's alpha in `((5 + length) / 6) ** alpha`, >= 0; a beam
        scores `log p / that`. 0 compares raw log-probabilities.

    Returns:
      int32 `[batch, decoder_prompt_len + max_new_tokens]`: the decoder's prompt (`prompt`
      as given, or the BOS column for the encoder-decoder) followed by the new tokens.

    Changing the prompt's values, `temperature`, `top_k`, `top_p`, `key`, `eos_id`, `pad_id`
    or `bos_id` reuses the compiled loop; a new prompt shape or `max_new_tokens` compiles a
    new one.
    """
    if type(num_beams) is not int or num_beams < 1:
        raise ValueError(f"num_beams must be an int >= 1, got {num_beams!r}")
    if num_beams > 1 and (np.any(np.asarray(temperature) != 0) or top_k is not None or top_p is not None):
        raise ValueError("beam search is deterministic: with num_beams > 1 leave temperature at 0 "
                         "and top_k, top_p unset")
    if not np.ndim(length_penalty) == 0 or not float(length_penalty) >= 0:
        raise ValueError(f"length_penalty must be a scalar >= 0, got {length_penalty!r}")
    knobs, decoder_input = _prepare(model, prompt, max_new_tokens, key, temperature, top_k, top_p, eos_id, pad_id,
                                    bos_id, prompt_lengths, length_penalty)
    out = _generate_jit(model, params, decoder_input, knobs, max_new_tokens, num_beams, mesh_of(params))
    # The prompt as the caller gave it (right-padded rows included), then the new tokens.
    return out if prompt_lengths is None else out.at[:, :np.shape(prompt)[1]].set(jnp.asarray(prompt))


def stream(model, params, prompt, *, max_new_tokens: int, key: jax.Array | None = None,
           temperature=0.0, top_k=None, top_p=None, eos_id: int | None = None,
           pad_id: int | None = None, bos_id: int | None = None, prompt_lengths=None) -> Iterator[np.ndarray]:
    """Yields the new tokens one step at a time, as `generate` would produce them.

    Takes `generate`'s arguments and gives the same tokens (the same key gives the same
    samples): the prefill and each step are jitted once and driven from Python, with the
    cache donated to each step. Stops after `max_new_tokens` steps, or once every row has
    produced `eos_id`.

    Yields:
      int32 `[batch]` numpy arrays: step i's token of each row (`pad_id` once a row is done).
    """
    knobs, prompt = _prepare(model, prompt, max_new_tokens, key, temperature, top_k, top_p, eos_id, pad_id, bos_id,
                             prompt_lengths, 0.0)
    _, token, cache, done, context = _stream_start(model, params, prompt, knobs, max_new_tokens, mesh_of(params))
    for i in range(1, max_new_tokens + 1):
        yield np.asarray(token)
        if i == max_new_tokens or np.asarray(done).all():  # (on the host: no extra device op)
            return
        token, cache, done = _stream_next(model, params, prompt, context, knobs, jnp.int32(i), token, cache, done)


def _prepare(model, prompt, max_new_tokens, key, temperature, top_k, top_p, eos_id, pad_id, bos_id,
             prompt_lengths, length_penalty) -> tuple[_Knobs, jax.Array]:
    """Checks `generate`'s arguments on the host.

    Returns:
      `(knobs, prompt)`: the knobs as arrays, and the prompt as the model reads it (rows
      of `prompt_lengths` moved to the right end, left-padded).
    """
    config = model.config
    seq2seq = isinstance(model, VanillaTransformer)
    prompt_vocab, out_vocab = ((config.src_vocab_size, config.tgt_vocab_size) if seq2seq
                               else (config.vocab_size, config.vocab_size))
    prompt = np.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be 2-D [batch, seq] with at least one token per row, got shape {prompt.shape}")
    batch, prompt_len = prompt.shape
    lengths = None
    if prompt_lengths is not None:
        if seq2seq:
            raise ValueError("prompt_lengths is for the decoder-only model; an encoder-decoder's source "
                             "is right-padded with pad_id")
        lengths = _per_row(prompt_lengths, batch, "prompt_lengths", np.float64)
        if not np.all((lengths >= 1) & (lengths <= prompt_len) & (lengths == np.round(lengths))):
            raise ValueError(f"prompt_lengths must be ints in [1, prompt_len={prompt_len}], got {lengths.tolist()}")
        lengths = lengths.astype(np.int32)
    # Only the real tokens must be ids: what follows a row's length is ignored.
    real = np.arange(prompt_len)[None, :] < (prompt_len if lengths is None else lengths[:, None])
    check_token_ids(np.where(real, prompt, 0) if np.issubdtype(prompt.dtype, np.integer) else prompt,
                    prompt_vocab, "prompt")
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if seq2seq:
        check_fits(0, prompt_len, config.max_seq_len, "prompt (source) length", "max_seq_len")
        check_fits(1, max_new_tokens, config.max_seq_len, "BOS + max_new_tokens", "max_seq_len")
        if bos_id is None:
            raise ValueError("bos_id is required for an encoder-decoder: the decoder's first token")
    else:
        check_fits(prompt_len, max_new_tokens, config.max_seq_len, "prompt length + max_new_tokens", "max_seq_len")
    temperature = _per_row(temperature, batch, "temperature", np.float32)
    if not np.all(temperature >= 0):  # NaN fails too
        raise ValueError(f"temperature must be >= 0, got {temperature.tolist()}")
    top_k = _per_row(out_vocab if top_k is None else top_k, batch, "top_k", np.float64)
    if not np.all((top_k >= 1) & (top_k <= out_vocab) & (top_k == np.round(top_k))):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size={out_vocab}], got {top_k.tolist()}")
    top_p = _per_row(1.0 if top_p is None else top_p, batch, "top_p", np.float32)
    if not np.all((top_p > 0) & (top_p <= 1)):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p.tolist()}")
    pad_id = getattr(config, "pad_id", 0) if pad_id is None else pad_id
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id), ("bos_id", bos_id)):
        if value is not None and (type(value) is not int or not 0 <= value < out_vocab):
            raise ValueError(f"{name} must be an int in [0, vocab_size={out_vocab}), got {value!r}")
    if key is None:
        if np.any(temperature > 0):
            raise ValueError("key is required when temperature > 0: pass key=jax.random.key(seed)")
        key = jax.random.key(0)  # unused by greedy decoding; keeps the traced signature fixed

    prompt = np.where(real, prompt, 0).astype(np.int32)
    start = np.zeros(batch, np.int32)
    if lengths is not None:
        # Left padding: row b's tokens move to the end, so every row's next token goes to
        # the same cache slot; the slots before start[b] are masked out.
        start = (prompt_len - lengths).astype(np.int32)
        source = np.arange(prompt_len)[None, :] - start[:, None]  # [batch, prompt_len]
        prompt = np.where(source >= 0, np.take_along_axis(prompt, np.maximum(source, 0), axis=1), 0)

    def as_int32(value, default):
        return jnp.asarray(default if value is None else value, jnp.int32)

    knobs = _Knobs(key=key, temperature=jnp.asarray(temperature), top_k=jnp.asarray(top_k, jnp.int32),
                   top_p=jnp.asarray(top_p), eos_id=as_int32(eos_id, -1), pad_id=as_int32(pad_id, 0),
                   bos_id=as_int32(bos_id, 0), start=jnp.asarray(start),
                   length_penalty=jnp.asarray(length_penalty, jnp.float32))
    return knobs, jnp.asarray(prompt, jnp.int32)
