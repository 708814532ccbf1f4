"""The start of a command's run, a transaction on its run directory: place the state, take
the directory's lock, check everything (the directory, its record, its tokenizer, and with
`--resume` the checkpoint to continue from, `jaxformer.training.resume_from`), and only
then write: a new run's `config.json` and `tokenizer.json` once, and this session in
`about.json`. A check that fails exits in one line (status 2) with nothing written; a write
that fails (a full disk) exits in one line (status 1) with a new run's directory left as it
was found. The `Start` it returns holds the lock for as long as the command works on the
run, and undoes a new run that ends by an error before its first checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any, Callable

import jax

from jaxformer.command_line import fail, note_on_interrupt
from jaxformer.files import write_text_atomically
from jaxformer.runtime import agree, barrier, is_primary, on_primary
from jaxformer.text.tokenizer import TOKENIZER_FILE
from jaxformer.training.checkpoints import Restored, committed_steps
from jaxformer.training.failures import failing_as, kept
from jaxformer.training.flags import RunOptions
from jaxformer.training.loop import resume_from
from jaxformer.training.placement import place
from jaxformer.training.report_page import check_run_files, record_session
from jaxformer.training.run_dir import CONFIG_FILE, RunLock, check_run_dir, lock_run_dir, save_run_config
from jaxformer.training.state import CompiledAhead, TrainState, make_train_steps

# Config fields a run may change on resume: how it computes, not what it learns. Parameters
# and optimizer state are stored in float32, so the compute precision is not part of the
# run, and recomputing activations (remat) gives the same gradients.
DTYPE_FIELDS = ("dtype", "param_dtype", "cache_dtype", "remat")
# Config fields added after runs were first recorded, with the value that leaves the model as it
# was: recorded only where they differ from it, so that a run recorded before them resumes.
LATER_FIELDS = {"layers": ()}


def run_record(config, settings) -> dict:
    """What `--resume` must match: the model config and the settings the demo names.

    Args:
      config: the model's config dataclass; recorded less its dtypes (`DTYPE_FIELDS`).
      settings: the demo's settings; its `RESUME_FIELDS` are recorded.
    """
    model = {k: v for k, v in dataclasses.asdict(config).items()
             if k not in DTYPE_FIELDS and not (k in LATER_FIELDS and v == LATER_FIELDS[k])}
    return {"model": model, **{field: getattr(settings, field) for field in settings.RESUME_FIELDS}}


@dataclasses.dataclass
class Start:
    """A run checked and recorded, ready for its first update. `with` it for as long as
    the command works on the run: it holds the run directory's lock until then, and a
    new run that ends by an error or Ctrl-C before its first checkpoint is undone (its
    directory left as the command found it), since nothing of it could be resumed.

    Attributes:
      prog: the command.
      run_dir: the run directory.
      state: the train state to start from, placed: the initial one, or the restored one.
      make_batch: the batches, placed like the state.
      state_sharding: the state's sharding on the mesh, or None on one device.
      restored: with `--resume`, the checkpoint to continue from (`resume_from`); else None.
      finished: the restored run had already reached `--steps`: nothing is trained and
        nothing in the run directory is written.
      lock: this process's lock on the run directory.
      created: a new run whose directory this command created (else it found it empty).
      updates: `(n, program)`: the run's calls of `n` updates in one program
        (`make_train_steps`), its compile started as the run began (`CompiledAhead`); None
        where updates run one by one, or on a mesh.
    """

    prog: str
    run_dir: Path
    state: TrainState
    make_batch: Callable
    state_sharding: Any
    restored: Restored | None
    finished: bool
    lock: RunLock
    created: bool = False
    updates: tuple[int, Callable] | None = None

    @property
    def step(self) -> int:
        """The step the run starts from."""
        return self.restored.step if self.restored is not None else 0

    def abandon(self) -> None:
        """Lets the run go after an error: undoes a new run with no checkpoint yet, and
        releases the lock."""
        if (is_primary() and self.restored is None and not self.lock.released
                and not committed_steps(self.run_dir)):
            _undo_new_run(self.run_dir, self.created)
        self.lock.release()

    def __enter__(self) -> "Start":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.abandon() if kind is not None else self.lock.release()


def updates_ahead(setup, settings, run: RunOptions) -> tuple[int, Callable] | None:
    """`(n, program)`: `n` updates in one call, as many as fit between every log line and
    checkpoint (`setup.steps_per_call` at most), their program compiling on a thread from now
    on (`CompiledAhead`, for the shapes of the state `place` makes); None where there is one
    update a call, or a mesh or several processes (whose programs take their shardings)."""
    n = math.gcd(setup.steps_per_call, run.log_every, run.checkpoint_every)
    if n == 1 or run.mesh is not None or jax.process_count() > 1:
        return None
    shapes = jax.eval_shape(lambda params: TrainState.create(params, setup.optimizer), setup.params)
    return n, CompiledAhead(make_train_steps(setup.loss_fn, setup.optimizer, setup.make_batch, settings.seed, n,
                                             frozen=setup.frozen), shapes)


def count_params(params) -> int:
    """The number of scalars in a parameter tree."""
    return sum(x.size for x in jax.tree.leaves(params))


def device_name() -> str:
    """The device the run computes on, and the JAX version."""
    return f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"


def print_device() -> None:
    """One line: `device_name()`."""
    print(f"device: {device_name()}")


def start(prog: str, setup, settings, run: RunOptions, shape_trace=()) -> Start:
    """Places the run, takes its run directory, checks it, and only then records it there.

    A mesh that does not fit, a run directory that another process holds (`lock_run_dir`),
    that holds another run, or (with `--resume`) one that is not writable, holds a damaged
    record, another tokenizer, no checkpoint that restores, or one past `--steps`, exits
    with one line (status 2) before anything in it is written. A new run's `config.json`,
    then its `tokenizer.json`, are written once, atomically; a resumed run's are left as
    they are. Then `about.json` records this session: the settings, the parameter count,
    `shape_trace` (rows of `(stage, shape, note)`), the step it starts from and the
    device. A run that had already finished records nothing. If a write fails (a full
    disk), the command exits with one line (status 1), a new run's directory left as it
    was found.

    Args:
      prog: the command.
      setup: its `jaxformer.training.runs.Setup`.
      settings: its `Settings`.
      run: its `RunOptions`.
      shape_trace: for `about.json`.
    """
    lock, created = None, False
    try:
        state, make_batch, state_sharding = place(setup, settings.batch_size, run.mesh, run.fsdp)
        record = run_record(setup.model.config, settings)
        if not run.resume:
            created = bool(on_primary(lambda: _make_run_dir(run.run_dir)))
        lock = lock_run_dir(run.run_dir)  # then checked: of two commands on one run, the second is refused
        # Read by process 0 alone: the others may read the run directory only once it is taken.
        on_primary(lambda: _check_run(run.run_dir, record, run.resume, setup.tokenizer))
        restored = None
        if run.resume:
            _check_shared(run.run_dir)  # before every process reads its checkpoint
            restored = resume_from(run.run_dir, state, settings.steps, "--steps")  # each process its own blocks
            state = restored.state  # the initial state is not kept alive beside it
    except ValueError as e:
        if lock is not None:
            lock.release()
        if created:
            with contextlib.suppress(OSError):
                run.run_dir.rmdir()  # made above, and still empty: a refused command leaves no trace
        fail(prog, str(e))
    finished = restored is not None and restored.step == settings.steps and not restored.unrestorable
    # Every check passed: the update compiles from here on, while the run is recorded and begins.
    updates = None if finished else updates_ahead(setup, settings, run)
    begun = Start(prog=prog, run_dir=run.run_dir, state=state, make_batch=make_batch, state_sharding=state_sharding,
                  restored=restored, finished=finished, lock=lock, created=created, updates=updates)
    with failing_as(begun):
        if is_primary():
            if restored is None:  # every check passed: the first writes
                save_run_config(run.run_dir, record)
                if setup.tokenizer is not None:
                    save_run_tokenizer(run.run_dir, setup.tokenizer)
            if not finished:
                record_session(run.run_dir, prog, dataclasses.asdict(settings), count_params(setup.params),
                               shape_trace, begun.step, device_name())
    if restored is None:
        try:
            barrier("run directory recorded")
            _check_shared(run.run_dir)  # before every process writes its blocks of a checkpoint there
        except ValueError as e:
            begun.abandon()
            fail(prog, str(e))
    note_on_interrupt(lambda: kept(run.run_dir))
    return begun


def tokenizer_text(tokenizer) -> str:
    """The run directory's `tokenizer.json` of a `jaxformer.text.Tokenizer`."""
    return tokenizer.backend.to_str(pretty=True)


