"""Tokens in and out: an embedding lookup that never wraps or clamps, and the output head."""

import jax
import jax.numpy as jnp


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of `table` `[vocab, d_model]` for int `ids` `[...]`, as `[..., d_model]`; an id outside
    `[0, vocab)` reads NaN, never a clamped or wrapped row."""
    vocab = table.shape[0]
    # jnp.take's "fill" mode still wraps negative ids, so send them past the end first.
    ids = jnp.where((ids >= 0) & (ids < vocab), ids, vocab)
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)


def output_logits(x: jax.Array, weight: jax.Array, tied: bool) -> jax.Array:
    """The output head's logits.

    Args:
      x: `[batch, T, d_model]`, the normalised residual stream.
      weight: the `[vocab, d_model]` embedding if `tied` (logit v is `x . embed[v]`), else the
        head's own `[d_model, vocab]` matrix.
      tied: which of the two `weight` is.

    Returns:
      `[batch, T, vocab]` logits.
    """
    weight = weight.astype(x.dtype)
    if tied:
        return jnp.einsum("btd,vd->btv", x, weight)
    return jnp.einsum("btd,dv->btv", x, weight)
