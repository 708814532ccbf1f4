"""Checks on concrete inputs, run before anything is traced; each refusal is a `ValueError`
reading `NAME must be RULE (got VALUE)`. Why, and what counts as an int or a number:
docs/architecture.md, "Checked inputs".
"""

import math
import numbers
import operator
from typing import Callable, NoReturn, Sequence

import jax
import jax.numpy as jnp
import numpy as np

SEED_LIMIT = 2**31  # a seed is an int in [0, SEED_LIMIT): the key derivation takes an int32


def is_traced(x) -> bool:
    """True for a value that exists only symbolically (inside `jit`, `grad`, ...)."""
    return isinstance(x, jax.core.Tracer)


def _is_numeric(dtype) -> bool:
    """An integer or floating dtype (bfloat16 included); not bool, not a string."""
    return jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)


def python_int(value) -> int | None:
    """`value` as a Python int if it is an int, a numpy integer or a 0-d integer array, else None."""
    if isinstance(value, bool):  # (numpy bools already refuse `operator.index`)
        return None
    try:
        return operator.index(value)
    except TypeError:  # also a tracer: its value is unknown
        return None


def finite_float(value) -> float | None:
    """`value` as a Python float if it is a finite int or float (numpy or 0-d array too), else None."""
    scalar = isinstance(value, numbers.Real) and not isinstance(value, bool)
    array = (isinstance(value, (np.ndarray, jax.Array)) and not is_traced(value) and value.ndim == 0
             and _is_numeric(value.dtype))
    if not (scalar or array):
        return None
    try:
        value = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return value if math.isfinite(value) else None


def floating_dtype(value) -> np.dtype | None:
    """`value` ("bfloat16", `jnp.float16`, `np.dtype(...)`) as a numpy dtype if it names a
    floating dtype, else None: an integer storage would round every value silently."""
    if value is None:  # numpy would read None as float64
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        return None
    return dtype if jnp.issubdtype(dtype, jnp.floating) else None


class NotFinite(ValueError):
    """A figure computed from valid inputs (a loss, a perplexity) is NaN or inf: the message
    names the figure and its cause. Such a figure is an error, never a result."""


class UserCodeFailed(ValueError):
    """A user's code the run calls (a reward function) raised or returned what it may not: the
    message names the function and what it did; the run ends with it in one line."""


@jax.jit  # one program a leaf, also for a leaf split over several processes (op by op, two)
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


def why_not_finite(trees: dict, dtype) -> str:
    """Why a figure a model computed from parameter `trees` is NaN or inf, for `NotFinite`'s
    message: the first tree holding NaN or inf, with its first such leaf (`block_0/attn/wq`),
    else logits that passed the range of the compute `dtype` though every weight is finite.

    Args:
      trees: `{what: tree}`, e.g. `{"the checkpoint's weights": params}`, in the order asked.
      dtype: the compute dtype.
    """
    for what, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if jnp.issubdtype(leaf.dtype, jnp.inexact) and not bool(_all_finite(leaf)):
                where = "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)
                return f"{what} hold NaN or inf (first in {where})"
    return f"the logits overflowed in {jnp.dtype(dtype).name} though every weight is finite"


def refuse(name: str, rule: str, value, *, optional: bool = False) -> NoReturn:
    """Raises the one refusal: `NAME must be [None or ]RULE (got repr(VALUE))`.

    Args:
      name: what the caller calls the value (an argument, a config field, a flag).
      rule: what the value must be, e.g. "a positive int", "divisible by n_head=8".
      value: the value refused.
      optional: None would have been accepted too.
    """
    raise ValueError(f"{name} must be {'None or ' if optional else ''}{rule} (got {value!r})")


def require(condition: bool, name: str, rule: str, value) -> None:
    """`refuse(name, rule, value)` unless `condition`: a rule between values, checked after their kinds."""
    if not condition:
        refuse(name, rule, value)


