"""Token embedding lookup that never wraps or clamps."""

import jax
import jax.numpy as jnp


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of `table` for each id; an id outside `[0, len(table))` reads NaN.

    Inside `jit` a bad id cannot raise, and an ordinary gather would clamp it to the
    last row (or wrap a negative one): a silently wrong token. NaN makes it loud.

    Args:
      table: `[vocab, d_model]`.
      ids: int `[...]`.

    Returns:
      `[..., d_model]` in `table.dtype`.
    """
    vocab = table.shape[0]
    # jnp.take's "fill" mode still wraps negative ids, so send them past the end first.
    ids = jnp.where((ids >= 0) & (ids < vocab), ids, vocab)
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)
