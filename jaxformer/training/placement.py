"""A training run placed on a device mesh: the state where the sharding rules put each
array, and batches split over the mesh's `data` axis."""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh

from jaxformer.sharding import batch_sharding, tree_shardings
from jaxformer.training.state import TrainState


def shard_state(state: TrainState, axes, mesh: Mesh, strategy: str = "dp") -> tuple[TrainState, TrainState]:
    """Places a train state on `mesh`.

    Args:
      state: the state, on one device (or on another mesh).
      axes: the logical axis names of each parameter, `jaxformer.sharding.param_axes(model)`.
      mesh: a `(data, model)` mesh from `jaxformer.sharding.make_mesh`.
      strategy: "dp" keeps a whole copy of every parameter on each data replica; "fsdp"
        also splits parameters and optimizer moments over `data`.

    Returns:
      `(state, state_sharding)`: the state on the mesh, and its shardings for
      `make_train_step`, which keeps every updated array where it was placed.
    """
    state_sharding = tree_shardings(state, axes, mesh, strategy)
    return jax.device_put(state, state_sharding), state_sharding


def shard_batches(make_batch: Callable, mesh: Mesh) -> Callable:
    """`make_batch` whose batches have their rows split over the mesh's `data` axis.

    Args:
      make_batch: `make_batch(data_key) -> batch`, a pytree of arrays with the batch
        rows first; their count must divide by the `data` axis.
      mesh: the mesh the state is on.

    Returns:
      `make_batch(data_key) -> batch` on the mesh.
    """
    rows = batch_sharding(mesh)
    return lambda data_key: jax.device_put(make_batch(data_key), rows)
