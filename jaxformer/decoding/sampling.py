"""The sampling rule: how each row picks its next token from its logits.

`check_temperature`, `check_top_k` and `check_top_p` state each knob's range once:
`Sampling.create` calls them, and so can a command line, naming its own flag
(`check_top_p(args.top_p, name="--top-p")`). Each returns its value as a numpy array of
its own shape (None stays None) and raises `ValueError` naming `name` and the range.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxformer.validation import numbers_array, per_row


def check_temperature(value, *, name: str = "temperature") -> np.ndarray:
    """Raises unless `value`, a scalar or one per row, is finite and >= 0; float32."""
    temperature = numbers_array(value, name, np.float32)
    if not np.all(np.isfinite(temperature) & (temperature >= 0)):
        raise ValueError(f"{name} must be >= 0 and finite (got {np.asarray(value).tolist()})")
    return temperature


def check_top_k(value, vocab_size: int | None, *, name: str = "top_k") -> np.ndarray | None:
    """Raises unless `value`, a scalar or one per row, is None or an int in `[1, vocab_size]`; int32.
    A `vocab_size` of None (not known yet: a command line before its model) checks `>= 1` only."""
    if value is None:
        return None
    top_k = numbers_array(value, name, np.float64)  # whole floats (2.0) are ints here
    limit = np.inf if vocab_size is None else vocab_size
    if not np.all((top_k >= 1) & (top_k <= limit) & (top_k == np.round(top_k))):  # NaN and inf fail too
        rule = "an int >= 1" if vocab_size is None else f"an int in [1, vocab_size={vocab_size}]"
        raise ValueError(f"{name} must be None or {rule} (got {np.asarray(value).tolist()})")
    return top_k.astype(np.int32)


def check_top_p(value, *, name: str = "top_p") -> np.ndarray | None:
    """Raises unless `value`, a scalar or one per row, is None or in `(0, 1]`; float32.

    A p below float32's smallest normal number (1e-300, say) is in range but would round to
    0: it is kept as that smallest number instead, which keeps what any p that small keeps,
    the likeliest token alone."""
    if value is None:
        return None
    top_p = numbers_array(value, name, np.float64)
    if not np.all((top_p > 0) & (top_p <= 1)):
        raise ValueError(f"{name} must be None or in (0, 1] (got {np.asarray(value).tolist()})")
    return np.maximum(top_p, np.finfo(np.float32).tiny).astype(np.float32)


@jax.jit  # one program per shape when called eagerly: its cond's branches are fresh closures, retraced each call
def sample_token(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
                 top_p: jax.Array) -> jax.Array:
    """Picks one token per row: greedy, or sampled after temperature, top-k and top-p.

    The filters run in HF transformers' order: scale by the temperature, keep the k largest
    logits, then the smallest set of those whose probability (renormalised) reaches p; ties
    with the last one kept are kept.

    Args:
      logits: `[batch, vocab]`.
      key: this step's PRNG key, or one key per row (`[batch]`): then a row's draw depends on
        its own key alone, not on the rows beside it (a server's requests, each with its seed).
      temperature: `[batch]`; 0 takes the row's argmax.
      top_k: int `[batch]` in `[1, vocab]`; top_p: `[batch]` in `(0, 1]` (`vocab`, 1: all).

    Returns:
      int32 `[batch]` token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [batch]

    def sample(_):
        filtered = filtered_logits(logits, temperature, top_k, top_p)  # [batch, vocab]
        if key.ndim == 0:
            sampled = jax.random.categorical(key, filtered, axis=-1)
        else:
            sampled = jax.vmap(jax.random.categorical)(key, filtered)  # one draw per row, its own key
        return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)

    # A cond, not a where: when every row is greedy the sort and the sampling are skipped.
    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)


def log_probabilities(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """float32 `[batch, ..., vocab]`: each row's log-probabilities after its temperature and before
    top-k and top-p cut them, `log_softmax(logits / T)` (T = 1 for a greedy row: the model's own).
    `temperature` is `[batch]`; the server's `logprobs` are these (docs/serving.md)."""
    scale = jnp.where(temperature > 0, temperature, 1.0).reshape(temperature.shape + (1,) * (logits.ndim - 1))
    return jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """float32 `[..., batch, vocab]`: the logits `sample_token` samples from, scaled by the
    temperature (1 for a greedy row), -inf outside the top k and the nucleus."""
    # Less the row's largest logit first (which changes no probability): a temperature near 0
    # then sends the others towards -inf, never past float32's range to +inf (where the
    # softmax below would be NaN), so however small it is the likeliest token stays the likeliest.
    logits = logits.astype(jnp.float32)
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    ranked = -jnp.sort(-scaled, axis=-1)  # [..., batch, vocab], largest first
    rank = jnp.arange(scaled.shape[-1])  # [vocab]
    in_top_k = rank < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)  # renormalised over the top k
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
    # The nucleus: tokens whose predecessors hold less than p (the first always does).
    # p = 1 is "off" outright, so a cumulative sum that rounds below 1 cannot cut a token.
    in_nucleus = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    n_keep = jnp.sum(in_top_k & in_nucleus, axis=-1)  # [..., batch], >= 1
    cutoff = jnp.take_along_axis(ranked, n_keep[..., None] - 1, axis=-1)  # [..., batch, 1], the last kept logit
    return jnp.where(scaled < cutoff, -jnp.inf, scaled)


@struct.dataclass
class Sampling:
    """Each row's settings as `[batch]` arrays in the ranges the checks above state (temperature
    float32, 0 greedy; top_k int32; top_p float32): new values reuse the compiled loop."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def create(cls, batch: int, vocab_size: int, temperature=0.0, top_k=None, top_p=None) -> "Sampling":
        """Checks the settings on the host (a scalar or one per row); None keeps every token."""
        temperature = per_row(check_temperature(temperature), batch, "temperature", np.float32)
        top_k = check_top_k(top_k, vocab_size)
        top_k = per_row(vocab_size if top_k is None else top_k, batch, "top_k", np.int32)
        top_p = check_top_p(top_p)
        top_p = per_row(1.0 if top_p is None else top_p, batch, "top_p", np.float32)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p)  # host arrays, as DecodeRequest's

    @property
    def samples(self) -> np.ndarray:
        """Host-side: which rows sample (temperature > 0) rather than take the argmax."""
        return np.asarray(self.temperature) > 0

    def pick(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """`[batch]` int32: each row's token from its `[batch, vocab]` logits (`key`: one, or one per row)."""
        return sample_token(logits, key, self.temperature, self.top_k, self.top_p)

    def filtered(self, logits: jax.Array) -> jax.Array:
        """`filtered_logits` of `[..., batch, vocab]` logits: what a sampling row draws from."""
        return filtered_logits(logits, self.temperature, self.top_k, self.top_p)
