"""What every decoding strategy shares: the model's step, the prompt's prefill, picking each
row's token, and the stop of a row whose logits are not finite (docs/decoding.md,
"Non-finite logits", says why such a row gets `NO_TOKEN` rather than a token)."""

from __future__ import annotations

from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.cache import KVCache, spans
from jaxformer.decodable import Decodable
from jaxformer.decoding.request import DecodeRequest, is_eos
from jaxformer.decoding.sampling import Sampling
from jaxformer.sharding import cache_shardings


def step_fn(model: Decodable, params, context) -> Callable:
    """`step(tokens [batch, T], cache) -> (logits [batch, T, vocab], cache)`."""
    return lambda tokens, cache: model.apply({"params": params}, tokens, cache, context, method="decode_step")


def prefill(model: Decodable, params, request: DecodeRequest, mesh=None, extra_capacity: int = 0):
    """`(context, logits [batch, vocab], cache)`: the decoder's whole prompt run once, the logits
    at each row's last real position.

    Every row's `P` tokens go in at slots `0 .. P - 1` (a ring takes a row's real tokens
    only: `KVCache.stop`; attention reads the span that holds them), then row b's `pos` is
    set back to its length: a shorter row's padding is never read, and its next tokens
    overwrite it. `extra_capacity` adds slots (a speculative round writes k proposals past
    what it keeps, then sets rows back).
    """
    context = model.apply({"params": params}, request.prompt, method="decode_context")
    # Capacity: the prompt plus every new token but the last (which is never fed back).
    capacity = request.decoder_prompt.shape[1] + request.max_new_tokens - 1 + extra_capacity
    lengths = jnp.asarray(request.lengths, jnp.int32)
    cache = model.init_cache(request.prompt.shape[0], capacity, rewind=extra_capacity).replace(stop=lengths)
    if mesh is not None:  # rows over `data`, kv heads over `model`: each device keeps its own part
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
    prompt_len = request.decoder_prompt.shape[1]
    tokens, cache = request.decoder_prompt, with_span(cache, prompt_len)
    if hasattr(model, "decode_last"):  # (optional in the protocol: the logits at each row's last position alone)
        last, cache = model.apply({"params": params}, tokens, cache, context, lengths - 1, method="decode_last")
    else:
        logits, cache = step_fn(model, params, context)(tokens, cache)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [batch, vocab]
    if mesh is not None:  # what the prompt wrote, placed so too (not left to XLA: a linear layer's conv inputs)
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
    return context, last, with_span(cache, None).replace(pos=lengths, stop=None)


def prefill_piece(model: Decodable, params, tokens: jax.Array, cache: KVCache, real) -> tuple[jax.Array, KVCache]:
    """`(logits [batch, n, vocab], cache)`: the next piece of each row's prompt run into `cache`,
    the logits at each of its positions (the last real one, `real - 1`, gives the next token; the
    ones before score the prompt's own tokens); a chunked prefill is such pieces one after the other.

    `tokens` `[batch, n]` hold the next `real` (int32 `[]`, `1 .. n`) tokens of each row, then
    padding, as `prefill`'s ragged rows: a ring takes the real tokens only (`stop`), and `pos`
    is set back to their end, so the next piece overwrites the padding before anything reads
    it. For a model that continues its prompt (`DecodingSpec.supports_speculative`), whose
    steps read the cache alone (context None).
    """
    end = cache.pos + real  # [batch]
    logits, cache = step_fn(model, params, None)(tokens, cache.replace(stop=end))  # [batch, n, vocab]
    return logits, cache.replace(pos=end, stop=None)


# Spans (docs/decoding.md, "The span"): a call reads the first `span` slots of a `KVCache`,
# the smallest bucket that holds every row's `pos + T`. A strategy's state may hold several
# caches (a draft's) or none of this kind (then it is read whole, as its model reads it).

def _caches(tree) -> list[KVCache]:
    """The `KVCache`s in `tree`."""
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, KVCache)) if isinstance(x, KVCache)]


def with_span(tree, needed):
    """`tree` with every `KVCache` in it read at the bucket that holds positions below `needed`
    (a static int: `KVCache.spanning`), or None: at its capacity."""
    return jax.tree.map(lambda x: x.spanning(needed) if isinstance(x, KVCache) else x, tree,
                        is_leaf=lambda x: isinstance(x, KVCache))


def reach(tree, width: int) -> jax.Array:
    """int32 `[]`: the largest `pos + width` over the rows of the caches in `tree`, the slots the
    next call reads if it writes `width` tokens per row."""
    return jnp.max(jnp.stack([jnp.max(cache.pos) for cache in _caches(tree)])) + width


def host_reach(tree, width: int) -> int | None:
    """`reach` read on the host (each cache's `pos` copied back), None where `tree` holds no `KVCache`."""
    caches = _caches(tree)
    return max(int(np.max(cache.pos)) for cache in caches) + width if caches else None


def span_loops(keep_going: Callable, body: Callable, carry, width: int):
    """`jax.lax.while_loop(keep_going, body, carry)`, run as one loop per bucket of
    `cache.spans(capacity)` of the caches in `carry`, one after the other in the same program.

    The loop of bucket L runs while every row's next call (`width` tokens from its `pos`) fits
    in L, its caches read at L: a step's attention costs the slots the rows fill (up to 2x),
    not the capacity. The last loop reads every slot and runs to the end, as one loop would.
    """
    caches = _caches(carry)
    for span in spans(max(cache.capacity for cache in caches))[:-1] if caches else ():
        def fits(carry, span=span):
            return keep_going(carry) & (reach(carry, width) <= span)

        carry = jax.lax.while_loop(fits, body, with_span(carry, span))
    return jax.lax.while_loop(keep_going, body, with_span(carry, None))