def as_int(value, name: str, *, minimum: int | None = None, maximum: int | None = None,
           minimum_name: str | None = None, maximum_name: str | None = None, optional: bool = False) -> int | None:
    """`value` as a Python int in `[minimum, maximum]`, or a `ValueError` naming `name`.

    Args:
      value: any integral scalar (see `python_int`).
      name: the argument's name, for the message.
      minimum, maximum: the bounds, inclusive, or None.
      minimum_name, maximum_name: what the bounds are (e.g. "warmup_steps"), for the message.
      optional: None is allowed too, and returned as it is.

    Raises:
      ValueError: `value` is not integral, or lies outside the bounds.
    """
    if optional and value is None:
        return None
    result = python_int(value)
    if result is None or (minimum is not None and result < minimum) or (maximum is not None and result > maximum):
        bottom = minimum if minimum_name is None else f"{minimum_name}={minimum}"
        if maximum is not None:
            top = maximum if maximum_name is None else f"{maximum_name}={maximum}"
            rule = f"an int in [{bottom}, {top}]"
        elif minimum == 1 and minimum_name is None:
            rule = "a positive int"
        else:
            rule = "an int" if minimum is None else f"an int >= {bottom}"
        refuse(name, rule, value, optional=optional)
    return result


def check_seed(seed, name: str = "seed") -> int:
    """`seed` as a Python int in `[0, 2**31)` (the key derivation takes an int32), or a ValueError naming `name`."""
    return as_int(seed, name, minimum=0, maximum=SEED_LIMIT - 1)


def as_float(value, name: str, *, above: float | None = None, at_least: float | None = None,
             below: float | None = None, maximum: float | None = None, optional: bool = False) -> float | None:
    """`value` as a finite Python float within the bounds given, or a `ValueError` naming `name`.

    Args:
      value: any real scalar (see `finite_float`).
      name: the argument's name, for the message.
      above, at_least: the lower bound, exclusive or inclusive (at most one), or None.
      below, maximum: the upper bound, exclusive or inclusive (at most one), or None.
      optional: None is allowed too, and returned as it is.

    Raises:
      ValueError: `value` is not a finite real number, or lies outside the bounds.
    """
    if optional and value is None:
        return None
    result = finite_float(value)
    if (result is None or (above is not None and not result > above) or (at_least is not None and result < at_least)
            or (below is not None and not result < below) or (maximum is not None and result > maximum)):
        low = (f"({above:g}", f"> {above:g}") if above is not None else (
            (f"[{at_least:g}", f">= {at_least:g}") if at_least is not None else None)
        high = (f"{below:g})", f"< {below:g}") if below is not None else (
            (f"{maximum:g}]", f"<= {maximum:g}") if maximum is not None else None)
        if low and high:
            bounds = f" in {low[0]}, {high[0]}"
        else:
            bounds = "".join(f" {bound[1]}" for bound in (low, high) if bound)
        refuse(name, f"a finite number{bounds}", value, optional=optional)
    return result


def as_bool(value, name: str, *, optional: bool = False) -> bool | None:
    """`value` as a Python bool; a `ValueError` naming `name` for anything but a (numpy) bool."""
    if optional and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        refuse(name, "a bool", value, optional=optional)
    return bool(value)


def one_of(value, name: str, choices: Sequence[str], *, optional: bool = False) -> str | None:
    """`value`, a string among `choices`; a `ValueError` naming `name` and them otherwise."""
    if optional and value is None:
        return None
    if not (isinstance(value, str) and value in choices):
        refuse(name, f"one of {tuple(choices)}", value, optional=optional)
    return str(value)


def as_floating_dtype(value, name: str) -> np.dtype:
    """`value` as a numpy floating dtype (see `floating_dtype`), or a `ValueError` naming `name`."""
    dtype = floating_dtype(value)
    if dtype is None:
        refuse(name, "a floating dtype", value)
    return dtype


def check_fields(instance, names: Callable[[str], str], check: Callable, *fields: str, **limits) -> None:
    """Replaces each of `fields` of the frozen dataclass `instance` by `check(value,
    names(field), **limits)`, checked and normalised (an `np.int64` becomes an int).

    Args:
      instance: a frozen dataclass, from its `__post_init__`.
      names: the name a field's messages use, e.g. `"DecoderConfig." + field` or its flag.
      check: one of the `as_*` checks above, or `one_of`.
      fields: the fields `check` applies to.
      limits: `check`'s keyword arguments (`minimum=1`, `above=0`, `optional=True`, ...).
    """
    for field in fields:
        # A frozen dataclass sets its fields this way.
        object.__setattr__(instance, field, check(getattr(instance, field), names(field), **limits))


def numbers_array(value, name: str, dtype) -> np.ndarray:
    """`value`, a number or an array of them, as a numpy array of `dtype`; a `ValueError`
    naming `name` if it holds anything else (a string, a bool, None)."""
    try:
        array = np.asarray(value)
    except ValueError:  # a ragged nesting of lists
        array = None
    if array is None or not _is_numeric(array.dtype):
        raise ValueError(f"{name} must be a number or an array of numbers (got {value!r})")
    return array.astype(dtype)


