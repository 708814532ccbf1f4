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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.cache import KVCache
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


def _decode(step: Callable, logits: jax.Array, cache, sample: Callable, key: jax.Array,
            n_new: int, eos_id: jax.Array, pad_id: jax.Array) -> jax.Array:
    """Samples up to `n_new` tokens, feeding each back through `step`.

    A row that has produced `eos_id` emits `pad_id` from then on, and the loop stops as
    soon as every row has (shapes stay fixed: the remaining slots hold `pad_id`).

    Args:
      step: `(tokens [batch, 1], cache) -> (logits [batch, 1, vocab], cache)`.
      logits: `[batch, vocab]`, the prefill's logits at the last prompt position.
      cache: the cache after the prefill.
      sample: `(logits [batch, vocab], key) -> [batch]` token ids.
      key: PRNG key; step i samples with `fold_in(key, i)`.
      n_new: tokens to generate (static).
      eos_id: int32 scalar; -1 for none.
      pad_id: int32 scalar written after a row's EOS.

    Returns:
      `[batch, n_new]` int32 new tokens.
    """

    def pick(i, logits, done):
        token = jnp.where(done, pad_id, sample(logits, jax.random.fold_in(key, i)))  # [batch]
        return token, done | (token == eos_id)

    # The first token comes from the prefill's logits, so the loop below runs n_new - 1
    # forward passes: the last token is never fed back.
    token, done = pick(0, logits, jnp.zeros(logits.shape[0], bool))
    tokens = jnp.full((logits.shape[0], n_new), pad_id, jnp.int32).at[:, 0].set(token)  # [batch, n_new]

    def keep_going(state):
        i, _, _, done, _ = state
        return (i < n_new) & ~jnp.all(done)

    def body(state):
        i, token, cache, done, tokens = state
        logits, cache = step(token[:, None], cache)
        token, done = pick(i, logits[:, -1], done)
        return i + 1, token, cache, done, tokens.at[:, i].set(token)

    return jax.lax.while_loop(keep_going, body, (1, token, cache, done, tokens))[-1]


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def _generate_jit(model, params, prompt, key, temperature, top_k, top_p, eos_id, pad_id, bos_id,
                  max_new_tokens: int):
    variables = {"params": params}
    batch = prompt.shape[0]
    if isinstance(model, VanillaTransformer):
        # The source is encoded once and its cross-attention K/V projected once; the
        # decoder starts from BOS.
        memory = model.apply(variables, prompt, method="encode")  # [batch, S, d_model]
        memory_kv = model.apply(variables, memory, method="cross_kv")

        def step(tokens, cache):
            return model.apply(variables, tokens, None, prompt, cache=cache, memory_kv=memory_kv, method="decode")

        decoder_prompt = jnp.full((batch, 1), bos_id, jnp.int32)
    else:
        def step(tokens, cache):
            return model.apply(variables, tokens, cache)

        decoder_prompt = prompt

    def sample(logits, key):
        return sample_token(logits, key, temperature, top_k, top_p)

    # Capacity: the prompt plus every new token but the last (which is never fed back).
    cache = KVCache.create(model.config, batch, capacity=decoder_prompt.shape[1] + max_new_tokens - 1)
    logits, cache = step(decoder_prompt, cache)  # prefill: the whole prompt in one call
    new_tokens = _decode(step, logits[:, -1], cache, sample, key, max_new_tokens, eos_id, pad_id)
    return jnp.concatenate([decoder_prompt, new_tokens], axis=1)


def _per_row(value, batch: int, name: str, dtype) -> np.ndarray:
    """A knob given as a scalar or one value per row, as a `[batch]` array."""
    array = np.asarray(value, dtype)
    if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or hold one value per row ({batch}), got shape {array.shape}")
    return np.broadcast_to(array, (batch,))


def generate(model, params, prompt, *, max_new_tokens: int, key: jax.Array | None = None,
             temperature=0.0, top_k=None, top_p=None, eos_id: int | None = None,
             pad_id: int | None = None, bos_id: int | None = None) -> jax.Array:
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

    Returns:
      int32 `[batch, decoder_prompt_len + max_new_tokens]`: the decoder's prompt (`prompt`,
      or the BOS column for the encoder-decoder) followed by the new tokens.

    Changing the prompt's values, `temperature`, `top_k`, `top_p`, `key`, `eos_id`, `pad_id`
    or `bos_id` reuses the compiled loop; a new prompt shape or `max_new_tokens` compiles a
    new one.
    """
    config = model.config
    seq2seq = isinstance(model, VanillaTransformer)
    prompt_vocab, out_vocab = ((config.src_vocab_size, config.tgt_vocab_size) if seq2seq
                               else (config.vocab_size, config.vocab_size))
    check_token_ids(prompt, prompt_vocab, "prompt")
    batch, prompt_len = np.shape(prompt)
    if batch < 1 or prompt_len < 1:
        raise ValueError(f"prompt must hold at least one token per row, got shape {np.shape(prompt)}")
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

    def as_int32(value, default):
        return jnp.asarray(default if value is None else value, jnp.int32)

    return _generate_jit(model, params, jnp.asarray(prompt, jnp.int32), key, jnp.asarray(temperature),
                         jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p), as_int32(eos_id, -1),
                         as_int32(pad_id, 0), as_int32(bos_id, 0), max_new_tokens)
