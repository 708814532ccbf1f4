"""The training loop: updates, metrics, progress and checkpoints, resumable exactly."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import jax

from jaxformer.training.checkpoints import Checkpointer
from jaxformer.training.metrics import METRICS_FILE, MetricsLog
from jaxformer.training.progress import ProgressBar
from jaxformer.training.state import TrainState, step_keys


def train_loop(state: TrainState, train_step: Callable, make_batch: Callable, *, seed: int, num_steps: int,
               run_dir, checkpoint_every: int, log_every: int, lr_schedule: Callable | None = None,
               resume: bool = False, progress: bool = True) -> TrainState:
    """Runs updates `state.step .. num_steps - 1`, logging and checkpointing into `run_dir`.

    Update s trains on `make_batch(data_key)` with `(data_key, dropout_key) =
    step_keys(seed, s)`. After every `log_every` updates (and the last) the metrics are
    fetched to the host, the only point where the loop waits for the device, and written
    to `run_dir/metrics.jsonl` with `lr` (`lr_schedule(s)`, the rate update s used) and
    `steps_per_sec` (over the updates since the previous line, so the first one includes
    compilation). After every `checkpoint_every` updates (and the last) the state is
    saved.

    Args:
      state: the initial state; with `resume`, the structure the checkpoint restores onto.
      train_step: from `make_train_step`.
      make_batch: `make_batch(data_key) -> batch`, the same shapes every step.
      seed: the run's seed.
      num_steps: the update count to stop at.
      run_dir: the run directory.
      checkpoint_every: updates between checkpoints.
      log_every: updates between metrics lines.
      lr_schedule: optional `step -> learning rate`, for the log only.
      resume: continue from the latest checkpoint in `run_dir` if there is one.
      progress: show a `ProgressBar` on stderr.

    Returns:
      The state after `num_steps` updates, its checkpoint on disk.

    Raises:
      ValueError: on a non-positive interval, or if `run_dir` holds checkpoints and
        `resume` is False (the new run would mix with the old one's files).
    """
    for name, value in (("num_steps", num_steps), ("checkpoint_every", checkpoint_every), ("log_every", log_every)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"train_loop {name} must be a positive int (got {value!r})")
    run_dir = Path(run_dir)
    checkpointer = Checkpointer(run_dir)
    log = MetricsLog(run_dir / METRICS_FILE)
    bar = None
    try:
        latest = checkpointer.latest_step()
        if latest is not None and not resume:
            raise ValueError(f"{checkpointer.directory} already holds step {latest}; "
                             "pass resume=True to continue that run or choose a new run_dir")
        if latest is not None:
            state = checkpointer.restore(state)
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
        checkpointer.wait()
    finally:
        if bar is not None:
            bar.close()
        log.close()
        checkpointer.close()
    return state
