"""Training machinery shared by the demos, independent of the model.

    state = TrainState.create(params, optimizer)
    train_step = make_train_step(loss_fn, optimizer)   # jitted, donates the state
    state = train_loop(state, train_step, make_batch, seed=0, num_steps=1000,
                       run_dir="runs/x", checkpoint_every=200, log_every=50)

A run directory holds `config.json`, `metrics.jsonl` (one JSON object per logged step)
and `checkpoints/<step>/`. Resuming needs no saved random state: the data and dropout
keys of step s are derived from `(seed, s)` alone, so a run restored from its step-10
checkpoint draws exactly the batches and dropout masks the uninterrupted run drew, and
ends with bitwise the same parameters.

Steps are counted as updates done: `state.step == s` before update s, a checkpoint or
metrics line labelled s holds the result of the first s updates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import struct

from jaxformer.sharding import DATA, batch_sharding, check_fits, make_mesh, parse_mesh, tree_shardings

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"


def fail(prog: str, message: str) -> None:
    """Stops a demo with one clear line on stderr (exit status 2), not a traceback."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (`prog: error: ...`), not a usage dump."""

    def error(self, message):
        fail(self.prog, message)


def start_run(run_dir, config: dict, resume: bool) -> None:
    """Checks and records a run's config in `run_dir` before training starts.

    Raises:
      ValueError: resuming a run directory that holds a different config, or starting a
        new run in a directory that is not empty (its checkpoints would be mixed in).
    """
    run_dir = Path(run_dir)
    if resume:
        check_run_config(run_dir, config)
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"{run_dir} is not empty: pass --resume to continue that run, or choose a new --run-dir")
    save_run_config(run_dir, config)


