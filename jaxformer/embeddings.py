"""Tokens in and out: an embedding lookup that never wraps or clamps, and the output head."""

import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.products import product
from jaxformer.quantized import QArray, dequantize_stored


def lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Rows of `table` `[vocab, d_model]` for int `ids` `[...]`, as `[..., d_model]`; an id outside
    `[0, vocab)` reads NaN, never a clamped or wrapped row."""
    vocab = table.shape[0]
    # jnp.take's "fill" mode still wraps negative ids, so send them past the end first.
    ids = jnp.where((ids >= 0) & (ids < vocab), ids, vocab)
    if isinstance(table, QArray):  # a quantized table: its rows' values and scales, then dequantized
        rows = jax.tree.map(lambda a: jnp.take(a, jnp.minimum(ids, vocab - 1), axis=0), table)
        return jnp.where((ids < vocab)[..., None], dequantize_stored(rows), jnp.nan)
    return jnp.take(table, ids, axis=0, mode="fill", fill_value=jnp.nan)


def output_logits(x: jax.Array, weight: jax.Array, tied: bool) -> jax.Array:
    """The output head's logits.

    Args:
      x: `[..., d_model]`, the normalised residual stream (`[batch, T, d_model]`, or a chunk of positions).
      weight: the `[vocab, d_model]` embedding if `tied` (logit v is `x . embed[v]`), else the
        head's own `[d_model, vocab]` matrix.
      tied: which of the two `weight` is.

    Returns:
      `[..., vocab]` logits in float32 (or wider, as `x`): from bfloat16 `x`, the float32 sums
      of the bfloat16 products, unrounded (docs/precision.md).
    """
    rows = x.reshape(-1, x.shape[-1])  # [positions, d_model]
    logits = product("td,vd->tv" if tied else "td,dv->tv", rows, weight.astype(x.dtype), wide=True)
    return logits.reshape(*x.shape[:-1], logits.shape[-1])


@struct.dataclass
class OutputHead:
    """What turns the decoder's final normalised stream into logits: `logits(x)`.

    A pytree whose one leaf is `weight`, so it can be handed to `jit`, `grad` or `scan`.

    Attributes:
      weight: the `[vocab, d_model]` embedding if `tied`, else the head's `[d_model, vocab]` matrix.
      tied: which of the two `weight` is.
      softcap: Gemma 2's `cap`: the logits pass through `cap * tanh(logit / cap)`; None: as they are.
    """

    weight: jax.Array
    tied: bool = struct.field(pytree_node=False)
    softcap: float | None = struct.field(pytree_node=False, default=None)

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0 if self.tied else 1]

    @property
    def d_model(self) -> int:
        return self.weight.shape[1 if self.tied else 0]

    def logits(self, x: jax.Array) -> jax.Array:
        """`[..., vocab]` logits of `x` `[..., d_model]`, in float32 (`output_logits`)."""
        logits = output_logits(x, self.weight, self.tied)
        if self.softcap is not None:  # Gemma 2: every logit within (-cap, cap)
            logits = jnp.tanh(logits / self.softcap) * self.softcap
        return logits
