"""Train states saved and restored under `run_dir/checkpoints/<step>` with orbax."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxformer.training.state import TrainState

CHECKPOINT_DIR = "checkpoints"
# Where a checkpoint that does not restore is moved when the run continues from an older
# one: out of orbax's sight (it would refuse to save that step again), and not deleted.
UNRESTORABLE_DIR = "unrestorable_checkpoints"


@dataclasses.dataclass(frozen=True)
class Restored:
    """The newest checkpoint that restored, and the newer ones that did not.

    Attributes:
      state: the restored state.
      step: its step.
      unrestorable: `(step, why)` of each newer checkpoint that failed, newest first.
    """

    state: TrainState
    step: int
    unrestorable: tuple[tuple[int, str], ...] = ()


class Checkpointer:
    """Saves and restores `TrainState`s under `run_dir/checkpoints/<step>` with orbax.

    Saves are asynchronous: `save` returns once the arrays are copied to host memory and
    the files are written in the background. Orbax writes a step into
    `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only after the last file
    (then `commit_success.txt`) is written; a rename within a directory is atomic on
    local filesystems. Orbax lists steps by names that are plain integers, so a save cut
    short by a crash leaves a `.orbax-checkpoint-tmp` directory that `latest_step` and
    `restore` never see; orbax deletes it in the background once a writable
    `Checkpointer` opens the directory (at the latest before its first save).
    (On GCS, where rename is not atomic, orbax instead requires `commit_success.txt`.)

    Args:
      run_dir: the run directory.
      max_to_keep: how many of the newest checkpoints to keep.
      read_only: only restore: nothing in `run_dir` is created, changed or deleted.
    """

    def __init__(self, run_dir, max_to_keep: int = 3, read_only: bool = False):
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / CHECKPOINT_DIR
        if read_only:
            options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                                   cleanup_tmp_directories=False, save_interval_steps=0)
        else:
            options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, cleanup_tmp_directories=True)
        with _quiet("absl"):  # a read-only manager warns that it is read-only
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self._manager.all_steps())

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
            raise ValueError(f"{self.directory} holds no checkpoint to restore")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        return self._manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def restore_newest(self, target_state: TrainState) -> Restored:
        """The newest checkpoint that restores, trying older ones when a newer one fails.

        A file cut short or garbled (a disk filling up, a copy interrupted) makes orbax
        raise while reading; that checkpoint is skipped and noted, and nothing on disk is
        touched (`set_aside` moves it away once the caller decides to go on).

        Args:
          target_state: as for `restore`.

        Returns:
          The `Restored` state, with the newer checkpoints that failed and why.

        Raises:
          ValueError: in one line, when there is no checkpoint or none restores (each
            step with why).
        """
        failures = []
        for step in reversed(self.all_steps()):
            try:
                # A failed read also leaves orbax's concurrent reads failing in the
                # background, which asyncio would log as tracebacks: `why` says it once.
                with _quiet("asyncio"):
                    state = self.restore(target_state, step)
            except Exception as e:  # noqa: BLE001 - orbax, tensorstore and json raise many types
                failures.append((step, _first_line(e)))
                continue
            return Restored(state=state, step=step, unrestorable=tuple(failures))
        if not failures:
            raise ValueError(f"{self.directory} holds no checkpoint to resume from")
        reasons = "; ".join(f"step {step}: {why}" for step, why in failures)
        raise ValueError(f"no checkpoint in {self.directory} restores ({reasons}); nothing was changed")

    def set_aside(self, step: int) -> Path:
        """Moves checkpoint `step` to `run_dir/unrestorable_checkpoints/<step>`, kept but unseen.

        Returns:
          Where it went.
        """
        target = self.run_dir / UNRESTORABLE_DIR / str(step)
        suffix = 0
        while target.exists():  # set aside before: keep both
            suffix += 1
            target = target.with_name(f"{step}-{suffix}")
        target.parent.mkdir(exist_ok=True)
        (self.directory / str(step)).rename(target)
        self._manager.reload()
        return target

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


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Silences a library's logger for a block and, if the block fails, the errors of the
    coroutines it abandoned (reported when they are collected: a failed block ends by
    collecting them; a full collection takes seconds in a large process, so only then)."""
    logger = logging.getLogger(logger_name)
    level, unraisable = logger.level, sys.unraisablehook
    logger.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda _: None
    try:
        yield
    except BaseException:
        gc.collect()
        raise
    finally:
        logger.setLevel(level)
        sys.unraisablehook = unraisable


def _first_line(error: Exception) -> str:
    """The innermost cause of `error` as one short line: what went wrong where."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:300]}"