def initialize_distributed() -> bool:
    """Joins the other processes of a multi-host run when the environment names some.

    `jax.distributed.initialize()` reads the coordinator, the process count and this
    process's index from Slurm (`SLURM_NTASKS` > 1), Open MPI (`mpirun`) and Cloud TPU pod
    slices (several `TPU_WORKER_HOSTNAMES`) by itself. Elsewhere set
    `JAX_COORDINATOR_ADDRESS=host:port`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` on every
    host. Must run before anything touches a device. Returns whether it initialized.
    """
    explicit = "JAX_COORDINATOR_ADDRESS" in os.environ
    if not (explicit or int(os.environ.get("SLURM_NTASKS", "1")) > 1 or "OMPI_MCA_orte_hnp_uri" in os.environ
            or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")):
        return False
    counts = {}
    if explicit and "JAX_NUM_PROCESSES" in os.environ:
        counts = dict(num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                      process_id=int(os.environ.get("JAX_PROCESS_ID", "0")))
    jax.distributed.initialize(**counts)
    return True


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    """`--mesh data=N,model=M` and `--fsdp`, shared by the demos."""
    parser.add_argument("--mesh", default=None, metavar="data=N,model=M",
                        help="train on a device mesh: batch split over data, heads and FFN units over model "
                             "(default: one device)")
    parser.add_argument("--fsdp", action="store_true", help="with --mesh: also split parameters and optimizer "
                                                            "state over the data axis")


def shard_training(state: "TrainState", make_batch: Callable, args, config, batch_size: int):
    """Places a run on the mesh of `args.mesh` (or leaves it on one device).

    Returns:
      `(state, make_batch, state_sharding)`: the state on the mesh, a `make_batch` whose
      batches are split over `data`, and the state's shardings for `make_train_step`
      (None without a mesh). Raises `ValueError` for a mesh that does not fit the devices,
      the model's heads or the batch.
    """
    if args.mesh is None:
        if args.fsdp:
            raise ValueError("--fsdp needs --mesh")
        return state, make_batch, None
    mesh = make_mesh(**parse_mesh(args.mesh))
    check_fits(config, mesh)
    if batch_size % mesh.shape[DATA]:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the mesh's data axis ({mesh.shape[DATA]})")
    state_sharding = tree_shardings(state, mesh, "fsdp" if args.fsdp else "dp")
    rows = batch_sharding(mesh)
    return (jax.device_put(state, state_sharding), lambda key: jax.device_put(make_batch(key), rows),
            state_sharding)


def enable_compilation_cache(directory=None) -> Path:
    """Keeps compiled XLA programs on disk, so a second run of a demo skips compilation.

    Args:
      directory: where; defaults to `$JAXFORMER_CACHE_DIR`, else `~/.cache/jaxformer/xla`.

    Returns:
      The directory used.
    """
    directory = Path(directory or os.environ.get("JAXFORMER_CACHE_DIR") or Path.home() / ".cache" / "jaxformer" / "xla")
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Cache every program that took noticeable time to compile, however small its binary.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


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
    def create(cls, params, optimizer: optax.GradientTransformation) -> "TrainState":
        """A state at step 0 with `optimizer.init(params)`.

        The parameters are copied: `train_step` donates its state, which deletes the
        buffers it was given, and that must not delete the caller's own `params`.
        """
        params = jax.tree.map(jnp.copy, params)
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, state_sharding=None) -> Callable:
    """One jitted optimizer update.

    Args:
      loss_fn: `loss_fn(params, batch, dropout_key) -> (loss, aux)`, loss a scalar and
        aux a dict of scalar metrics (without a "loss" key).
      optimizer: an optax transformation.
      state_sharding: a `TrainState` of shardings (`jaxformer.sharding.tree_shardings`)
        to keep the updated state where the mesh rules put it; None for one device.

    Returns:
      `train_step(state, batch, dropout_key) -> (state, metrics)`, metrics
      `{"loss": loss, **aux}` as device scalars (read them only when logging: fetching
      them forces the host to wait for the step). The state argument is donated, so XLA
      updates parameters and optimizer state in place; do not use it after the call.
      Batches of one shape compile once.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch, dropout_key: jax.Array):
        (loss, aux), grads = grad_fn(state.params, batch, dropout_key)
        # These run while tracing, so a wrong loss_fn fails on the first call.
        if not isinstance(aux, dict) or "loss" in aux:
            raise ValueError(f"loss_fn must return (loss, dict of metrics without 'loss'), got aux {aux!r}")
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return state, {"loss": loss, **aux}

    out_shardings = None if state_sharding is None else (state_sharding, None)
    return jax.jit(train_step, donate_argnums=0, out_shardings=out_shardings)


def step_keys(seed: int, step: int) -> tuple[jax.Array, jax.Array]:
    """The `(data_key, dropout_key)` of update `step`, a function of `(seed, step)` only.

    The seed's key is split into two streams once, then each is folded with the step:
    no key is carried from step to step, so any step's keys can be recomputed on resume,
    and the data stream does not shift if the model starts or stops using dropout.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int (got {seed!r})")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**32:
        raise ValueError(f"step must be an int in [0, 2**32) (got {step!r})")
    return _step_keys(seed, jnp.uint32(step))


@jax.jit  # one dispatch per step instead of four eager ones
def _step_keys(seed, step):
    data_stream, dropout_stream = jax.random.split(jax.random.key(seed))
    return jax.random.fold_in(data_stream, step), jax.random.fold_in(dropout_stream, step)


def _write_text_atomically(path: Path, text: str) -> None:
    """Writes `text` to `path` so that a reader sees the old file or the new one, never
    a part: write a temporary file next to it, flush it to disk, then rename over."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_metrics(path) -> list[dict]:
    """The records of a metrics file, in file order (`[]` if it does not exist).

    A line counts once its newline is written: a last line torn by a crash mid-write is
    ignored, not an error.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n") and line.strip():
            records.append(json.loads(line))
    return records


