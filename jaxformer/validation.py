"""Checks on concrete inputs, run before anything is traced.

Inside `jit` a bad index does not fail: `dynamic_update_slice` clamps its start and a
gather clamps or wraps. So every host-facing entry point checks the concrete numbers
here first and raises a `ValueError` naming the argument and the limit.
"""

import jax
import numpy as np


def is_traced(x) -> bool:
    """True for a value that exists only symbolically (inside `jit`, `grad`, ...)."""
    return isinstance(x, jax.core.Tracer)


def per_row(value, batch: int, name: str, dtype) -> np.ndarray:
    """A setting given as a scalar or one value per row, as a `[batch]` array."""
    array = np.asarray(value, dtype)
    if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or hold one value per row ({batch}), got shape {array.shape}")
    return np.broadcast_to(array, (batch,))


def check_token_ids(tokens, vocab_size: int, name: str = "tokens") -> None:
    """Raises unless `tokens` is a 2-D integer array with ids in `[0, vocab_size)`."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be 2-D [batch, seq], got shape {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
        raise ValueError(
            f"{name} holds ids outside [0, vocab_size={vocab_size}): e.g. {int(bad[0])}")


def check_positions_fit(start: int, n_tokens: int, limit: int, name: str, limit_name: str) -> None:
    """Raises unless positions `start .. start + n_tokens - 1` fit below `limit`."""
    if start + n_tokens > limit:
        raise ValueError(
            f"{name}: {start} + {n_tokens} = {start + n_tokens} positions exceed "
            f"{limit_name}={limit}")


def check_step_inputs(tokens, *, vocab_size: int, max_seq_len: int, cache=None, cache_layout=None,
                      ragged: bool = True, name: str = "tokens") -> None:
    """What a model call checks before it computes anything.

    Shapes are static, so they are checked even under `jit`; the token ids and the cache
    position only when they are concrete (outside `jit`).

    Args:
      tokens: `[batch, T]` ids.
      vocab_size: ids must lie in `[0, vocab_size)`.
      max_seq_len: the longest sequence the model accepts.
      cache: the `KVCache` the call writes to, or None.
      cache_layout: `(n_layer, n_kv_head, head_dim)` of the model's cache (with `cache`).
      ragged: whether the model reads `cache.start` (left-padded rows); if not, every
        row must start at slot 0.
      name: the argument's name, for the messages.
    """
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be 2-D [batch, seq], got shape {tokens.shape}")
    if cache is None:
        check_positions_fit(0, tokens.shape[1], max_seq_len, f"{name} length", "max_seq_len")
    else:
        n_layer, n_kv_head, head_dim = cache_layout
        want = (tokens.shape[0], cache.capacity, n_kv_head, head_dim)
        if len(cache.layers) != n_layer or any(l.k.shape != want or l.v.shape != want for l in cache.layers):
            raise ValueError(
                f"cache does not fit this model: want {n_layer} layers of k/v {want} "
                f"[batch, capacity, n_kv_head, head_dim], got {len(cache.layers)} layers of "
                f"{cache.layers[0].k.shape if cache.layers else None}")
        if cache.start.shape != (tokens.shape[0],):
            raise ValueError(f"cache.start must hold one slot per row, shape ({tokens.shape[0]},), "
                             f"got {cache.start.shape}")
        check_positions_fit(0, tokens.shape[1], cache.capacity, f"{name} length", "cache capacity")
        if not is_traced(cache.pos):
            check_positions_fit(int(cache.pos), tokens.shape[1], cache.capacity, f"cache.pos + {name}",
                                "cache capacity")
            if not is_traced(cache.start):
                _check_start(np.asarray(cache.start), int(cache.pos) + tokens.shape[1], ragged, name)
    if not is_traced(tokens):
        check_token_ids(tokens, vocab_size, name)


def _check_start(start: np.ndarray, written: int, ragged: bool, name: str) -> None:
    """A row's first real slot must be written by now or by this call, or every query of
    that row would be blocked from every key; a model without left padding needs 0."""
    if not ragged and start.any():
        raise ValueError(f"cache.start must be all zeros for this model (its rows all start at slot 0), "
                         f"got {start.tolist()}")
    if start.min() < 0 or start.max() >= written:
        raise ValueError(f"cache.start must lie in [0, cache.pos + {name} length = {written}), got {start.tolist()}")
