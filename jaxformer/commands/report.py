"""`jaxformer-report RUN_DIR`: build the report page of a run of `jaxformer-finetune`,
`train.reverse` or `train.lm`, finished, interrupted or older than the page.

Every run writes `RUN_DIR/report.html` itself at step 0, at each checkpoint and at the
end. This rebuilds it from what the run directory holds: checkpoints that have no
snapshot yet (a run made before the page existed, or one whose snapshots file was
removed) get one on the page, computed from the checkpoint's parameters; then the page is
written (atomically). Nothing else in the run directory is changed, so the report is a
reader: it takes no lock, reads a run in progress as far as it has got (the run rewrites
the page again at its next checkpoint), and never stops a run or a `--resume` from starting.
A read-only directory or a damaged run file is refused in one line before anything is
written.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import jax

from jaxformer.command_line import FAILED, OneLineParser, describe_os_error, exit_process, fail, run_command
from jaxformer.training import CONFIG_FILE, Checkpointer, TrainState, check_writable, read_run_config, runs
from jaxformer.training.report_page import (
    ABOUT_FILE,
    REPORT_FILE,
    check_run_files,
    read_about,
    read_snapshots,
    snapshot_record,
    write_report,
)

PROG = "jaxformer-report"
# Every kind of run, by the program `about.json` records: the module that makes it (a
# `runs.Demo`), imported when a run of it is read (the demos are in a checkout's `train/`).
KINDS = {"python -m train.reverse": "train.reverse", "python -m train.lm": "train.lm",
         "jaxformer-finetune": "jaxformer.commands.finetune"}
OLDER_THAN_ABOUT = ("python -m train.reverse", "python -m train.lm")  # the kinds whose runs may lack about.json


def demo(program: str) -> runs.Demo:
    """The module that makes `program`'s runs.

    Raises:
      ValueError: when it cannot be imported here (a demo, outside the repository's checkout).
    """
    try:
        return importlib.import_module(KINDS[program])
    except ModuleNotFoundError as e:
        raise ValueError(f"the run was made by {program!r}, whose module {KINDS[program]} cannot be imported here "
                         f"({e}): run {PROG} from the repository's checkout") from None


def demo_of(run_dir: Path) -> tuple[runs.Demo, object]:
    """The demo that made the run in `run_dir`, and its settings.

    The settings are those `about.json` records, with the demo its program names; a run
    older than that file gets the demo whose model config has every field `config.json`
    records, and the settings that file holds (the model's size, the seed, the recipe),
    the rest at their defaults.

    Raises:
      ValueError: naming the file, when `run_dir` holds no run of a demo.
    """
    about_path = run_dir / ABOUT_FILE
    about = read_about(run_dir)
    if about is not None:
        if about["program"] not in KINDS:
            raise ValueError(f"{about_path} names {about['program']!r}, not one of {', '.join(KINDS)}")
        made_by = demo(about["program"])
        try:
            return made_by, made_by.Settings(**about["settings"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{about_path} holds settings {made_by.PROG} does not take ({e}): the file is damaged, "
                             "or from another version") from None
    record = read_run_config(run_dir)  # ValueError naming config.json when missing or unreadable
    model = record.get("model") or {}
    made_by = next((demo(program) for program in OLDER_THAN_ABOUT
                    if model and set(model) <= {f.name for f in dataclasses.fields(demo(program).MODEL_CONFIG)}), None)
    if made_by is None:
        raise ValueError(f"{run_dir / CONFIG_FILE} records a model none of {', '.join(OLDER_THAN_ABOUT)} builds "
                         f"(fields {sorted(model)})")
    recorded = {**model, **record}
    return made_by, made_by.Settings(**{f.name: recorded[f.name] for f in dataclasses.fields(made_by.Settings)
                                        if f.name in recorded})


def snapshot_checkpoints(run_dir: Path, made_by: runs.Demo, settings) -> list[dict]:
    """A `snapshot_record` of every checkpoint the run recorded none of (written nowhere:
    the run's own files have one writer, the run).

    Returns:
      The records, by step.
    """
    setup = made_by.build(settings)
    snapshot = made_by.snapshotter(setup, settings)
    recorded = {s["step"] for s in read_snapshots(run_dir)}
    target = TrainState.create(setup.params, setup.optimizer)
    done = []
    with Checkpointer(run_dir, read_only=True) as saved:
        for step in saved.all_steps():
            if step in recorded:
                continue
            try:
                params = saved.restore(target, step).params
            except Exception as e:  # noqa: BLE001 - orbax, tensorstore and json raise many types
                print(f"checkpoint {step} does not restore ({type(e).__name__}): no snapshot of it", file=sys.stderr)
                continue
            done.append(snapshot_record(step, **snapshot(jax.device_get(params))))
    return done


def main(argv=None) -> int:
    return run_command(PROG, lambda: _main(argv))


def _main(argv) -> int:
    parser = OneLineParser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory (holding config.json, metrics.jsonl, "
                                                   "checkpoints/)")
    run_dir = parser.parse_args(argv).run_dir
    if not (run_dir / CONFIG_FILE).is_file():
        fail(PROG, f"{run_dir} is not a run directory: it holds no {CONFIG_FILE}")
    try:
        check_writable(run_dir, f"the report page is written there ({REPORT_FILE})")
        check_run_files(run_dir)
        made_by, settings = demo_of(run_dir)
        added = snapshot_checkpoints(run_dir, made_by, settings)
        if added:
            print(f"snapshots of checkpoints {', '.join(str(s['step']) for s in added)} added to the page")
        print(f"report: {write_report(run_dir, computed=added)}")
    except (ValueError, TypeError) as e:
        fail(PROG, str(e))
    except OSError as e:
        fail(PROG, f"cannot write {describe_os_error(e)}", FAILED)
    return 0


if __name__ == "__main__":
    exit_process(main())
