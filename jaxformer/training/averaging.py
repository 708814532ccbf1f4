"""The paper's checkpoint averaging: the model evaluated is the mean of the parameters at the
last few of evenly spaced points of the run ("a single model obtained by averaging the last 5
checkpoints"), which damps the noise the last updates' gradients leave in the parameters.

It is an optax wrapper, so the sums live in the optimizer state: they are checkpointed with
it, and a resumed run averages what an uninterrupted one does. Which updates are kept is
in the state too, not in the compiled update, so a run resumed with another `--steps`
compiles the same update and trains bitwise as before; it keeps the points its run started
with, adding later ones when it is extended.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxformer.validation import as_int


class AveragingState(NamedTuple):
    """The wrapped optimizer's state; the updates made; the first kept update and the updates
    between kept ones; the sum of the parameters after each kept update, and their number."""

    inner: Any
    count: jax.Array
    first: jax.Array
    every: jax.Array
    total: Any
    kept: jax.Array


def average_last(optimizer: optax.GradientTransformation, last: int, every: int,
                 num_steps: int) -> optax.GradientTransformation:
    """`optimizer`, keeping the sum of the parameters after updates `num_steps - (last - 1) *
    every`, ..., `num_steps - every`, `num_steps` (counted from 1), and every `every` updates
    after them; `averaged` gives their mean.

    Args:
      optimizer: the optax transformation that makes the updates.
      last: how many points, an int >= 1.
      every: updates between them, an int >= 1.
      num_steps: the update the last point is after.
    """
    last, every = as_int(last, "last", minimum=1), as_int(every, "every", minimum=1)
    first = as_int(num_steps, "num_steps", minimum=1) - (last - 1) * every
    if first < 1:
        raise ValueError(f"average_last: {last} points {every} updates apart do not fit in {num_steps} updates")

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        return AveragingState(optimizer.init(params), zero, jnp.asarray(first, jnp.int32),
                              jnp.asarray(every, jnp.int32), jax.tree.map(jnp.zeros_like, params), zero)

    def update(grads, state: AveragingState, params):
        updates, inner = optimizer.update(grads, state.inner, params)
        count = state.count + 1
        keep = (count >= state.first) & ((count - state.first) % state.every == 0)
        new = optax.apply_updates(params, updates)
        total = jax.tree.map(lambda t, p: jnp.where(keep, t + p, t), state.total, new)
        return updates, state._replace(inner=inner, count=count, total=total, kept=state.kept + keep.astype(jnp.int32))

    return optax.GradientTransformation(init, update)


def averaged(opt_state: AveragingState, params):
    """The mean of the parameters `average_last` kept, or `params` (the last ones) while it
    has kept none (a run stopped before its first point)."""
    kept = int(opt_state.kept)
    return params if kept == 0 else _mean(opt_state.total, kept)


@jax.jit  # one program: op by op, each leaf's division would be one (across processes, on a mesh of several)
def _mean(total, kept):
    return jax.tree.map(lambda t: t / kept, total)
