"""Train states saved and restored under `run_dir/checkpoints/<step>` with orbax."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxformer.training.state import TrainState

CHECKPOINT_DIR = "checkpoints"


class Checkpointer:
    """Saves and restores `TrainState`s under `run_dir/checkpoints/<step>` with orbax.

    Saves are asynchronous: `save` returns once the arrays are copied to host memory and
    the files are written in the background. Orbax writes a step into
    `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only after the last file
    (then `commit_success.txt`) is written; a rename within a directory is atomic on
    local filesystems. Orbax lists steps by names that are plain integers, so a save cut
    short by a crash leaves a `.orbax-checkpoint-tmp` directory that `latest_step` and
    `restore` never see; orbax deletes it in the background once a `Checkpointer` opens
    the directory (at the latest before that `Checkpointer`'s first save).
    (On GCS, where rename is not atomic, orbax instead requires `commit_success.txt`.)

    Args:
      run_dir: the run directory.
      max_to_keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, run_dir, max_to_keep: int = 3):
        self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def save(self, state: TrainState) -> None:
        """Starts saving `state` as step `state.step`; `wait()` for it to be on disk.

        Args:
          state: the state to save.

        Raises:
          ValueError: if that step or a later one is already saved (orbax would skip it
            silently).
        """
        step = int(state.step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(f"cannot save step {step}: {self.directory} already holds step {latest}")
        self._manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, target_state: TrainState, step: int | None = None) -> TrainState:
        """A saved state, laid out like `target_state`.

        Args:
          target_state: gives the pytree structure, shapes, dtypes and shardings (its
            values are not used), so a state saved on one mesh restores onto another.
          step: the step to restore; default the latest.

        Returns:
          The restored state.

        Raises:
          ValueError: if there is no checkpoint to restore.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no checkpoint to restore in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def wait(self) -> None:
        """Blocks until every started save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's background resources."""
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
