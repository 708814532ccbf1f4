"""The training loop: updates, metrics, progress and checkpoints, resumable exactly."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from jaxformer.command_line import interrupts_deferred, raise_if_interrupted
from jaxformer.runtime import is_primary, on_primary
from jaxformer.training.checkpoints import CHECKPOINT_DIR, Checkpointer, Restored, committed_steps
from jaxformer.training.metrics import METRICS_FILE, MetricsLog
from jaxformer.training.progress import ProgressBar
from jaxformer.training.run_dir import lock_run_dir
from jaxformer.training.state import TrainState, step_keys
from jaxformer.validation import as_int


class Diverged(ValueError):
    """Training stopped being finite: the run stopped before logging or saving past it.

    Attributes:
      step: the first update whose loss was NaN or infinite, or, when every loss was
        finite, the update after which the parameters held NaN or inf.
      checkpoint: the newest checkpoint kept (all finite), or None if there is none.
    """

    def __init__(self, what: str, step: int, checkpoint: int | None):
        kept = (f"the newest checkpoint, step {checkpoint}, holds the last finite state" if checkpoint is not None
                else "no checkpoint was saved")
        super().__init__(f"{what}: training stopped there, before logging or saving it; {kept}")
        self.step, self.checkpoint = step, checkpoint


@jax.jit
def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


@jax.jit
def _note_nonfinite(first: tuple[jax.Array, jax.Array], loss: jax.Array, done) -> tuple[jax.Array, jax.Array]:
    """`first` (the first step whose loss was not finite, or -1; and that loss) after the
    losses of the updates up to step `done` (`loss`: one, or `[n]` of steps `done - n + 1 ..
    done`), kept on the device so that watching costs no wait for the host."""
    first_step, first_loss = first
    loss = jnp.atleast_1d(loss)
    bad = ~jnp.isfinite(loss)
    i = jnp.argmax(bad)  # the first not finite, if any
    new = (first_step < 0) & bad.any()
    return (jnp.where(new, done - loss.shape[0] + 1 + i, first_step),
            jnp.where(new, loss[i].astype(jnp.float32), first_loss))


def _updates_in_call(step: int, num_steps: int, log_every: int, checkpoint_every: int, steps_per_call: int) -> int:
    """How many updates the call from update `step` makes: `steps_per_call` when `step` is a
    multiple of it and no log line, checkpoint or the end comes before `step + steps_per_call`,
    else 1. A function of the step alone, so a resumed run makes the calls the uninterrupted
    run made, and computes what it did bit for bit."""
    if steps_per_call == 1 or step % steps_per_call:
        return 1
    stop = min(num_steps, (step // log_every + 1) * log_every, (step // checkpoint_every + 1) * checkpoint_every)
    return steps_per_call if step + steps_per_call <= stop else 1


def train_loop(state: TrainState, train_step: Callable, make_batch: Callable, *, seed: int, num_steps: int,
               run_dir, checkpoint_every: int, log_every: int, lr_schedule: Callable | None = None,
               resume: Restored | None = None, progress: bool = True,
               on_checkpoint: Callable[[TrainState], None] | None = None,
               train_steps: tuple[int, Callable] | None = None) -> TrainState:
    """Runs updates `state.step .. num_steps - 1`, logging and checkpointing into `run_dir`.

    Update s trains on `make_batch(data_key)`, `(data_key, dropout_key) = step_keys(seed,
    s)`, so a resumed run redraws exactly. Metrics reach the host only at a log line, the
    one wait for the device (the first line's `steps_per_sec` includes compilation). Every
    check comes before anything in `run_dir` is written; how a run stops is in
    docs/training.md, "How a run ends".

    Args:
      state: the initial state (with `resume`, replaced by the restored one).
      train_step: from `make_train_step`.
      make_batch: `make_batch(data_key) -> batch`, the same shapes every step.
      seed: the run's seed.
      num_steps: the update count to stop at.
      run_dir: the run directory.
      checkpoint_every, log_every: updates between checkpoints, and between metrics lines.
      lr_schedule: optional `step -> learning rate`, logged as `lr` (the line's last update's).
      resume: None for a new run; to continue the one in `run_dir`, the `Restored` that
        `resume_from(run_dir, state, num_steps)` gives.
      progress: show a `ProgressBar` on stderr.
      on_checkpoint: called with the state after each checkpoint is started.
      train_steps: `(n, make_train_steps(..., count=n))`: `n` updates in one call wherever
        they fit between log lines and checkpoints (`_updates_in_call`), the rest one by one
        with `train_step`; the same updates either way (its `make_batch` and `seed` this call's).

    Returns:
      The state after `num_steps` updates, its checkpoint on disk.

    Raises:
      ValueError: a non-positive count; checkpoints in `run_dir` without `resume`; with
        `resume`, a step past `num_steps`; another process holds `run_dir`.
      TypeError: `resume` is neither None nor a `Restored`.
      Diverged: a loss, or the parameters after an update, were NaN or inf.
      KeyboardInterrupt: Ctrl-C, between updates; a save is never cut short.
      OSError: naming the file the run directory could not take (a full disk).
    """
    num_steps, checkpoint_every, log_every = (
        as_int(value, f"train_loop {name}", minimum=1)
        for name, value in (("num_steps", num_steps), ("checkpoint_every", checkpoint_every), ("log_every", log_every)))
    run_dir = Path(run_dir)
    if resume is None:
        run_dir.mkdir(parents=True, exist_ok=True)
    elif not isinstance(resume, Restored):
        raise TypeError(f"train_loop resume must be None or the Restored of resume_from(run_dir, state, num_steps) "
                        f"(got {type(resume).__name__})")
    else:
        check_steps(resume.step, num_steps, run_dir)
    with lock_run_dir(run_dir):
        return _train(state, train_step, make_batch, seed, num_steps, run_dir, checkpoint_every, log_every,
                      lr_schedule, resume, progress, on_checkpoint, train_steps or (1, None))


def _train(state, train_step, make_batch, seed, num_steps, run_dir, checkpoint_every, log_every, lr_schedule,
           resume, progress, on_checkpoint, train_steps) -> TrainState:
    """`train_loop` with its arguments checked and the run directory locked."""
    if resume is not None:
        state = resume.state
    else:  # read by process 0 alone: the others may find the folder it is about to make
        on_primary(lambda: _check_new(run_dir))

    # Every check is done: from here on the run directory is written: the metrics by process
    # 0, the checkpoints by every process (each its own blocks).
    checkpointer = Checkpointer(run_dir)
    for step, why in resume.unrestorable if resume is not None else ():
        print(f"checkpoint {step} does not restore ({why}): moved to {checkpointer.set_aside(step)}",
              file=sys.stderr)
    primary = is_primary()
    log = MetricsLog(run_dir / METRICS_FILE)
    bar = None
    try:
        start = int(state.step)
        # Lines past the restored step come from updates after the last checkpoint of an
        # interrupted run; they are about to be redone. (A fresh run clears the file.)
        if primary:
            log.truncate_after(start)
        bar = ProgressBar(num_steps, initial=start) if progress and primary else None

        # (Jitted: run eagerly, the schedule's few scalar operations compile one by one.)
        learning_rate = None if lr_schedule is None else jax.jit(lr_schedule)
        last_step, last_time = start, time.perf_counter()
        nonfinite = (jnp.int32(-1), jnp.float32(0))
        steps_per_call, many = train_steps
        s = start
        while s < num_steps:
            raise_if_interrupted()
            n = _updates_in_call(s, num_steps, log_every, checkpoint_every, steps_per_call)
            if n > 1:
                state, metrics = many(state)
            else:
                data_key, dropout_key = step_keys(seed, s)
                state, metrics = train_step(state, make_batch(data_key), dropout_key)
            done = s + n
            nonfinite = _note_nonfinite(nonfinite, metrics["loss"], done)
            at_log, at_checkpoint = done % log_every == 0 or done == num_steps, done % checkpoint_every == 0
            if at_log or at_checkpoint:
                _stop_if_nonfinite(nonfinite, checkpointer)
            if at_log:  # the line's last update's metrics
                values = {name: float(v if n == 1 else v[-1]) for name, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                if learning_rate is not None:
                    values["lr"] = float(learning_rate(done - 1))
                values["steps_per_sec"] = (done - last_step) / max(now - last_time, 1e-9)
                last_step, last_time = done, now
                if primary:
                    log.write(done, **values)
                if bar is not None:
                    bar.update(done, **values)
            if at_checkpoint or done == num_steps:
                if not _all_finite(state.params):
                    checkpointer.wait()
                    raise Diverged(f"the parameters after update {done} hold NaN or inf (its loss was finite)",
                                   done, checkpointer.latest_step())
                with interrupts_deferred():  # started whole, or Ctrl-C would leave it torn
                    checkpointer.save(state)
                if on_checkpoint is not None:
                    on_checkpoint(state)
            s = done
        checkpointer.wait()
    finally:
        if bar is not None:
            bar.close()
        checkpointer.close()
    return state


def resume_from(run_dir, state: TrainState, num_steps: int, steps_name: str = "num_steps") -> Restored:
    """The checkpoint a resumed run continues from: the newest in `run_dir` that restores
    (`Checkpointer.restore_newest`), laid out like `state`, at most `num_steps`. Pass it to
    `train_loop(..., resume=...)`. Reads only: nothing in `run_dir` is written.

    Args:
      run_dir: the run directory.
      state: the initial state, whose structure, shapes and shardings it restores onto.
      num_steps: the update count the resumed run stops at.
      steps_name: how the message names `num_steps` (a command: its flag, "--steps").

    Raises:
      ValueError: in one line naming `run_dir`: no such directory, no checkpoint that
        restores, or one past `num_steps`.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: it holds no checkpoint to resume from")
    with Checkpointer(run_dir, read_only=True) as saved:
        restored = saved.restore_newest(state)
    check_steps(restored.step, num_steps, run_dir, steps_name)
    return restored


def check_steps(step: int, num_steps: int, run_dir, steps_name: str = "num_steps") -> None:
    """Raises ValueError unless a run that has reached `step` may go on to `num_steps`."""
    if step > num_steps:
        raise ValueError(f"{steps_name} {num_steps} is below step {step}, which the run in {run_dir} has reached: "
                         f"pass {steps_name} {step} or more")


def _check_new(run_dir: Path) -> None:
    """Raises unless `run_dir` holds no committed checkpoint."""
    steps = committed_steps(run_dir)
    if steps:
        raise ValueError(f"{run_dir / CHECKPOINT_DIR} already holds step {steps[-1]}; pass resume=resume_from(...) "
                         "to continue that run or choose a new run_dir")


def _stop_if_nonfinite(nonfinite: tuple[jax.Array, jax.Array], checkpointer: Checkpointer) -> None:
    """Raises `Diverged` if an update so far had a loss that is not finite."""
    step, loss = (x.item() for x in jax.device_get(nonfinite))
    if step >= 0:
        checkpointer.wait()  # the save before it is finished, so the newest checkpoint is its own
        raise Diverged(f"the loss is {loss} at step {step}", step, checkpointer.latest_step())
