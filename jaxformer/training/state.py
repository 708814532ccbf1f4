"""The train state, the one jitted optimizer update, and the random keys of each update."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxformer.validation import as_int


@struct.dataclass
class TrainState:
    """Everything a resumed run needs: the update count, parameters, optimizer state.

    Attributes:
      step: int32 scalar, the number of updates applied so far.
      params: the model's parameter pytree.
      opt_state: the optimizer's state for `params`.
    """

    step: jax.Array
    params: Any
    opt_state: Any

    @classmethod
    def create(cls, params, optimizer: optax.GradientTransformation) -> "TrainState":
        """A state at step 0 with `optimizer.init(params)`.

        The parameters are copied: `train_step` donates its state, which deletes the
        buffers it was given, and that must not delete the caller's own `params`.

        Args:
          params: the initial parameter pytree.
          optimizer: the optax transformation that will update them.

        Returns:
          The state before the first update.
        """
        params = jax.tree.map(jnp.copy, params)
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, state_sharding=None) -> Callable:
    """One jitted optimizer update.

    Args:
      loss_fn: `loss_fn(params, batch, dropout_key) -> (loss, aux)`, loss a scalar and
        aux a dict of scalar metrics (without a "loss" key).
      optimizer: an optax transformation.
      state_sharding: a `TrainState` of shardings (from `shard_state`) to keep the
        updated state where the mesh rules put it; None for one device.

    Returns:
      `train_step(state, batch, dropout_key) -> (state, metrics)`, metrics
      `{"loss": loss, **aux}` as device scalars (read them only when logging: fetching
      them forces the host to wait for the step). The state argument is donated, so XLA
      updates parameters and optimizer state in place; do not use it after the call.
      Batches of one shape compile once.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch, dropout_key: jax.Array):
        (loss, aux), grads = grad_fn(state.params, batch, dropout_key)
        # These run while tracing, so a wrong loss_fn fails on the first call.
        if not isinstance(aux, dict) or "loss" in aux:
            raise ValueError(f"loss_fn must return (loss, dict of metrics without 'loss'), got aux {aux!r}")
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return state, {"loss": loss, **aux}

    out_shardings = None if state_sharding is None else (state_sharding, None)
    return jax.jit(train_step, donate_argnums=0, out_shardings=out_shardings)

SEED_LIMIT = 2**31  # seeds are ints in [0, SEED_LIMIT)


def check_seed(seed, name: str = "seed") -> int:
    """`seed` as a Python int, or a ValueError naming `name` and the range.

    A seed reaches the jitted key derivation as an int32, and `jax.random.key` keeps only
    32 bits of a larger one (2**32 would draw what 0 draws): the range is `[0, 2**31)`.
    """
    return as_int(seed, name, minimum=0, maximum=SEED_LIMIT - 1)


def step_keys(seed: int, step: int) -> tuple[jax.Array, jax.Array]:
    """The random keys of update `step`, a function of `(seed, step)` only.

    The seed's key is split into two streams once, then each is folded with the step:
    no key is carried from step to step, so any step's keys can be recomputed on resume,
    and the data stream does not shift if the model starts or stops using dropout.

    Args:
      seed: the run's seed.
      step: the update's index, counted from 0.

    Returns:
      `(data_key, dropout_key)`.
    """
    seed, step = check_seed(seed), as_int(step, "step", minimum=0, maximum=2**32 - 1)  # folded in as a uint32
    return _step_keys(seed, jnp.uint32(step))


@jax.jit  # one dispatch per step instead of four eager ones
def _step_keys(seed, step):
    data_stream, dropout_stream = jax.random.split(jax.random.key(seed))
    return jax.random.fold_in(data_stream, step), jax.random.fold_in(dropout_stream, step)