class MetricsLog:
    """A JSON-lines metrics file: one `{"step": int, name: float, ...}` object a line.

    Lines are appended and flushed as they are written, so a crashed run keeps every
    line up to the crash.

    Args:
      path: the file; created (with its directory) if missing, appended to otherwise.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def write(self, step: int, **values) -> None:
        """Appends one line: `step` and each value as a float."""
        record = {"step": int(step), **{name: float(v) for name, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def truncate_after(self, step: int) -> None:
        """Drops the lines with a step above `step`.

        On resume from checkpoint s the interrupted run's lines after s describe updates
        that are about to be redone; dropping them keeps each step logged once.
        """
        keep = [r for r in read_metrics(self.path) if r["step"] <= step]
        self._file.close()
        _write_text_atomically(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        self._file = open(self.path, "a")

    def close(self) -> None:
        self._file.close()


class ProgressBar:
    """A one-line progress bar on stderr: `step/total [####....] loss 1.2345 ...`.

    On a terminal the line is redrawn in place. Elsewhere (CI logs, files) carriage
    returns would pile up into one unreadable line, so a plain line is printed each time
    the step passes a multiple of `every`, and at the last step.

    Args:
      total: the last step.
      initial: the step the bar starts from (a resumed run's restored step).
      every: steps between plain lines when not on a terminal; default `total // 10`.
      stream: where to write; default `sys.stderr`.
    """

    WIDTH = 24

    def __init__(self, total: int, initial: int = 0, *, every: int | None = None, stream=None):
        if total < 1:
            raise ValueError(f"ProgressBar total must be >= 1 (got {total})")
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = getattr(self.stream, "isatty", lambda: False)()
        self.every = every if every is not None else max(1, total // 10)
        self._shown = initial  # the last step drawn or printed
        self._drawn = 0  # width of the line on a terminal, to blank a longer old one

    def update(self, step: int, **values) -> None:
        """Shows `step` and the latest values (loss, lr, steps_per_sec, or any other)."""
        line = self._format(step, values)
        if self.is_tty:
            self.stream.write("\r" + line.ljust(self._drawn))
            self._drawn = len(line)
        elif step // self.every != self._shown // self.every or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._shown = step

    def close(self) -> None:
        """Ends the redrawn line, so what follows starts on a line of its own."""
        if self.is_tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0

    def _format(self, step: int, values: dict) -> str:
        filled = round(self.WIDTH * min(step, self.total) / self.total)
        parts = [f"{step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (self.WIDTH - filled)}]"]
        for name, v in values.items():
            if name == "lr":
                parts.append(f"lr {v:.2e}")
            elif name == "steps_per_sec":
                parts.append(f"{v:.1f} steps/s")
            else:
                parts.append(f"{name} {v:.4f}")
        return "  ".join(parts)


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
        """The state saved at `step` (default: the latest), with the pytree structure,
        shapes, dtypes and shardings of `target_state` (whose values are not used)."""
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


def _jsonable(config: dict) -> dict:
    """`config` as it reads back from JSON (tuples become lists), so that a config
    compares equal to its saved copy."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (got {type(config).__name__})")
    return json.loads(json.dumps(config))


def save_run_config(run_dir, config: dict) -> None:
    """Writes `config` (a JSON-serialisable dict) to `run_dir/config.json` atomically."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_text_atomically(run_dir / CONFIG_FILE, json.dumps(_jsonable(config), indent=2, sort_keys=True) + "\n")


def check_run_config(run_dir, config: dict) -> None:
    """Checks that resuming `run_dir` with `config` continues the same run.

    Does nothing if `run_dir` holds no config yet.

    Raises:
      ValueError: naming each key whose saved and given values differ (or that only one
        of them has).
    """
    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        return
    saved, given = json.loads(path.read_text()), _jsonable(config)
    missing = "<missing>"
    differing = sorted(k for k in saved.keys() | given.keys() if saved.get(k, missing) != given.get(k, missing))
    if differing:
        details = ", ".join(f"{k} (saved {saved.get(k, missing)!r}, given {given.get(k, missing)!r})"
                            for k in differing)
        raise ValueError(f"{path} holds a different config: {details}; "
                         "resume with the saved config or use a new run directory")


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
