"""Train states saved and restored under `run_dir/checkpoints/<step>` with orbax."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import inspect
import logging
import os
import re
import shutil
import sys
import threading
import time
import traceback
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxformer.runtime import barrier, is_primary
from jaxformer.training.state import TrainState

CHECKPOINT_DIR = "checkpoints"
# Where a checkpoint that does not restore is moved when the run continues from an older
# one: out of orbax's sight (it would refuse to save that step again), and not deleted.
UNRESTORABLE_DIR = "unrestorable_checkpoints"
# Tensorstore (orbax's writer) has no uint4, though it has int4, float4_e2m1fn and float8_e4m3fn:
# uint4 arrays (a quantized matrix's values in affine int4 and NF4, `jaxformer.quantized`) are
# saved as uint8, the same numbers 0..15, and cast back to the uint4 of the state restored onto.
_UNSTORED = jnp.dtype(jnp.uint4)
_STORED_AS = jnp.dtype(jnp.uint8)


@dataclasses.dataclass(frozen=True)
class Restored:
    """The newest checkpoint that restored (`state`, `step`), and `unrestorable`: `(step, why)`
    of each newer one that failed, newest first.
    """

    state: TrainState
    step: int
    unrestorable: tuple[tuple[int, str], ...] = ()


READ_ATTEMPTS = 5  # listings of a live run's checkpoint folder before a reader gives up


class Checkpointer:
    """Saves and restores `TrainState`s under `run_dir/checkpoints/<step>` with orbax.

    In a run of several processes every process opens it, saves and restores together:
    each writes and reads the blocks of its own devices, and process 0 commits.

    `save` returns once the arrays are on the host; orbax writes the files in the background
    into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` when complete, and lists
    only integer names, so a save cut short by a crash is never restored. A failed save is
    one `OSError` from `save`, `wait` or `close`, leaving nothing of that checkpoint behind.

    Args:
      run_dir: the run directory.
      max_to_keep: how many of the newest checkpoints to keep.
      read_only: only restore: nothing in `run_dir` is created, changed or deleted.
    """

    def __init__(self, run_dir, max_to_keep: int = 3, read_only: bool = False):
        self.run_dir = Path(run_dir).absolute()
        self.directory = self.run_dir / CHECKPOINT_DIR
        self._background = contextlib.ExitStack()
        self._failed = False
        if read_only:
            self._manager = self._open_read_only()
            return
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, cleanup_tmp_directories=True, create=False,
                                               multiprocessing_options=_processes())
        self._background.enter_context(_background_quiet())
        try:
            # Made here, by process 0, before any process opens it (orbax cannot, for named processes).
            if is_primary():
                with self._writing():
                    self.directory.mkdir(parents=True, exist_ok=True)
            barrier("checkpoint directory")
            with _quiet("absl"), self._writing():
                self._manager = ocp.CheckpointManager(self.directory, options=options)
        except BaseException:
            self._background.close()
            raise

    def _open_read_only(self) -> ocp.CheckpointManager:
        """A manager that only reads. The run may be writing meanwhile: a save that commits
        (renames `<step>.orbax-checkpoint-tmp` to `<step>`) while orbax lists the folder makes
        the listing fail on a name that is gone, so it is listed again. Nothing is removed:
        an unfinished save may be the live run's."""
        options = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None,
                                               multiprocessing_options=_processes(),
                                               cleanup_tmp_directories=False, save_interval_steps=0)
        for attempt in range(READ_ATTEMPTS):
            try:
                with _quiet("absl"):  # a read-only manager warns that it is read-only
                    return ocp.CheckpointManager(self.directory, options=options)
            except FileNotFoundError:
                if attempt == READ_ATTEMPTS - 1 or not self.directory.is_dir():
                    raise
                time.sleep(0.05)

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def save(self, state: TrainState) -> None:
        """Starts saving `state` as step `state.step`; `wait()` for it to be on disk.

        Raises:
          ValueError: that step or a later one is already saved (orbax would skip it silently).
        """
        step = int(state.step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise ValueError(f"cannot save step {step}: {self.directory} already holds step {latest}")
        with self._writing():
            self._manager.save(step, args=ocp.args.StandardSave(jax.tree.map(_storable, state)))

    def restore(self, target_state: TrainState, step: int | None = None) -> TrainState:
        """The saved state of `step` (default: the latest), laid out like `target_state`.

        Args:
          target_state: gives the structure, shapes, dtypes and shardings (not the values), so
            a state saved on one mesh restores onto another.
          step: the step to restore.

        Raises:
          ValueError: there is no checkpoint to restore.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"{self.directory} holds no checkpoint to restore")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target_state)
        stored = jax.tree.map(lambda x: x.update(dtype=_STORED_AS) if _unstored(x) else x, abstract)
        restored = self._manager.restore(step, args=ocp.args.StandardRestore(stored))
        return jax.tree.map(lambda x, want: x.astype(_UNSTORED) if _unstored(want) else x, restored, abstract)

    def restore_newest(self, target_state: TrainState) -> Restored:
        """The newest checkpoint that restores, as `Restored`, trying older ones when a newer one fails.

        One that fails to read (a file cut short or garbled) is noted and left on disk
        (`set_aside` moves it, once the caller goes on).

        Args:
          target_state: as for `restore`.

        Raises:
          ValueError: in one line: no checkpoint, or none restores (each step with why).
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
        """Moves checkpoint `step` to `run_dir/unrestorable_checkpoints/<step>`, kept but unseen; returns where."""
        target = self.run_dir / UNRESTORABLE_DIR / str(step)
        suffix = 0
        while target.exists():  # set aside before: keep both
            suffix += 1
            target = target.with_name(f"{step}-{suffix}")
        if is_primary():
            target.parent.mkdir(exist_ok=True)
            (self.directory / str(step)).rename(target)
        barrier(f"checkpoint {step} set aside")
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Blocks until every started save is committed; a failed one raises `OSError` in one line."""
        with self._writing():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves (see `wait`) and releases orbax's background resources."""
        try:
            if not self._failed:
                with self._writing():
                    self._manager.close()
        finally:
            if self._failed:
                self._drain()
            self._background.close()

    def _drain(self) -> None:
        """After a failed save: lets orbax's threads end and collects their abandoned futures
        now, quietly, rather than have them report at exit."""
        with contextlib.suppress(Exception):
            self._manager.close()
        for thread in threading.enumerate():
            if type(thread).__module__.startswith("orbax") and thread is not threading.current_thread():
                thread.join(timeout=60)
        with _quiet("asyncio"):
            gc.collect()
        _close_unstarted_coroutines()
        self._remove_unfinished()  # again: a save still running at the failure may have begun one since

    def _remove_unfinished(self) -> None:
        """Removes what unfinished saves left (`<step>.orbax-checkpoint-tmp`): process 0's work."""
        for part in self.directory.glob("*.orbax-checkpoint-tmp*") if self.directory.is_dir() and is_primary() else ():
            shutil.rmtree(part, ignore_errors=True)

    @contextlib.contextmanager
    def _writing(self):
        """Turns orbax's failure to write a checkpoint into one `OSError`, and removes
        what the failed save left (`<step>.orbax-checkpoint-tmp`)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - orbax, tensorstore and asyncio raise many types
            self._failed = True
            self._remove_unfinished()
            raise _write_error(e, self.directory) from None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unstored(x) -> bool:
    """Whether `x` (an array, or its shape and dtype) is of the dtype orbax cannot store (`_UNSTORED`)."""
    return getattr(x, "dtype", None) == _UNSTORED


def _storable(x):
    """`x` as orbax saves it: a uint4 array as uint8, anything else as it is."""
    return x.astype(_STORED_AS) if _unstored(x) else x


def committed_steps(run_dir) -> list[int]:
    """The steps of the checkpoints committed in `run_dir`, oldest first (read from their
    folder names, without opening orbax)."""
    checkpoints = Path(run_dir) / CHECKPOINT_DIR
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []


def _close_unstarted_coroutines() -> None:
    """Closes the coroutines of orbax and tensorstore that a failed save made but never ran:
    a commit whose thread was cancelled before it started holds its coroutine, unawaited,
    until the process exits, and Python then prints a RuntimeWarning that it was never
    awaited, after the command's last line. Closing one that never started runs none of it."""
    for obj in gc.get_objects():
        # (`type`, not `isinstance`: an object's `__class__` may be a property that warns, as torch's do.)
        if (type(obj) is types.CoroutineType and inspect.getcoroutinestate(obj) == inspect.CORO_CREATED
                and _from_background(obj.cr_code.co_filename, None)):
            obj.close()


def _processes() -> ocp.options.MultiprocessingOptions:
    """Orbax's processes: all of the run's, named, so that orbax's barriers go through JAX's
    coordination service, with timeouts. Unnamed, they are collectives on the devices, which
    a barrier in one of orbax's background threads would start beside the training's own.
    (Named, orbax does not create the checkpoint folder: `Checkpointer` does.)"""
    return ocp.options.MultiprocessingOptions(active_processes=set(range(jax.process_count()))
                                              if jax.process_count() > 1 else None)


@contextlib.contextmanager
def _quiet(logger_name: str):
    """Silences a library's logger for a block and, if it fails, its abandoned coroutines
    (collected then; a full collection takes seconds in a large process)."""
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


@contextlib.contextmanager
def _background_quiet():
    """Keeps what orbax's background threads say about a failed save off stderr: their logs
    (a filter left on for the process, since some come as late as the exit) and the
    unraisable errors of what they drop. Anything else reaches the previous hook."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _BackgroundNoise) for f in logger.filters):
            logger.addFilter(_BackgroundNoise())
    before = sys.unraisablehook

    def hook(unraisable):
        # (An event loop orbax closed is reported from asyncio's own frames.)
        if not _from_background(repr(unraisable.object), unraisable.exc_traceback, ("asyncio",)):
            before(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = before


class _BackgroundNoise(logging.Filter):
    """Drops the records about orbax's saves from its background threads and from asyncio."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc_traceback = record.exc_info[2] if record.exc_info else None
        return not _from_background(f"{record.pathname} {record.getMessage()}", exc_traceback)


def _from_background(text: str, exc_traceback, also: tuple[str, ...] = ()) -> bool:
    """Whether a message or the code its traceback went through is orbax's or tensorstore's."""
    files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(exc_traceback)]
    return any(part in where for where in (text, *files) for part in ("orbax", "tensorstore", *also))


def _write_error(error: Exception, directory: Path) -> OSError:
    """A failed save as an `OSError` naming the checkpoint folder, with the system's reason
    where tensorstore reports one (`[os_error_code='28']`: no space left)."""
    if isinstance(error, OSError) and error.errno is not None:
        return OSError(error.errno, error.strerror, str(directory))
    chain, link = [], error
    while link is not None and len(chain) < 20:
        chain.append(str(link))
        link = link.__cause__ or link.__context__
    code = re.search(r"os_error_code='(\d+)'", " ".join(chain))
    if code:
        return OSError(int(code[1]), os.strerror(int(code[1])), str(directory))
    return OSError(errno.EIO, f"a checkpoint could not be written ({_first_line(error)})", str(directory))


def _first_line(error: Exception) -> str:
    """The innermost cause of `error` as one short line: what went wrong where."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text[:300]}"
