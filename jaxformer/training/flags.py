"""The command line of a command that trains: the recipe flags every one has, the flags of
where and how its run is kept (`RunOptions`), and the parse that turns them into its
`Settings` and `RunOptions`, every bad value refused in one line naming its flag before
any work. A setting is checked where it is declared, in its command's
`Settings.__post_init__`, through `check`; what the parse checks beyond the settings is
where the run writes: the run directory (`jaxformer.training.run_dir.check_run_dir`), the
export folder (`jaxformer.training.exports.check_export_dir`), and that neither is, holds
or lies inside a file the run reads.
"""

from __future__ import annotations

import argparse
import dataclasses
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from jaxformer.command_line import OneLineParser
from jaxformer.config import DTYPES
from jaxformer.files import check_apart
from jaxformer.sharding import parse_mesh
from jaxformer.training.exports import check_export_dir
from jaxformer.training.run_dir import check_run_dir
from jaxformer.training.state import check_seed
from jaxformer.validation import as_int, check_fields, one_of


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
      mesh: `"data=N,model=M"` (`expert=E` too), or None for one device.
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
                        help="train on a device mesh: batch split over data, heads and FFN units over model; "
                             "expert=E splits a mixture's experts, and the batch, over E more (default: one device)")
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
