"""The training loop: updates, metrics, progress and checkpoints, resumable exactly."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import jax

from jaxformer.training.checkpoints import CHECKPOINT_DIR, Checkpointer, Restored
from jaxformer.training.metrics import METRICS_FILE, MetricsLog
from jaxformer.training.progress import ProgressBar
from jaxformer.training.state import TrainState, step_keys
from jaxformer.validation import as_int


def train_loop(state: TrainState, train_step: Callable, make_batch: Callable, *, seed: int, num_steps: int,
               run_dir, checkpoint_every: int, log_every: int, lr_schedule: Callable | None = None,
               resume: bool | Restored = False, progress: bool = True,
               on_checkpoint: Callable[[TrainState], None] | None = None) -> TrainState:
    """Runs updates `state.step .. num_steps - 1`, logging and checkpointing into `run_dir`.

    Update s trains on `make_batch(data_key)` with `(data_key, dropout_key) =
    step_keys(seed, s)`. After every `log_every` updates (and the last) the metrics are
    fetched to the host, the only point where the loop waits for the device, and written
    to `run_dir/metrics.jsonl` with `lr` (`lr_schedule(s)`, the rate update s used) and
    `steps_per_sec` (over the updates since the previous line, so the first one includes
    compilation). After every `checkpoint_every` updates (and the last) the state is
    saved.

    Resuming continues from the newest checkpoint that restores
    (`Checkpointer.restore_newest`); every check happens before anything in `run_dir` is
    written. Newer checkpoints that failed to restore are reported on stderr and moved to
    `run_dir/unrestorable_checkpoints/`, and the metrics lines after the restored step
    are dropped (their updates are redone).

    Args:
      state: the initial state; with `resume=True`, the structure the checkpoint
        restores onto.
      train_step: from `make_train_step`.
      make_batch: `make_batch(data_key) -> batch`, the same shapes every step.
      seed: the run's seed.
      num_steps: the update count to stop at.
      run_dir: the run directory.
      checkpoint_every: updates between checkpoints.
      log_every: updates between metrics lines.
      lr_schedule: optional `step -> learning rate`, for the log only.
      resume: False for a new run; True to continue the run in `run_dir`; or the
        `Restored` its caller already got from `Checkpointer(run_dir,
        read_only=True).restore_newest(state)` (to check it before writing anything).
      progress: show a `ProgressBar` on stderr.
      on_checkpoint: called with the state after each checkpoint is started (e.g. to
        record what the model does at that step); the save runs in the background
        meanwhile.

    Returns:
      The state after `num_steps` updates, its checkpoint on disk.

    Raises:
      ValueError: on a non-positive interval; if `run_dir` holds checkpoints and
        `resume` is False (the new run would mix with the old one's files); if `resume`
        finds no checkpoint that restores, or one past `num_steps`.
    """
    num_steps, checkpoint_every, log_every = (
        as_int(value, f"train_loop {name}", minimum=1)
        for name, value in (("num_steps", num_steps), ("checkpoint_every", checkpoint_every), ("log_every", log_every)))
    run_dir = Path(run_dir)
    if resume is True:
        with Checkpointer(run_dir, read_only=True) as saved:
            resume = saved.restore_newest(state)
    if resume:
        if resume.step > num_steps:
            raise ValueError(f"num_steps {num_steps} is below the step the run in {run_dir} has reached "
                             f"({resume.step})")
        state = resume.state
    elif (run_dir / CHECKPOINT_DIR).is_dir():
        with Checkpointer(run_dir, read_only=True) as saved:
            latest = saved.latest_step()
        if latest is not None:
            raise ValueError(f"{run_dir / CHECKPOINT_DIR} already holds step {latest}; "
                             "pass resume=True to continue that run or choose a new run_dir")

    # Every check is done: from here on the run directory is written.
    checkpointer = Checkpointer(run_dir)
    for step, why in resume.unrestorable if resume else ():
        print(f"checkpoint {step} does not restore ({why}): moved to {checkpointer.set_aside(step)}",
              file=sys.stderr)
    log = MetricsLog(run_dir / METRICS_FILE)
    bar = None
    try:
        start = int(state.step)
        # Lines past the restored step come from updates after the last checkpoint of an
        # interrupted run; they are about to be redone. (A fresh run clears the file.)
        log.truncate_after(start)
        bar = ProgressBar(num_steps, initial=start) if progress else None

        last_step, last_time = start, time.perf_counter()
        for s in range(start, num_steps):
            data_key, dropout_key = step_keys(seed, s)
            state, metrics = train_step(state, make_batch(data_key), dropout_key)
            done = s + 1
            if done % log_every == 0 or done == num_steps:
                values = {name: float(v) for name, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                if lr_schedule is not None:
                    values["lr"] = float(lr_schedule(s))
                values["steps_per_sec"] = (done - last_step) / max(now - last_time, 1e-9)
                last_step, last_time = done, now
                log.write(done, **values)
                if bar is not None:
                    bar.update(done, **values)
            if done % checkpoint_every == 0 or done == num_steps:
                checkpointer.save(state)
                if on_checkpoint is not None:
                    on_checkpoint(state)
        checkpointer.wait()
    finally:
        if bar is not None:
            bar.close()
        log.close()
        checkpointer.close()
    return state