# The token of a row whose logits hold NaN or inf: an id no vocabulary has. The row is done
# at it, as at an EOS (`pad_id` follows); fed back to the model it reads NaN, never a token.
NO_TOKEN = -1


def finite_logits(logits: jax.Array) -> jax.Array:
    """`[...]` bool: whether a token can be picked from each of `logits` `[..., vocab]`."""
    return jnp.all(jnp.isfinite(logits), axis=-1)


def stops(token: jax.Array, eos_id: jax.Array) -> jax.Array:
    """Whether each of `token` (any shape) ends its row: one of `eos_id` `[n_eos]`, or `NO_TOKEN`."""
    return is_eos(token, eos_id) | (token == NO_TOKEN)


def pick(request: DecodeRequest, i, logits: jax.Array, done: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token `i` of each row from `logits` `[batch, vocab]` (sampled with `fold_in(key, i)`;
    `NO_TOKEN` where not finite, `pad_id` where done), and the rows done after it."""
    token = picked(request.sampling, logits, jax.random.fold_in(request.key, i))
    token = jnp.where(done, request.pad_id, token)
    return token, done | stops(token, request.eos_id)


def pick_rows(sampling: Sampling, keys: jax.Array, made: jax.Array, logits: jax.Array,
              allowed: jax.Array | None = None) -> jax.Array:
    """`[batch]`: token `made[r]` of each row r, drawn from `logits` `[batch, vocab]` with
    `fold_in(keys[r], made[r])`, its own key: a row's draws do not depend on the rows beside it
    (a server's requests, each with its key); `NO_TOKEN` where not finite. `allowed` (bool
    `[batch, vocab]`, None: every id) limits each row to its ids (a grammar's mask)."""
    return picked(sampling, logits, jax.vmap(jax.random.fold_in)(keys, made), allowed)


def picked(sampling: Sampling, logits: jax.Array, key: jax.Array, allowed: jax.Array | None = None) -> jax.Array:
    """`sampling.pick(logits, key)` among the `allowed` ids (None: all), `NO_TOKEN` in the rows
    whose logits are not finite (the model's own: the mask's -inf is not a fault)."""
    finite = finite_logits(logits)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    return jnp.where(finite, sampling.pick(logits, key), NO_TOKEN)


def first_token(model: Decodable, params, request: DecodeRequest, mesh=None, extra_capacity: int = 0):
    """The prefill and the first token: `(context, token, cache, done)`."""
    context, logits, cache = prefill(model, params, request, mesh, extra_capacity)
    token, done = pick(request, 0, logits, jnp.zeros(request.prompt.shape[0], bool))
    return context, token, cache, done


def as_given(out: jax.Array, prompt, options: dict) -> jax.Array:
    """`out` with the prompt as the caller gave it (a ragged batch's padding, held as 0)."""
    if options.get("prompt_lengths") is None:
        return out
    return out.at[:, :np.shape(prompt)[1]].set(jnp.asarray(prompt))


class NonFiniteLogitsError(ValueError):
    """Rows stopped because their logits held NaN or inf: no token could be picked.

    Attributes:
      rows: the rows that stopped so, in order.
      steps: for each of `rows`, the index of the new token its logits failed at.
      tokens: int32 numpy, what the run made (`generate`'s output, or `stream`'s steps so
        far `[batch, steps]`), a stopped row holding `pad_id` from its step on.
    """

    CAUSE = ("the logits held NaN or inf, so no token could be picked: the parameters hold NaN or inf (a diverged or "
             "damaged checkpoint), or an input was out of range (inside jit, an out-of-vocabulary id or a write "
             "past the cache's capacity turns the logits into NaN)")

    def __init__(self, rows: list[int], steps: list[int], tokens: np.ndarray):
        self.rows, self.steps, self.tokens = rows, steps, tokens
        where = ", ".join(f"row {row} at new token {step}" for row, step in zip(rows, steps))
        super().__init__(f"{where}: {self.CAUSE}")


def check_picked(tokens, new: int, pad_id) -> None:
    """Raises `NonFiniteLogitsError` where the last `new` columns of `tokens` `[batch, L]` hold a
    `NO_TOKEN`; the error's `tokens` hold `pad_id` from there on."""
    host = np.asarray(tokens)  # [batch, L]
    marked = host[:, host.shape[1] - new:] == NO_TOKEN  # [batch, new]
    if not marked.any():
        return
    rows = np.flatnonzero(marked.any(axis=1))
    made = host.copy()
    made[:, host.shape[1] - new:][marked] = pad_id
    raise NonFiniteLogitsError(rows.tolist(), marked[rows].argmax(axis=1).tolist(), made)


def checked_steps(steps: Iterator[np.ndarray], pad_id) -> Iterator[np.ndarray]:
    """`steps`' tokens as they come, raising `NonFiniteLogitsError` at a step with a `NO_TOKEN`."""
    made = []
    for token in steps:
        made.append(token)
        if (token == NO_TOKEN).any():  # (a host array already: no device read of its own)
            check_picked(np.stack(made, axis=1), len(made), pad_id)
        yield token
