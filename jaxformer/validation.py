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
