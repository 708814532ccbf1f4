"""A training run on a device mesh: the state placed by the sharding rules, batches split over `data`."""

from __future__ import annotations

from typing import Callable

from jax.sharding import Mesh

from jaxformer.sharding import batch_sharding, put, tree_shardings
from jaxformer.training.state import TrainState


def shard_state(state: TrainState, axes, mesh: Mesh, strategy: str = "dp") -> tuple[TrainState, TrainState]:
    """Places a train state on `mesh`.

    Args:
      state: the state, on one device (or on another mesh).
      axes: the logical axis names of each parameter, `jaxformer.sharding.param_axes(model)`.
      mesh: a `(data, model)` mesh from `jaxformer.sharding.make_mesh`.
      strategy: "dp" (a whole copy per data replica) or "fsdp" (parameters and moments split over `data`).

    Returns:
      `(state, state_sharding)`: the state on the mesh, and its shardings for `make_train_step`.
    """
    state_sharding = tree_shardings(state, axes, mesh, strategy)
    return put(state, state_sharding), state_sharding


def shard_batches(make_batch: Callable, mesh: Mesh) -> Callable:
    """`make_batch` whose batches have their rows split over the mesh's `data` axis.

    On a mesh over several processes, each process places only its own devices' rows
    (`jaxformer.sharding.put`): the batch drawn from a key is the same on every process,
    and the same as on one, so a run resumes on any number of processes.

    Args:
      make_batch: `make_batch(data_key) -> batch`, arrays with rows first, as many as `data` divides.
      mesh: the mesh the state is on.
    """
    rows = batch_sharding(mesh)
    return lambda data_key: put(make_batch(data_key), rows)