def check_run_tokenizer(run_dir: Path, tokenizer) -> None:
    """Checks that the run in `run_dir` was trained on `tokenizer`'s ids: its
    `tokenizer.json` must be `tokenizer_text(tokenizer)`, byte for byte.

    The same flags and data build the same tokenizer (BPE's training is deterministic),
    so a difference means the data file changed since the run began, or the tokenizers
    library did: a resumed run would read its text as other ids.

    Raises:
      ValueError: naming the file, when it is missing, unreadable or different.
    """
    path = run_dir / TOKENIZER_FILE
    try:
        saved = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}; the run's tokenizer is needed to resume it") from e
    if saved != tokenizer_text(tokenizer).encode("utf-8"):
        raise ValueError(f"{path} differs from the tokenizer this run builds from its flags and data (did the data "
                         "file change?): resume with the run's own data, or use a new run directory")


def save_run_tokenizer(run_dir: Path, tokenizer) -> None:
    """Writes `tokenizer` to `run_dir/tokenizer.json` atomically.

    Raises:
      ValueError: naming the file, when it cannot be written.
    """
    path = run_dir / TOKENIZER_FILE
    try:
        write_text_atomically(path, tokenizer_text(tokenizer))
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from e


def _make_run_dir(run_dir: Path) -> bool:
    """Creates `run_dir` if missing; returns whether it did."""
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"run directory {run_dir} cannot be created: {e.strerror or e}") from None
    return created


def _check_shared(run_dir: Path) -> None:
    """Raises, on every process, unless every process sees process 0's `config.json` in
    `run_dir`: the processes of a run write one run directory, shared."""
    agree((run_dir / CONFIG_FILE).is_file(), f"{run_dir} does not hold the {CONFIG_FILE} process 0 wrote: the "
          "processes of a run need one run directory, on a file system they all see")


def _check_run(run_dir: Path, record: dict, resume: bool, tokenizer) -> None:
    """`check_run_dir`, and for a resumed run its files and tokenizer."""
    check_run_dir(run_dir, record, resume)
    if resume:
        check_run_files(run_dir)
        if tokenizer is not None:
            check_run_tokenizer(run_dir, tokenizer)


def _undo_new_run(run_dir: Path, created: bool) -> None:
    """Leaves a new run's directory as the command found it: gone, or empty."""
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for path in run_dir.iterdir() if run_dir.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
