"""Autoregressive generation: prefill the prompt once, then one token per step.

The loop is written against a step function `step(tokens, cache) -> (logits, cache)`,
so it does not care which model produced the logits or what the cache holds. The
whole loop (prefill, every step, every sample) runs inside one `jit`; the sampling
knobs are traced arrays, so a new temperature or top-k reuses the compiled loop.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.cache import KVCache
from jaxformer.validation import check_fits, check_token_ids


def sample_token(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array) -> jax.Array:
    """Picks one token per row.

    Args:
      logits: `[batch, vocab]` next-token logits.
      key: PRNG key for this step.
      temperature: scalar; 0 means argmax, otherwise sample from `softmax(logits / T)`.
      top_k: int scalar in `[1, vocab]`; only the k largest logits may be sampled
        (`vocab` keeps them all). Ties with the k-th value are kept.

    Returns:
      `[batch]` int32 token ids.
    """

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(_):
        scaled = logits.astype(jnp.float32) / temperature  # [batch, vocab]
        vocab = scaled.shape[-1]
        # k-th largest = entry vocab - k of the ascending sort; k is traced, so index dynamically.
        kth = jax.lax.dynamic_index_in_dim(jnp.sort(scaled, axis=-1), vocab - top_k, axis=-1)  # [batch, 1]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)

    # A cond, not a where: greedy decoding skips the sort and the sampling entirely.
    return jax.lax.cond(temperature > 0, sample, greedy, None)


def _decode(step: Callable, logits: jax.Array, cache, keys: jax.Array, sample: Callable) -> jax.Array:
    """Samples `len(keys)` tokens, feeding each back through `step`.

    Args:
      step: `(tokens [batch, 1], cache) -> (logits [batch, 1, vocab], cache)`.
      logits: `[batch, vocab]`, the prefill's logits at the last prompt position.
      cache: the cache after the prefill.
      keys: `[n_new]` PRNG keys, one per new token.
      sample: `(logits [batch, vocab], key) -> [batch]` token ids.

    Returns:
      `[batch, n_new]` int32 new tokens.
    """

    def body(carry, key):
        logits, cache = carry
        token = sample(logits, key)  # [batch]
        logits, cache = step(token[:, None], cache)
        return (logits[:, -1], cache), token

    # The last token is sampled after the scan: it is never fed back, so its forward
    # pass would be wasted work.
    (logits, _), tokens = jax.lax.scan(body, (logits, cache), keys[:-1])  # tokens [n_new - 1, batch]
    last = sample(logits, keys[-1])  # [batch]
    return jnp.concatenate([tokens.T, last[:, None]], axis=1)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def _generate_jit(model, params, prompt, key, temperature, top_k, max_new_tokens: int):
    batch, prompt_len = prompt.shape
    cache = KVCache.create(model.config, batch, capacity=prompt_len + max_new_tokens)

    def step(tokens, cache):
        return model.apply({"params": params}, tokens, cache)

    def sample(logits, key):
        return sample_token(logits, key, temperature, top_k)

    logits, cache = step(prompt, cache)  # prefill: the whole prompt in one call
    new_tokens = _decode(step, logits[:, -1], cache, jax.random.split(key, max_new_tokens), sample)
    return jnp.concatenate([prompt, new_tokens], axis=1)


def generate(model, params, prompt, *, max_new_tokens: int, key: jax.Array | None = None,
             temperature: float = 0.0, top_k: int | None = None) -> jax.Array:
    """Continues each prompt by `max_new_tokens` tokens with a KV-cached decode loop.

    Args:
      model: a `Decoder`.
      params: its parameter tree (`variables['params']`).
      prompt: int `[batch, prompt_len]` token ids in `[0, vocab_size)`, `prompt_len >= 1`.
      max_new_tokens: tokens to generate, >= 1; `prompt_len + max_new_tokens` must not
        exceed `config.max_seq_len` (it is the cache capacity).
      key: PRNG key (`jax.random.key(seed)`); required when `temperature > 0`. The same key
        gives the same tokens.
      temperature: 0 for greedy argmax, > 0 to sample from `softmax(logits / temperature)`.
      top_k: sample only among the k most likely tokens, `1 <= top_k <= vocab_size`; None
        keeps them all.

    Returns:
      int32 `[batch, prompt_len + max_new_tokens]`: the prompt followed by the new tokens.

    Changing the prompt's values, `temperature`, `top_k` or `key` reuses the compiled loop;
    a new prompt shape or `max_new_tokens` compiles a new one.
    """
    config = model.config
    check_token_ids(prompt, config.vocab_size, "prompt")
    batch, prompt_len = np.shape(prompt)
    if batch < 1 or prompt_len < 1:
        raise ValueError(f"prompt must hold at least one token per row, got shape {np.shape(prompt)}")
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    check_fits(prompt_len, max_new_tokens, config.max_seq_len,
               "prompt length + max_new_tokens", "max_seq_len")
    if not np.ndim(temperature) == 0 or not float(temperature) >= 0:  # `not >=` also rejects NaN
        raise ValueError(f"temperature must be a scalar >= 0, got {temperature!r}")
    if top_k is not None and (type(top_k) is not int or not 1 <= top_k <= config.vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size={config.vocab_size}], got {top_k!r}")
    if key is None:
        if float(temperature) > 0:
            raise ValueError("key is required when temperature > 0: pass key=jax.random.key(seed)")
        key = jax.random.key(0)  # unused by greedy decoding; keeps the traced signature fixed
    top_k = config.vocab_size if top_k is None else top_k
    return _generate_jit(model, params, jnp.asarray(prompt, jnp.int32), key,
                         jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                         max_new_tokens)
