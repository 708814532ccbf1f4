"""A training run on a device mesh: the state placed by the sharding rules, batches split
over `data` (and `expert`). `shard_state` and `shard_batches` place what a caller of `train_loop` made;
`place` is the placement of a command that trains (`jaxformer.training.runs.Setup`), which
makes its state where it will live and checks the mesh against the model and the batch
before anything is allocated.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh

from jaxformer.sharding import (
    DATA,
    batch_axes,
    batch_devices,
    batch_sharding,
    check_mesh_fits,
    make_mesh,
    param_axes,
    parse_mesh,
    put,
    tree_shardings,
)
from jaxformer.training.state import TrainState


def shard_state(state: TrainState, axes, mesh: Mesh, strategy: str = "dp") -> tuple[TrainState, TrainState]:
    """Places a train state on `mesh`.

    Args:
      state: the state, on one device (or on another mesh).
      axes: the logical axis names of each parameter, `jaxformer.sharding.param_axes(model)`.
      mesh: a `(data, expert, model)` mesh from `jaxformer.sharding.make_mesh`.
      strategy: "dp" (a whole copy per data replica) or "fsdp" (parameters and moments split over `data`).

    Returns:
      `(state, state_sharding)`: the state on the mesh, and its shardings for `make_train_step`.
    """
    state_sharding = tree_shardings(state, axes, mesh, strategy)
    return put(state, state_sharding), state_sharding


def shard_batches(make_batch: Callable, mesh: Mesh) -> Callable:
    """`make_batch` whose batches have their rows split over the mesh's `data` axis (and
    `expert`: `jaxformer.sharding.batch_axes`).

    On a mesh over several processes, each process places only its own devices' rows
    (`jaxformer.sharding.put`): the batch drawn from a key is the same on every process,
    and the same as on one, so a run resumes on any number of processes.

    Args:
      make_batch: `make_batch(data_key) -> batch`, arrays with rows first, as many as `data` divides.
      mesh: the mesh the state is on.
    """
    rows = batch_sharding(mesh)
    return lambda data_key: put(make_batch(data_key), rows)


def place(setup, batch_size: int, mesh: str | None, fsdp: bool):
    """A command's initial train state and batches, on `mesh` or on one device.

    Args:
      setup: the command's `jaxformer.training.runs.Setup`.
      batch_size: rows per batch, which the mesh's `data` (x `expert`) axes must divide.
      mesh: `"data=N,model=M"` (`--mesh`; `expert=E` too), or None for one device.
      fsdp: with `mesh`, split parameters and optimizer state over `data` too.

    Returns:
      `(state, make_batch, state_sharding)`; the sharding is None on one device.

    Raises:
      ValueError: a mesh that does not fit the devices, the model's heads or the batch.
    """
    if mesh is None:
        return TrainState.create(setup.params, setup.optimizer), setup.make_batch, None
    mesh = make_mesh(**parse_mesh(mesh))
    check_mesh_fits(setup.model.config, mesh)
    if batch_size % batch_devices(mesh):  # rows over data (x expert: `batch_axes`)
        split = "data axis" if batch_axes(mesh) == DATA else "data x expert axes"
        raise ValueError(f"--batch-size {batch_size} is not divisible by the mesh's {split} ({batch_devices(mesh)})")
    axes = param_axes(setup.model) if setup.param_axes is None else setup.param_axes
    shapes = jax.eval_shape(lambda p: TrainState.create(p, setup.optimizer), setup.params)
    state_sharding = tree_shardings(shapes, axes, mesh, "fsdp" if fsdp else "dp")
    # The parameters go to their blocks; the state (Adam's two moments, twice their size) is
    # born there: nothing of it is made whole on one device and moved.
    params = put(setup.params, state_sharding.params)
    return TrainState.create(params, setup.optimizer, state_sharding), shard_batches(setup.make_batch, mesh), \
        state_sharding