def per_row(value, batch: int, name: str, dtype) -> np.ndarray:
    """A setting given as a scalar or one value per row, as a `[batch]` array."""
    array = numbers_array(value, name, dtype)
    if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != batch):
        raise ValueError(f"{name} must be a scalar or hold one value per row ({batch}), got shape {array.shape}")
    return np.broadcast_to(array, (batch,))


def check_token_layout(tokens, name: str = "tokens") -> None:
    """Raises unless `tokens` is a 2-D `[batch, T]` integer array (static facts: traced arrays too)."""
    if np.ndim(tokens) != 2:
        raise ValueError(f"{name} must be 2-D [batch, T], got shape {np.shape(tokens)}")
    dtype = tokens.dtype if hasattr(tokens, "dtype") else np.asarray(tokens).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {dtype}")


def check_token_ids(tokens, vocab_size: int, name: str = "tokens") -> None:
    """Raises unless `tokens` is a 2-D integer array with ids in `[0, vocab_size)`."""
    check_token_layout(tokens, name)
    _check_id_range(np.asarray(tokens), vocab_size, name)


def _check_id_range(tokens: np.ndarray, vocab_size: int, name: str) -> None:
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


def check_step_inputs(tokens, *, vocab_size: int, max_seq_len: int, name: str = "tokens") -> None:
    """What a model call checks first: the layout always (it is static, even under `jit`),
    the length against `max_seq_len`, and the ids when they are concrete.

    Args:
      tokens: `[batch, T]` ids.
      vocab_size: ids must lie in `[0, vocab_size)`.
      max_seq_len: the longest sequence the model accepts.
      name: the argument's name, for the messages.
    """
    check_token_layout(tokens, name)
    check_positions_fit(0, tokens.shape[1], max_seq_len, f"{name} length", "max_seq_len")
    if not is_traced(tokens):
        _check_id_range(np.asarray(tokens), vocab_size, name)


def check_cache_step(tokens, cache, want_shapes: list[tuple[int, ...]], stacked: bool, name: str = "tokens") -> None:
    """What a model call with a `KVCache` checks about it, after `check_step_inputs(tokens, ...)`.

    The layout is static, so it is checked even under `jit`; each row's position only
    when it is concrete (outside `jit`): every row's `pos + T` must fit the capacity.

    Args:
      tokens: `[batch, T]` ids (checked by `check_step_inputs`).
      cache: the `KVCache` the call writes to, one `pos` per row.
      want_shapes: the shapes of the cache's arrays (`jax.tree.leaves(cache.layers)`) the
        model reads, for this batch and `cache.capacity` (`cache.layout_shapes`).
      stacked: whether the model reads stacked arrays (`scan_layers`).
      name: the tokens' argument name, for the messages.
    """
    got_shapes = [array.shape for array in jax.tree.leaves(cache.layers)]
    if cache.stacked != stacked or got_shapes != want_shapes:
        form = ("stacked [batch, n_layer, slots, n_kv_head, head_dim] arrays (scan_layers=True)"
                if stacked else "a k and v of [batch, slots, n_kv_head, head_dim] per layer (scan_layers=False)")
        raise ValueError(f"cache does not fit this model: want k/v shapes {sorted(set(want_shapes))} as {form}; "
                         f"got {'a stacked' if cache.stacked else 'a per-layer'} cache of k/v shapes "
                         f"{sorted(set(got_shapes))} ({len(got_shapes)} arrays)")
    if np.shape(cache.pos) != (tokens.shape[0],):
        raise ValueError(f"cache.pos must hold one position per row, shape ({tokens.shape[0]},), "
                         f"got {np.shape(cache.pos)}")
    if cache.span is not None:
        as_int(cache.span, "cache.span", minimum=1, maximum=cache.capacity, maximum_name="cache capacity")
    limit_name = "cache capacity" if cache.span is None else "cache span"  # (the slots this call reads)
    check_positions_fit(0, tokens.shape[1], cache.read_slots, f"{name} length", limit_name)
    if not is_traced(cache.pos):
        pos = np.asarray(cache.pos)
        if pos.min() < 0:
            raise ValueError(f"cache.pos must be >= 0 in every row, got {pos.tolist()}")
        row = int(pos.argmax())
        check_positions_fit(int(pos[row]), tokens.shape[1], cache.read_slots, f"cache.pos[{row}] + {name}",
                            limit_name)
