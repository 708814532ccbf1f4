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


def check_fits(start: int, n_tokens: int, limit: int, name: str, limit_name: str) -> None:
    """Raises unless positions `start .. start + n_tokens - 1` fit below `limit`."""
    if start + n_tokens > limit:
        raise ValueError(
            f"{name}: {start} + {n_tokens} = {start + n_tokens} positions exceed "
            f"{limit_name}={limit}")


def check_step_inputs(tokens, config, vocab_size: int, cache=None, name: str = "tokens") -> None:
    """What a model call checks before it computes anything.

    Shapes are static, so they are checked even under `jit`; the token ids and the cache
    position only when they are concrete (outside `jit`).

    Args:
      tokens: `[batch, T]` ids.
      config: the model's config (`n_layer`, `n_kv_head`, `head_dim`, `max_seq_len`).
      vocab_size: ids must lie in `[0, vocab_size)`.
      cache: the `KVCache` the call writes to, or None.
      name: the argument's name, for the messages.
    """
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be 2-D [batch, seq], got shape {tokens.shape}")
    if cache is None:
        check_fits(0, tokens.shape[1], config.max_seq_len, f"{name} length", "max_seq_len")
    else:
        want = (tokens.shape[0], cache.capacity, config.n_kv_head, config.head_dim)
        if len(cache.layers) != config.n_layer or any(l.k.shape != want or l.v.shape != want for l in cache.layers):
            raise ValueError(
                f"cache does not fit this model: want {config.n_layer} layers of k/v {want} "
                f"[batch, capacity, n_kv_head, head_dim], got {len(cache.layers)} layers of "
                f"{cache.layers[0].k.shape if cache.layers else None}")
        if cache.start.shape != (tokens.shape[0],):
            raise ValueError(f"cache.start must hold one slot per row, shape ({tokens.shape[0]},), "
                             f"got {cache.start.shape}")
        check_fits(0, tokens.shape[1], cache.capacity, f"{name} length", "cache capacity")
        if not is_traced(cache.pos):
            check_fits(int(cache.pos), tokens.shape[1], cache.capacity, f"cache.pos + {name}", "cache capacity")
            if not is_traced(cache.start):
                start = np.asarray(cache.start)
                # A row's first real slot must be written by now or by this call, or every
                # query of that row would be blocked from every key.
                if start.min() < 0 or start.max() >= int(cache.pos) + tokens.shape[1]:
                    raise ValueError(f"cache.start must lie in [0, cache.pos + {name} length = "
                                     f"{int(cache.pos) + tokens.shape[1]}), got {start.tolist()}")
    if not is_traced(tokens):
        check_token_ids(tokens, vocab_size, name)
