"""What a command that trains is, and the path from it to a trained, evaluated run.

A command that trains (`jaxformer-finetune`, the demos `train.reverse` and `train.lm`) is a
`Demo`: a frozen `Settings` dataclass (its recipe; the defaults are the command line's),
`build(settings) -> Setup`, a `snapshotter` for the report page and its own evaluation.
Its `main` parses its flags (`jaxformer.training.flags`), builds (`build_or_fail`), starts
its run (`jaxformer.training.run_start.start`), trains here (`train`: through
`jaxformer.training.train_loop`, with the report page's snapshots at step 0 and at every
checkpoint, a failure ending in one line by `jaxformer.training.failures.failing_as`),
evaluates, and writes its results with their labels (`write_results`), from which the
report page (`jaxformer.training.report_page`) is built.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import optax
from flax import linen as nn

from jaxformer.command_line import fail
from jaxformer.runtime import barrier, enable_compilation_cache, initialize_distributed, is_primary
from jaxformer.sharding import to_host
from jaxformer.training.failures import failing_as
from jaxformer.training.flags import RunOptions
from jaxformer.training.loop import train_loop
from jaxformer.training.metrics import METRICS_FILE, read_metrics
from jaxformer.training.report_page import (
    REPORT_FILE,
    drop_snapshots_after,
    record_snapshot,
    result_label,
    write_report,
)
from jaxformer.training.report_page import write_results as write_results_file
from jaxformer.training.run_start import Start
from jaxformer.training.state import TrainState, compiler_options, make_train_step

# The results every run has, from its training, and how the report page labels them.
TRAINING_LABELS = {"steps": result_label("updates trained"), "final_loss": result_label("final training loss"),
                   "train_seconds": result_label("training time, compilation included (s)")}


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
      objective: what a command with several training methods trains by, beyond `loss_fn`
        (`jaxformer-finetune --method dpo`'s `jaxformer.commands.dpo.Objective`: its held-out
        evaluation), or None.
      make_step: `make_step(optimizer, state_sharding) -> step`, a step of the command's own
        (`train_loop`'s `train_step`: GRPO's samples its rollouts, then updates) in place of
        `make_train_step(loss_fn, ...)`'s; None for that one.
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
    objective: Any = None
    make_step: Callable | None = None


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
        """`snapshot(params) -> {"attention": [...], "samples": [...]}` (and for a mixture of experts
        `"experts": [...]`, each layer's load) for the report page
        (`jaxformer.training.report_page.record_snapshot`), one compiled forward for every call."""


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
    # (Compiled as the update is, `compiler_options`: the same bits, in a third of the compile.)
    init = jax.jit(model.init, compiler_options=compiler_options())
    return init(jax.random.key(seed), *model.init_inputs())["params"]


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


def train(setup: Setup, settings, run: RunOptions, begun: Start, snapshot: Callable | None = None) -> Trained:
    """Trains from `begun.step` to `settings.steps`, saying where it starts.

    With a `snapshot(params) -> dict` (`record_snapshot`'s `attention`, `samples` and `experts`),
    what the model does is recorded at step 0 and at every checkpoint, and the report
    page rebuilt each time; a resumed run first drops the snapshots past its checkpoint.
    A run that had finished before is not trained again: its parameters are returned
    as they are, and nothing is written.
    """
    print(f"{'resuming' if begun.restored is not None else 'starting'} at step {begun.step} of {settings.steps}"
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
        # Calls of n updates that line up with every log line and checkpoint, compiled since the start.
        step = (make_train_step(setup.loss_fn, setup.optimizer, begun.state_sharding, frozen=setup.frozen)
                if setup.make_step is None else setup.make_step(setup.optimizer, begun.state_sharding))
        state = train_loop(begun.state, step,
                           begun.make_batch, seed=settings.seed, num_steps=settings.steps, run_dir=run.run_dir,
                           checkpoint_every=run.checkpoint_every, log_every=run.log_every,
                           lr_schedule=setup.schedule, resume=begun.restored,
                           on_checkpoint=observe if snapshot else None, train_steps=begun.updates)
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


def write_results(run_dir: Path, trained: Trained, results: dict, labels: dict[str, dict]) -> None:
    """Writes the run's results to `run_dir/eval.json` (atomically), with their labels, then
    the report page with them, and prints where the page is; a run that had finished before
    this session keeps the results and page it has.

    Args:
      run_dir: the run directory.
      trained: the training, whose figures (`TRAINING_LABELS`) come first.
      results: the command's evaluation, JSON-serialisable.
      labels: how the page shows each of `results`
        (`jaxformer.training.report_page.result_label`), in the order it shows them.
    """
    if trained.finished_before:
        print(f"\nreport (as the run left it): {run_dir / REPORT_FILE}")
        return
    if is_primary():
        training = {"steps": trained.steps, "final_loss": trained.last["loss"], "train_seconds": trained.seconds}
        write_results_file(run_dir, {**training, **results}, {**TRAINING_LABELS, **labels})
        write_report(run_dir)
    print(f"\nreport: {run_dir / REPORT_FILE}")
