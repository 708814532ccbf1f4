"""The train state, the one jitted optimizer update, and the random keys of each update."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxformer.sharding import mesh_of_shardings, traced_on
from jaxformer.validation import as_int, check_seed


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
    def create(cls, params, optimizer: optax.GradientTransformation, sharding=None) -> "TrainState":
        """A state at step 0 with `optimizer.init(params)`; `params` are copied, since
        `train_step` donates (deletes) its state's buffers, which must not be the caller's.
        With `sharding` (a `TrainState` of shardings, `jaxformer.sharding.tree_shardings` of
        the state's shapes), the copy and the optimizer's state are made in it: each device
        writes its own blocks, no moment is ever whole on one device."""
        # One program: run eagerly, the copy and the optimizer's zeros compile an operation per leaf shape.
        return jax.jit(lambda p: cls(step=jnp.zeros((), jnp.int32), params=jax.tree.map(jnp.copy, p),
                                     opt_state=optimizer.init(p)), out_shardings=sharding)(params)


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, state_sharding=None,
                    frozen=None) -> Callable:
    """One jitted optimizer update, `train_step(state, batch, dropout_key) -> (state, metrics)`
    (with `frozen`, a `functools.partial` of the jitted program with `frozen=` bound: its
    `.func` lowers).

    The state is donated (updated in place: do not use it after the call); the metrics,
    `{"loss": loss, **aux}`, stay on the device, as fetching them waits for the step.

    Args:
      loss_fn: `loss_fn(params, batch, dropout_key) -> (loss, aux)`, aux a dict of scalars but
        "loss"; with `frozen`, `loss_fn(params, batch, dropout_key, frozen)`.
      optimizer: an optax transformation.
      state_sharding: a `TrainState` of shardings (`shard_state`) to keep; None on one device.
      frozen: a pytree the loss reads but does not train (LoRA's base), or None. It is an
        argument of the compiled step at every call, never closed over: a closed-over array
        would be compiled into the program as a constant (a copy of the weights in the
        program, placed on one device, whatever its sharding).
    """
    # Traced on the state's mesh: what reads the mesh as it traces (expert parallelism) finds it there.
    update = traced_on(_update(loss_fn, optimizer), mesh_of_shardings(state_sharding))
    out_shardings = None if state_sharding is None else (state_sharding, None)
    jitted = jax.jit(update, donate_argnums=0, out_shardings=out_shardings, compiler_options=compiler_options())
    return jitted if frozen is None else functools.partial(jitted, frozen=frozen)


def make_train_steps(loss_fn: Callable, optimizer: optax.GradientTransformation, make_batch: Callable, seed: int,
                     count: int, frozen=None) -> Callable:
    """`count` optimizer updates as one jitted call, `train_steps(state) -> (state, metrics)`:
    update `s` (from `state.step`) trains on `make_batch(data_key)`, `(data_key, dropout_key)
    = step_keys(seed, s)`, as `count` calls of `make_train_step`'s step would, in one
    `lax.scan`, so the host dispatches once for `count` updates; the metrics are stacked,
    `[count]` each. The state is donated.

    Args:
      loss_fn, optimizer, frozen: as `make_train_step`'s.
      make_batch: `make_batch(data_key) -> batch`, traced: it draws on the device from the key.
      seed: the run's seed.
      count: updates per call, an int >= 1.
    """
    seed, count = check_seed(seed), as_int(count, "count", minimum=1)
    update = _update(loss_fn, optimizer)

    def train_steps(state: TrainState, frozen=None):
        def one(state, _):
            data_key, dropout_key = _step_keys(seed, state.step.astype(jnp.uint32))
            return update(state, make_batch(data_key), dropout_key, frozen)

        return jax.lax.scan(one, state, length=count)

    jitted = jax.jit(train_steps, donate_argnums=0, compiler_options=compiler_options())
    return jitted if frozen is None else functools.partial(jitted, frozen=frozen)


class CompiledAhead:
    """A jitted program compiled for the shapes of its arguments on a thread of its own, from
    the moment it is made; a call waits for that compile (raising what it raised: a loss that
    fails to trace fails at the first call, as it would unprepared), then runs the compiled
    program. A command starts its update's compile before the work that comes ahead of
    training (placing the state, checking and recording the run, the first snapshot), which
    then runs on the other core instead of before it. (A daemon thread: an interrupted
    command does not wait for the compile to end.)

    Args:
      program: a jitted function, or a `functools.partial` of one over keyword arguments.
      *shapes: its positional arguments, as arrays or `jax.ShapeDtypeStruct`s.
    """

    def __init__(self, program, *shapes):
        jitted, keywords = (program.func, program.keywords) if isinstance(program, functools.partial) else (program, {})
        self._keywords, self._done, self._result = keywords, threading.Event(), None

        def compile_():
            try:
                self._result = jitted.lower(*shapes, **keywords).compile(), None
            except BaseException as e:  # (raised again in the caller's thread, at its call)
                self._result = None, e
            finally:
                self._done.set()

        threading.Thread(target=compile_, name="compile-ahead", daemon=True).start()

    def __call__(self, *args):
        self._done.wait()
        compiled, error = self._result
        if error is not None:
            raise error
        return compiled(*args, **self._keywords)


def compiler_options() -> dict | None:
    """How a run's programs (its update, its initial parameters) are compiled: on a CPU, LLVM
    at -O2 rather than XLA's default -O3. The reversal demo's 50-update scan then compiles in
    half the time (8.9 CPU s against 17.5) and runs as fast (57.5 CPU ms an update against
    57.7), its numbers bit for bit the same; its initial parameters compile in 1.6 CPU s
    against 5.6, the same bits (docs/performance.md, "Whole demo runs"); a first run waits
    for those compiles. Other backends keep their defaults, and so does a process that asked
    JAX not to optimise (`jax_disable_most_optimizations`, as the test suite does)."""
    if jax.default_backend() != "cpu" or jax.config.read("jax_disable_most_optimizations"):
        return None
    return {"xla_backend_optimization_level": 2}


def _update(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """`train_step(state, batch, dropout_key, frozen=None) -> (state, metrics)`: one optimizer
    update, not jitted (`make_train_step` jits it alone, `make_train_steps` scans it)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch, dropout_key: jax.Array, frozen=None):
        (loss, aux), grads = grad_fn(state.params, batch, dropout_key, *(() if frozen is None else (frozen,)))
        # These run while tracing, so a wrong loss_fn fails on the first call.
        if not isinstance(aux, dict) or "loss" in aux:
            raise ValueError(f"loss_fn must return (loss, dict of metrics without 'loss'), got aux {aux!r}")
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), {"loss": loss, **aux}

    return train_step


def step_keys(seed: int, step: int) -> tuple[jax.Array, jax.Array]:
    """The `(data_key, dropout_key)` of update `step` (from 0), a function of `(seed, step)` only,
    so a resume recomputes them; two streams, so the data does not shift when dropout is turned off."""
    seed, step = check_seed(seed), as_int(step, "step", minimum=0, maximum=2**32 - 1)  # folded in as a uint32
    return _step_keys(seed, jnp.uint32(step))


@jax.jit  # one dispatch per step instead of four eager ones
def _step_keys(seed, step):
    data_stream, dropout_stream = jax.random.split(jax.random.key(seed))
    return jax.random.fold_in(data_stream, step), jax.random.fold_in(dropout_stream, step)
