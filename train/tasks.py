"""Synthetic tasks whose right answer is known, drawn fresh from a PRNG key.

The reversal task (the reference's `vanilla_demo.py`): `src = a b c d`, target
`d c b a`. It needs a sequence-to-sequence model, and the right cross-attention is
known in advance: decoder step k should read source position L - 1 - k, an
anti-diagonal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

PAD, BOS, EOS = 0, 1, 2
N_SYMBOLS = 16
FIRST_SYMBOL = 3
REVERSE_VOCAB = FIRST_SYMBOL + N_SYMBOLS  # 19


@functools.partial(jax.jit, static_argnames=("batch_size", "min_len", "max_len", "width"))
def reverse_batch(key: jax.Array, batch_size: int, min_len: int = 5, max_len: int = 10,
                  width: int | None = None) -> dict[str, jax.Array]:
    """A batch of the reversal task, lengths uniform in `[min_len, max_len]`.

    Args:
      key: PRNG key; the same key gives the same batch.
      batch_size: rows.
      min_len: shortest sequence.
      max_len: longest sequence.
      width: source width (padded with PAD); defaults to `max_len`.

    Returns:
      A dict of int32 arrays:
        src     `[batch, width]`      symbols, then PAD;
        tgt_in  `[batch, width + 1]`  BOS, the reversed symbols, then PAD;
        tgt_out `[batch, width + 1]`  the reversed symbols, EOS, then PAD;
        length  `[batch]`.
    """
    width = max_len if width is None else width
    key_len, key_sym = jax.random.split(key)
    length = jax.random.randint(key_len, (batch_size,), min_len, max_len + 1)  # [batch]
    symbols = jax.random.randint(key_sym, (batch_size, width), FIRST_SYMBOL, REVERSE_VOCAB)
    position = jnp.arange(width)[None, :]  # [1, width]
    valid = position < length[:, None]  # [batch, width]
    src = jnp.where(valid, symbols, PAD)
    # reversed[b, i] = src[b, length - 1 - i] for i < length
    source_index = jnp.clip(length[:, None] - 1 - position, 0, width - 1)
    reversed_ = jnp.where(valid, jnp.take_along_axis(src, source_index, axis=1), PAD)  # [batch, width]
    pad_column = jnp.full((batch_size, 1), PAD, jnp.int32)
    tgt_in = jnp.concatenate([jnp.full((batch_size, 1), BOS, jnp.int32), reversed_], axis=1)
    tgt_out = jnp.concatenate([reversed_, pad_column], axis=1).at[jnp.arange(batch_size), length].set(EOS)
    return {"src": src.astype(jnp.int32), "tgt_in": tgt_in.astype(jnp.int32),
            "tgt_out": tgt_out.astype(jnp.int32), "length": length.astype(jnp.int32)}
