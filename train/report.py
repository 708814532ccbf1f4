"""`python -m train.report RUN_DIR`: build the report page of a run of `train.reverse` or
`train.lm`, finished, interrupted or older than the page.

The demos write `RUN_DIR/report.html` themselves at step 0, at each checkpoint and at the
end. This rebuilds it from what the run directory holds: checkpoints that have no
snapshot yet (a run made before the page existed, or one whose snapshots file was
removed) get one, computed from the checkpoint's parameters; then the page is written.
Nothing else in the run directory is changed. A run in progress (whose process holds
the directory's lock), a read-only directory or a damaged run file is refused in one
line before anything is written.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax

from jaxformer.command_line import FAILED, OneLineParser, describe_os_error, exit_process, fail, run_command
from jaxformer.training import CONFIG_FILE, Checkpointer, TrainState, check_writable, lock_run_dir, read_run_config
from train import cli, lm, reverse
from train.report_page import (ABOUT_FILE, REPORT_FILE, check_run_files, read_about, read_snapshots,
                               record_snapshot, write_report)

PROG = "python -m train.report"
DEMOS: tuple[cli.Demo, ...] = (reverse, lm)  # the demos whose runs it reads


def demo_of(run_dir: Path) -> tuple[cli.Demo, object]:
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
        demo = next((demo for demo in DEMOS if demo.PROG == about["program"]), None)
        if demo is None:
            raise ValueError(f"{about_path} names {about['program']!r}, not one of "
                             f"{', '.join(other.PROG for other in DEMOS)}")
        try:
            return demo, demo.Settings(**about["settings"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"{about_path} holds settings {demo.PROG} does not take ({e}): the file is damaged, "
                             "or from another version") from None
    record = read_run_config(run_dir)  # ValueError naming config.json when missing or unreadable
    model = record.get("model") or {}
    demo = next((demo for demo in DEMOS
                 if model and set(model) <= {f.name for f in dataclasses.fields(demo.MODEL_CONFIG)}), None)
    if demo is None:
        raise ValueError(f"{run_dir / CONFIG_FILE} records a model none of "
                         f"{', '.join(other.PROG for other in DEMOS)} builds (fields {sorted(model)})")
    recorded = {**model, **record}
    return demo, demo.Settings(**{f.name: recorded[f.name] for f in dataclasses.fields(demo.Settings)
                                  if f.name in recorded})


def snapshot_checkpoints(run_dir: Path, demo: cli.Demo, settings) -> list[int]:
    """Records a snapshot of every checkpoint that has none.

    Returns:
      The steps snapshotted.
    """
    setup = demo.build(settings)
    snapshot = demo.snapshotter(setup, settings)
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
            record_snapshot(run_dir, step, **snapshot(jax.device_get(params)))
            done.append(step)
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
        # A run in progress rewrites its page itself; two writers would interleave snapshots.
        lock = lock_run_dir(run_dir)
    except ValueError as e:
        fail(PROG, str(e))
    with lock:
        try:
            check_writable(run_dir, f"the report page is written there ({REPORT_FILE})")
            check_run_files(run_dir)
            demo, settings = demo_of(run_dir)
            with demo.random_bits():  # as the run was built and trained
                added = snapshot_checkpoints(run_dir, demo, settings)
            if added:
                print(f"snapshots of checkpoints {', '.join(map(str, added))} added")
            print(f"report: {write_report(run_dir)}")
        except (ValueError, TypeError) as e:
            fail(PROG, str(e))
        except OSError as e:
            fail(PROG, f"cannot write {describe_os_error(e)}", FAILED)
    return 0


if __name__ == "__main__":
    exit_process(main())
