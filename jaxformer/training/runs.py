"""The library trainer the training commands share: parse, build, train, evaluate, report.

A command that trains (`jaxformer-finetune`, the demos `train.reverse` and `train.lm`) is a
`Demo`: a frozen `Settings` dataclass (its recipe; the defaults are the command line's),
`build(settings) -> Setup`, a `snapshotter`, its random-bit context and its own
evaluation. This module holds the rest: the one-line-error parser, the flags every
command has, the run directory's name, recorded config and tokenizer, the path from a
`Setup` to trained parameters through `jaxformer.training`, and the run's report page
(`jaxformer.training.report_page`), which a command feeds with a `snapshot(params) -> {"attention": [...],
"samples": [...]}` of what its model does at step 0 and at every checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import optax
from flax import linen as nn

from jaxformer.command_line import FAILED, OneLineParser, describe_os_error, fail, note_on_interrupt
from jaxformer.config import DTYPES
from jaxformer.files import check_apart, write_folder_atomically, write_text_atomically
from jaxformer.sharding import DATA, check_mesh_fits, make_mesh, param_axes, parse_mesh, put, to_host, tree_shardings
from jaxformer.text.tokenizer import (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE, TOKENIZER_CONFIG_FILE,
                                      TOKENIZER_FILE)
from jaxformer.runtime import agree, barrier, enable_compilation_cache, initialize_distributed, is_primary, on_primary
from jaxformer.training import (CONFIG_FILE, METRICS_FILE, Checkpointer, Diverged, Restored, RunLock, TrainState,
                                check_run_dir, lock_run_dir, make_train_step, make_train_steps, read_metrics,
                                save_run_config, shard_batches, train_loop)
from jaxformer.training.checkpoints import committed_steps
from jaxformer.validation import NotFinite, as_int, check_fields, check_seed, one_of
from jaxformer.training.report_page import (REPORT_FILE, RESULTS_FILE, check_run_files, drop_snapshots_after,
                               record_session, record_snapshot, write_report)

# Config fields a run may change on resume: how it computes, not what it learns. Parameters
# and optimizer state are stored in float32, so the compute precision is not part of the
# run, and recomputing activations (remat) gives the same gradients.
DTYPE_FIELDS = ("dtype", "param_dtype", "cache_dtype", "remat")
# What --export writes (`jaxformer.convert.save_hf`, then `jaxformer.text.save_tokenizer`):
# a folder that holds nothing else is a previous export, which the new one replaces whole.
EXPORT_FILES = (MODEL_CONFIG_FILE, GENERATION_CONFIG_FILE, "model.safetensors", TOKENIZER_FILE,
                TOKENIZER_CONFIG_FILE)


def flag(field: str) -> str:
    """The command-line flag of a settings field: `batch_size` -> `--batch-size`."""
    return "--" + field.replace("_", "-")


def check(settings, validate: Callable, *fields: str, **limits) -> None:
    """Each of `fields` of `settings` (a frozen dataclass, or the parsed flags) checked
    and normalised by `validate` (`jaxformer.validation`'s `as_int`, `as_float`,
    `one_of`, ...), its messages naming the field's flag: `check(settings, as_int,
    "steps", minimum=1)` refuses 0 with "--steps must be a positive int (got 0)"."""
    check_fields(settings, flag, validate, *fields, **limits)


def check_shared_settings(settings) -> None:
    """The checks of the settings every demo has (steps, batch size, seed, dtype), by the
    library's own rules where it has one."""
    check(settings, as_int, "steps", "batch_size", minimum=1)
    check(settings, check_seed, "seed")
    check(settings, one_of, "dtype", choices=DTYPES)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Where and how a run is kept; nothing here changes what is learned.

    Attributes:
      run_dir: where config, metrics, checkpoints and results go.
      resume: continue the run in `run_dir` from its last checkpoint.
      mesh: `"data=N,model=M"`, or None for one device.
      fsdp: with `mesh`, also split parameters and optimizer state over `data`.
      checkpoint_every: updates between checkpoints.
      log_every: updates between metrics lines.
      export: where to write the trained model as a Hugging Face folder, or None (always
        None for a demo without `add_export_flag`).
    """

    run_dir: Path
    resume: bool
    mesh: str | None
    fsdp: bool
    checkpoint_every: int
    log_every: int
    export: Path | None = None


def make_parser(prog: str, doc: str, defaults) -> OneLineParser:
    """A demo's parser with the recipe flags every demo has, defaults from its `Settings()`.

    Args:
      prog: the command, for usage and error lines.
      doc: the demo module's docstring; its first paragraph describes the command.
      defaults: the demo's `Settings()`.
    """
    parser = OneLineParser(prog, doc.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=defaults.steps, help="updates to train for")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per update")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seeds init, data, dropout and evaluation")
    parser.add_argument("--dtype", default=defaults.dtype, choices=DTYPES,
                        help="compute dtype; parameters and optimizer state stay float32")
    return parser


def add_run_flags(parser: argparse.ArgumentParser, run_name: str, checkpoint_every: int, log_every: int) -> None:
    """The flags of `RunOptions`.

    Args:
      parser: from `make_parser`.
      run_name: how a new run directory is named, e.g. "reverse" for runs/reverse-<time>.
      checkpoint_every: the demo's default.
      log_every: the demo's default.
    """
    parser.add_argument("--run-dir", type=Path, default=None,
                        help=f"where config, metrics, checkpoints and results go (default: runs/{run_name}-<time>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    parser.add_argument("--mesh", default=None, metavar="data=N,model=M",
                        help="train on a device mesh: batch split over data, heads and FFN units over model "
                             "(default: one device)")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --mesh: also split parameters and optimizer state over the data axis")
    parser.add_argument("--checkpoint-every", type=int, default=checkpoint_every, help="updates between checkpoints")
    parser.add_argument("--log-every", type=int, default=log_every, help="updates between metrics lines")
    parser.set_defaults(export=None)  # a demo that can export adds the flag (add_export_flag)


def add_export_flag(parser: argparse.ArgumentParser, flag: str = "--export", help: str | None = None) -> None:
    """`--export DIR` (or another `flag`, into `RunOptions.export`), for a demo whose model
    `jaxformer.convert.save_hf` writes."""
    parser.set_defaults(export_flag=flag)
    parser.add_argument(flag, dest="export", type=Path, default=None, metavar="DIR",
                        help=help or "after training and evaluation, write the model and its tokenizer as a "
                             "Hugging Face folder (transformers' AutoModelForCausalLM and AutoTokenizer and "
                             "jaxformer-generate read it); with --resume, a finished run is exported "
                             "without training")


def check_export_dir(export: Path, run_dir: Path, flag: str = "--export") -> None:
    """Checks, reading only, that `--export` can be written once the run is done: a new
    or empty directory, or a previous export (nothing but `EXPORT_FILES`, and the
    temporary files a write of one that was cut short may have left), which the new
    export replaces. Not the run directory, nor another run's: their `config.json` is
    the run's own.

    Raises:
      ValueError: naming `flag`: a file, a path under a file, the run directory, or a
        directory that holds files an export does not write.
    """
    path = export.absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is a file, not a directory" if existing == path else f"cannot be created: {existing} is a file"
        raise ValueError(f"{flag} {export} {where}")
    if path.resolve() == run_dir.resolve():
        raise ValueError(f"{flag} {export} is the run directory: export to a folder of its own")
    others = sorted(name for name in (os.listdir(path) if existing == path else ()) if not _exported(name))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ValueError(f"{flag} {export} holds {shown}: not a previous export to replace "
                         f"(only {', '.join(EXPORT_FILES)}); choose an empty or new directory")


def _exported(name: str) -> bool:
    """Whether a file in an export folder is one an export writes, or the temporary file
    an atomic write of one leaves when it is cut short (`.<name>.XXXX.tmp`)."""
    return name in EXPORT_FILES or any(name.startswith(f".{file}.") and name.endswith(".tmp") for file in EXPORT_FILES)


def write_export(export: Path, write: Callable[[Path], None]) -> None:
    """Writes an export folder as one transaction (`jaxformer.files.write_folder_atomically`):
    a reader sees the previous export whole or the new one whole, and a write cut short
    leaves the previous one as it was.

    Args:
      export: the `--export` folder (checked by `check_export_dir`).
      write: fills the new folder it is given.

    On a run of several processes, process 0 writes it (from arrays every process holds
    whole: `jaxformer.sharding.to_host`).

    Raises:
      OSError: naming the path, when it cannot be written (a full disk, say).
    """
    if not is_primary():
        return
    export.absolute().parent.mkdir(parents=True, exist_ok=True)
    write_folder_atomically(export, write)


def parse(parser: argparse.ArgumentParser, argv, settings_type: type) -> tuple[Any, RunOptions]:
    """Parses `argv` into the demo's settings and the run options; bad input exits with one line.

    Every field of `settings_type` is read from the flag of the same name; a new run's
    directory is named `runs/<settings.run_name>-<time>`.

    Args:
      parser: from `make_parser`, with `add_run_flags` and the demo's own flags.
      argv: the arguments (None: `sys.argv[1:]`).
      settings_type: the demo's `Settings` dataclass.

    Returns:
      `(settings, run)`.
    """
    args = parser.parse_args(argv)
    try:
        settings = settings_type(**{f.name: getattr(args, f.name) for f in dataclasses.fields(settings_type)})
        check(args, as_int, "checkpoint_every", "log_every", minimum=1)
    except ValueError as e:
        parser.error(str(e))
    if args.resume and args.run_dir is None:
        parser.error("--resume needs --run-dir: the run to continue")
    if args.fsdp and args.mesh is None:
        parser.error("--fsdp needs --mesh")
    run_dir = args.run_dir or Path("runs") / f"{settings.run_name}-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        if args.mesh is not None:
            parse_mesh(args.mesh)
    except ValueError as e:
        parser.error(f"--{e}")  # "--mesh 'data=x': ..."
    try:
        # Nothing the run reads (--checkpoint, --data) may be where it writes.
        check_apart({"--run-dir": run_dir, getattr(args, "export_flag", "--export"): args.export},
                    {flag(field): getattr(settings, field) for field in settings.INPUT_FIELDS})
        check_run_dir(run_dir, None, args.resume)  # where it is; its config once the model is built
        if args.export is not None:
            check_export_dir(args.export, run_dir, args.export_flag)  # now, not after training
    except ValueError as e:
        parser.error(str(e))
    return settings, RunOptions(run_dir=run_dir, resume=args.resume, mesh=args.mesh, fsdp=args.fsdp,
                                checkpoint_every=args.checkpoint_every, log_every=args.log_every,
                                export=args.export)


def start_process(prog: str) -> None:
    """What a command does before touching a device: join the other processes of a run of
    several (one line and exit status 2 when the environment names them wrongly), and keep
    compiled programs on disk for the next run."""
    try:
        initialize_distributed(prog)
    except ValueError as e:
        fail(prog, str(e))
    enable_compilation_cache()


@dataclasses.dataclass(frozen=True)
class Setup:
    """A demo ready to train: what its `build(settings)` returns.

    Attributes:
      model: the Flax module.
      params: its initial parameters, from `init_params`.
      optimizer: the optax transformation of the recipe.
      schedule: `step -> learning rate`, the rate update `step` uses.
      loss_fn: `loss_fn(params, batch, dropout_key) -> (loss, {})`, for `make_train_step`.
      make_batch: `make_batch(data_key) -> batch` of the training data.
      tokens_per_step: target positions scored per update (batch rows x scored width).
      corpus: the data the batches are drawn from (a `jaxformer.text.dataset.FinetuneData`, the
        text demo's corpus), or None for the synthetic tasks, which draw every batch from a key.
      tokenizer: the `jaxformer.text.Tokenizer` of the model's ids, kept in the run
        directory as `tokenizer.json`; None for a demo without one.
      param_axes: the logical axis names of `params` (`jaxformer.sharding.param_axes`' form)
        when they are not the model's own parameters (LoRA's adapters); None: the model's.
      frozen: what the loss reads but does not train (LoRA's base), passed to every step as
        `loss_fn`'s fourth argument (`make_train_step`'s `frozen`); None for none.
      steps_per_call: at most this many updates per compiled call (`make_train_steps`: a
        `lax.scan` of them), for a `make_batch` that draws on the device from its key: `train`
        takes its greatest common divisor with the log and checkpoint intervals. 1 (and on a
        mesh): one call an update.
      evaluated: `evaluated(state) -> params`, the parameters the run's evaluation and results
        use, from its final `TrainState` (e.g. `jaxformer.training.averaged` of its optimizer
        state); None: the state's own.
    """

    model: nn.Module
    params: Any
    optimizer: optax.GradientTransformation
    schedule: Callable[[int], Any]
    loss_fn: Callable
    make_batch: Callable
    tokens_per_step: int
    corpus: Any = None
    tokenizer: Any = None
    param_axes: Any = None
    frozen: Any = None
    steps_per_call: int = 1
    evaluated: Callable | None = None


class Demo(Protocol):
    """What a module that trains provides (`train.reverse`, `train.lm`,
    `jaxformer.commands.finetune`), so that what serves every kind of run (this module,
    `jaxformer-report`) treats them alike, never by asking which one it holds.

    Attributes:
      PROG: its command, e.g. "python -m train.reverse"; `about.json` records it.
      MODEL_CONFIG: its model's config dataclass; `config.json` records its fields.
      Settings: its frozen recipe dataclass, the defaults its command line's, with
        `RESUME_FIELDS` (what `--resume` must match), `INPUT_FIELDS` (the files and
        folders it reads, which no output may be, hold or lie inside) and `run_name` (of
        a new run directory); built from bad values it raises ValueError naming the flag.
    """

    PROG: str
    MODEL_CONFIG: type
    Settings: type

    def build(self, settings) -> Setup:
        """The model, its initial parameters, optimizer, schedule, loss and batches."""

    def snapshotter(self, setup: Setup, settings) -> Callable[[Any], dict]:
        """`snapshot(params) -> {"attention": [...], "samples": [...]}` for the report page
        (`train.report_page.record_snapshot`), one compiled forward for every call."""

    def random_bits(self) -> contextlib.AbstractContextManager:
        """The context its command line builds, trains and evaluates in: the same keys
        then draw the same parameters, dropout masks and evaluation data."""


def build_or_fail(prog: str, build: Callable, settings) -> Setup:
    """`build(settings)`; a config that does not hold together or unreadable data exits with one line."""
    try:
        return build(settings)
    except ValueError as e:
        fail(prog, str(e))


def init_params(model: nn.Module, seed: int):
    """`model`'s initial parameters, drawn from `jax.random.key(seed)`.

    Args:
      model: a jaxformer model; it is traced on its `init_inputs()` (the parameters
        depend on its config alone).
      seed: the run's seed.
    """
    return jax.jit(model.init)(jax.random.key(seed), *model.init_inputs())["params"]


def count_params(params) -> int:
    """The number of scalars in a parameter tree."""
    return sum(x.size for x in jax.tree.leaves(params))


def device_name() -> str:
    """The device the run computes on, and the JAX version."""
    return f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"


def print_device() -> None:
    """One line: `device_name()`."""
    print(f"device: {device_name()}")


def run_record(config, settings) -> dict:
    """What `--resume` must match: the model config and the settings the demo names.

    Args:
      config: the model's config dataclass; recorded less its dtypes (`DTYPE_FIELDS`).
      settings: the demo's settings; its `RESUME_FIELDS` are recorded.
    """
    model = {k: v for k, v in dataclasses.asdict(config).items() if k not in DTYPE_FIELDS}
    return {"model": model, **{field: getattr(settings, field) for field in settings.RESUME_FIELDS}}


def place(setup: Setup, batch_size: int, run: RunOptions):
    """The initial train state and batches, on `run.mesh` or on one device.

    Returns:
      `(state, make_batch, state_sharding)`; the sharding is None on one device.

    Raises:
      ValueError: a mesh that does not fit the devices, the model's heads or the batch.
    """
    if run.mesh is None:
        return TrainState.create(setup.params, setup.optimizer), setup.make_batch, None
    mesh = make_mesh(**parse_mesh(run.mesh))
    check_mesh_fits(setup.model.config, mesh)
    if batch_size % mesh.shape[DATA]:
        raise ValueError(f"--batch-size {batch_size} is not divisible by the mesh's data axis ({mesh.shape[DATA]})")
    axes = param_axes(setup.model) if setup.param_axes is None else setup.param_axes
    shapes = jax.eval_shape(lambda p: TrainState.create(p, setup.optimizer), setup.params)
    state_sharding = tree_shardings(shapes, axes, mesh, "fsdp" if run.fsdp else "dp")
    # The parameters go to their blocks; the state (Adam's two moments, twice their size) is
    # born there: nothing of it is made whole on one device and moved.
    params = put(setup.params, state_sharding.params)
    return TrainState.create(params, setup.optimizer, state_sharding), shard_batches(setup.make_batch, mesh), \
        state_sharding


@dataclasses.dataclass(frozen=True)
class Trained:
    """The end of training.

    Attributes:
      params: the trained parameters (`Setup.evaluated`'s, when it has one), gathered onto one
        device (evaluation runs there).
      steps: the updates done.
      seconds: training wall time, compilation included.
      last: the last metrics line (`loss`, `lr`, `steps_per_sec`).
      finished_before: the run had reached its steps before this session, which trained
        nothing: it evaluates (and exports) without writing in the run directory.
    """

    params: Any
    steps: int
    seconds: float
    last: dict
    finished_before: bool = False


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
      restored: with `--resume`, the checkpoint to continue from; else None.
      finished: the restored run had already reached `--steps`: nothing is trained and
        nothing in the run directory is written.
      lock: this process's lock on the run directory.
      created: a new run whose directory this command created (else it found it empty).
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

    @property
    def step(self) -> int:
        """The step the run starts from."""
        return self.restored.step if self.restored else 0

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


def start(prog: str, setup: Setup, settings, run: RunOptions, shape_trace=()) -> Start:
    """Places the run, takes its run directory, checks it, and only then records it there.

    The run directory is a transaction: a mesh that does not fit, a run directory that
    another process holds (`lock_run_dir`), that holds another run, or (with
    `--resume`) one that is not writable, holds a damaged record, another tokenizer, no
    checkpoint that restores, or one past `--steps`, exits with one line (status 2)
    before anything in it is written. A new run's `config.json`, then its
    `tokenizer.json`, are written once, atomically; a resumed run's are left as they
    are. Then `about.json` records this session: the settings, the parameter count,
    `shape_trace` (rows of `(stage, shape, note)`), the step it starts from and the
    device. A run that had already finished records nothing. If a write fails (a full
    disk), the command exits with one line (status 1), a new run's directory left as
    it was found.
    """
    lock, created = None, False
    try:
        state, make_batch, state_sharding = place(setup, settings.batch_size, run)
        record = run_record(setup.model.config, settings)
        if not run.resume:
            created = bool(on_primary(lambda: _make_run_dir(run.run_dir)))
        lock = lock_run_dir(run.run_dir)  # then checked: of two commands on one run, the second is refused
        # Read by process 0 alone: the others may read the run directory only once it is taken.
        on_primary(lambda: _check_run(run.run_dir, record, run.resume, setup.tokenizer))
        restored = None
        if run.resume:
            _check_shared(run.run_dir)  # before every process reads its checkpoint
            with Checkpointer(run.run_dir, read_only=True) as saved:
                restored = saved.restore_newest(state)  # every process reads its own blocks
            if restored.step > settings.steps:
                raise ValueError(f"--steps {settings.steps} is below step {restored.step}, which the run in "
                                 f"{run.run_dir} has reached: pass --steps {restored.step} or more")
            state = restored.state  # the initial state is not kept alive beside it
    except ValueError as e:
        if lock is not None:
            lock.release()
        if created:
            with contextlib.suppress(OSError):
                run.run_dir.rmdir()  # made above, and still empty: a refused command leaves no trace
        fail(prog, str(e))
    finished = restored is not None and restored.step == settings.steps and not restored.unrestorable
    begun = Start(prog=prog, run_dir=run.run_dir, state=state, make_batch=make_batch, state_sharding=state_sharding,
                  restored=restored, finished=finished, lock=lock, created=created)
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


def kept(run_dir: Path) -> str:
    """What an interrupted or failed run leaves, and how to go on from it."""
    steps = committed_steps(run_dir)
    if not steps:
        return f"no checkpoint had been saved, so nothing of the run in {run_dir} was kept"
    return (f"checkpoint {steps[-1]} is kept in {run_dir}: continue from it with the same flags and "
            f"--resume --run-dir {run_dir}")


@contextlib.contextmanager
def failing_as(begun: Start):
    """Ends the command in one line (status 1) when the run cannot go on: the run
    directory cannot be written (a full disk), the loss stopped being finite, a figure it
    computed is not (`jaxformer.validation.NotFinite`), or the device ran out of memory."""
    try:
        yield
    except NotFinite as e:
        begun.abandon()
        fail(begun.prog, f"{e}; {kept(begun.run_dir)}", FAILED)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise  # a bug, not the size: its traceback is the report
        begun.abandon()
        fail(begun.prog, f"out of memory: {str(e).splitlines()[0]}; {kept(begun.run_dir)}. A smaller --batch-size "
                         "or --seq-len needs less", FAILED)
    except Diverged as e:
        begun.abandon()
        where = (f"{begun.run_dir} keeps it" if e.checkpoint is not None
                 else f"nothing of the run in {begun.run_dir} was kept")
        fail(begun.prog, f"{e}; {where}. The same recipe diverges again from there: start a new run with a smaller "
                         "learning rate", FAILED)
    except (OSError, ValueError) as e:
        if isinstance(e, ValueError) and not isinstance(e.__cause__, OSError):
            raise  # a bug, not the disk: its traceback is the report
        begun.abandon()
        reason = describe_os_error(e) if isinstance(e, OSError) else str(e)
        fail(begun.prog, f"cannot write {reason.removeprefix('cannot write ')}; {kept(begun.run_dir)}", FAILED)


def train(setup: Setup, settings, run: RunOptions, begun: Start, snapshot: Callable | None = None) -> Trained:
    """Trains from `begun.step` to `settings.steps`, saying where it starts.

    With a `snapshot(params) -> dict` (`record_snapshot`'s `attention` and `samples`),
    what the model does is recorded at step 0 and at every checkpoint, and the report
    page rebuilt each time; a resumed run first drops the snapshots past its checkpoint.
    A run that had finished before is not trained again: its parameters are returned
    as they are, and nothing is written.
    """
    print(f"{'resuming' if begun.restored else 'starting'} at step {begun.step} of {settings.steps}"
          + (": nothing left to train" if begun.step == settings.steps else ""))
    if begun.finished:
        last = read_metrics(run.run_dir / METRICS_FILE)
        print("the run had finished: it is evaluated again, and its directory is left as it is")
        return Trained(params=to_host(evaluated_params(setup, begun.state)), steps=begun.step, seconds=0.0,
                       last=last[-1] if last else {}, finished_before=True)

    def observe(state):
        figures = snapshot(to_host(state.params))  # on every process: it may compute across them
        if is_primary():
            record_snapshot(run.run_dir, int(state.step), **figures)
            write_report(run.run_dir)

    started = time.perf_counter()
    with failing_as(begun):
        if snapshot is not None:
            if is_primary():
                drop_snapshots_after(run.run_dir, begun.step)
            if begun.step == 0:
                observe(begun.state)
            print(f"report page (rewritten at every checkpoint): {run.run_dir / REPORT_FILE}")
        # Calls of n updates that line up with every log line and checkpoint (n divides both).
        n = math.gcd(setup.steps_per_call, run.log_every, run.checkpoint_every)
        many = None
        if n > 1 and begun.state_sharding is None:
            many = (n, make_train_steps(setup.loss_fn, setup.optimizer, begun.make_batch, settings.seed, n,
                                        frozen=setup.frozen))
        state = train_loop(begun.state, make_train_step(setup.loss_fn, setup.optimizer, begun.state_sharding,
                                                        frozen=setup.frozen),
                           begun.make_batch, seed=settings.seed, num_steps=settings.steps, run_dir=run.run_dir,
                           checkpoint_every=run.checkpoint_every, log_every=run.log_every,
                           lr_schedule=setup.schedule, resume=begun.restored or False,
                           on_checkpoint=observe if snapshot else None, train_steps=many)
    barrier("trained")  # process 0's metrics are written
    trained = Trained(params=to_host(evaluated_params(setup, state)), steps=int(state.step),
                      seconds=time.perf_counter() - started, last=read_metrics(run.run_dir / METRICS_FILE)[-1])
    print(f"\ntrained to step {trained.steps} in {trained.seconds:.1f} s (compile included): "
          f"final loss {trained.last['loss']:.4f}, lr {trained.last['lr']:.2e}")
    return trained


def evaluated_params(setup: Setup, state: TrainState):
    """The parameters a run is evaluated with: `setup.evaluated(state)`, or the state's own."""
    return state.params if setup.evaluated is None else setup.evaluated(state)


def evaluation_key(seed: int) -> jax.Array:
    """The evaluation's key: a stream of its own, apart from every update's data and
    dropout keys (`jaxformer.training.step_keys`)."""
    return jax.random.fold_in(jax.random.key(seed), 0x5EED)


def write_results(run_dir: Path, results: dict, trained: Trained) -> None:
    """Writes the run's results to `run_dir/eval.json` (atomically), then the report page
    with them, and prints where the page is; a run that had finished before this session
    keeps the results and page it has."""
    if trained.finished_before:
        print(f"\nreport (as the run left it): {run_dir / REPORT_FILE}")
        return
    if is_primary():
        write_text_atomically(run_dir / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
        write_report(run_dir)
    print(f"\nreport: {run_dir / REPORT_FILE}")
