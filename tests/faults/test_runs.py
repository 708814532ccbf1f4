"""The fault matrix, a run directory in use: two processes on one run, Ctrl-C, a loss
that stops being finite, and damaged run files.

- Two processes on one run: while a run trains, a `--resume` of its directory is refused
  in one line (its lock), and `jaxformer-report` (a reader, which takes no lock) builds the
  page of the run as far as it has got; a `--resume` that starts while a report is being
  built is not refused, nor one of a run stopped by SIGTERM mid-checkpoint while another
  process builds its page again and again, which ends as the run never interrupted ends. Ctrl-C then ends the run
  with status 130 and one line saying what it kept; the lock dies with the process, and
  `--resume` continues from the kept checkpoint to bitwise the losses the run had logged.
- A loss that turns NaN (`--lr 1e6`, a learning rate far too high) stops the run at
  once in one line naming the step, with the checkpoints before it kept and nothing
  non-finite logged or saved; parameters an update left NaN are never saved either.
- Damaged run files (`metrics.jsonl`, `snapshots.jsonl`, `eval.json`, `about.json`):
  `jaxformer-report` and `--resume` refuse in one line naming the file, changing nothing.
"""

import json
import math
import shutil
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import optax
import pytest
from harness import (
    CLI_TINY,
    REPO,
    committed_steps,
    last_logged_step,
    logged_losses,
    mid_checkpoint,
    run_in_process,
    saving_now,
    shared_finished_run,
    snapshot,
    start_cli,
    wait_until,
)

from jaxformer.commands import report
from jaxformer.training import Diverged, TrainState, make_train_step, train_loop
from train import reverse

ARGV = [*CLI_TINY, "--log-every", "1", "--checkpoint-every", "5"]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """A run trained in the background, tried while it runs, then interrupted with Ctrl-C.
    The run is a process of its own (its lock is held by another process, and Ctrl-C ends
    a process); the refused attempts and the resume run in this one.

    Returns:
      What each step gave: the refused `--resume` and the `jaxformer-report` (while it ran), the
      run's own status and stderr, the checkpoints and losses it had, and the resume.
    """
    case = tmp_path_factory.mktemp("interrupted")
    run_dir, stderr = case / "run", case / "stderr.txt"
    with open(stderr, "w") as err:
        process = start_cli("reverse", ["--steps", "100000", "--run-dir", str(run_dir), *ARGV], stderr=err)
        wait_until(process, lambda: len(committed_steps(run_dir)) >= 2 and not saving_now(run_dir)
                   and last_logged_step(run_dir) > committed_steps(run_dir)[-1])
        second = run_in_process("reverse", ["--resume", "--steps", "100000", "--run-dir", str(run_dir), *ARGV])
        rebuild = run_in_process("report", [str(run_dir)])
        before = committed_steps(run_dir)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=300)
    losses, kept, saving = logged_losses(run_dir), committed_steps(run_dir), saving_now(run_dir)
    resumed = run_in_process("reverse", ["--resume", "--steps", str(max(losses)), "--run-dir", str(run_dir), *ARGV])
    return {"second": second, "rebuild": rebuild, "status": process.returncode, "stderr": stderr.read_text(),
            "before": before, "kept": kept, "saving": saving, "losses": losses, "resumed": resumed, "run_dir": run_dir}


def test_a_second_process_on_a_running_run_is_refused_in_one_line(interrupted):
    done = interrupted["second"]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert f"run directory {interrupted['run_dir']} is in use by another process" in lines[0]


def test_a_report_of_a_running_run_builds_its_page(interrupted):
    done = interrupted["rebuild"]
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    assert f"report: {interrupted['run_dir'] / 'report.html'}" in done.stdout


def test_a_resume_that_starts_while_a_report_is_built_is_not_refused(finished_run, tmp_path, monkeypatch):
    """The resume, a process of its own, starts and ends while the report is between reading
    the run and writing its page."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    resumed = []

    def resume_meanwhile(*args, **kwargs):
        resumed.append(start_cli("reverse", ["--resume", "--steps", "15", "--run-dir", str(run_dir), *ARGV]).wait(300))
        return write_report(*args, **kwargs)

    write_report = report.write_report
    monkeypatch.setattr(report, "write_report", resume_meanwhile)
    assert report.main([str(run_dir)]) == 0
    assert resumed == [0] and committed_steps(run_dir)[-1] == 15


def test_a_resume_while_reports_are_built_over_and_over_ends_as_the_uninterrupted_run(tmp_path):
    """SIGTERM while a checkpoint is written; then `--resume`, while another process runs
    `jaxformer-report` on the run over and over: the resume is not refused, and ends with
    the losses and results of the same run never interrupted. (The killed run and the
    reports are processes of their own; the resume and the uninterrupted run run in this one.)"""
    argv = [*CLI_TINY, "--steps", "12", "--log-every", "1", "--checkpoint-every", "1"]
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    assert run_in_process("reverse", [*argv, "--run-dir", str(straight)]).returncode == 0
    process = start_cli("reverse", [*argv, "--run-dir", str(run_dir)])
    wait_until(process, lambda: mid_checkpoint(run_dir))
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == -signal.SIGTERM and saving_now(run_dir)  # cut short mid-save
    reports, resumed = [], threading.Event()

    def report_over_and_over():
        while not resumed.is_set():
            reports.append(subprocess.run([sys.executable, "-m", "jaxformer.commands.report", str(run_dir)],
                                          capture_output=True, text=True, cwd=REPO, timeout=300))

    reporting = threading.Thread(target=report_over_and_over)
    reporting.start()
    try:
        done = run_in_process("reverse", ["--resume", *argv, "--run-dir", str(run_dir)])
    finally:
        resumed.set()
        reporting.join()
    assert done.returncode == 0, done.stderr[-3000:]
    assert logged_losses(run_dir) == logged_losses(straight)  # floats compared exactly

    def results(run):
        return {k: v for k, v in json.loads((run / "eval.json").read_text()).items() if k != "train_seconds"}

    assert results(run_dir) == results(straight)
    assert reports and all(r.returncode == 0 for r in reports), [r.stderr[-1000:] for r in reports if r.returncode]


def test_ctrl_c_ends_a_run_with_130_and_one_line_saying_what_it_kept(interrupted):
    run_dir, kept = interrupted["run_dir"], interrupted["kept"]
    assert interrupted["status"] == 130, interrupted["stderr"][-3000:]
    assert "Traceback" not in interrupted["stderr"]
    last = interrupted["stderr"].strip().splitlines()[-1]  # after the progress lines
    assert last == (f"python -m train.reverse: interrupted; checkpoint {kept[-1]} is kept in {run_dir}: continue "
                    f"from it with the same flags and --resume --run-dir {run_dir}")
    # The newest checkpoint committed before Ctrl-C is still there (older ones go as the
    # run keeps its newest three), and the save under way was finished, not left torn.
    assert interrupted["before"][-1] in kept and not interrupted["saving"]


def test_the_lock_dies_with_the_process_and_the_run_resumes_bitwise(interrupted):
    resumed, losses = interrupted["resumed"], interrupted["losses"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming at step {interrupted['kept'][-1]} of {max(losses)}" in resumed.stdout
    assert logged_losses(interrupted["run_dir"]) == losses  # floats compared exactly


def test_a_loss_that_stops_being_finite_stops_the_run_in_one_line(tmp_path):
    """A learning rate of 1e6 (warmed up over 30 steps) makes the loss NaN at update 5:
    the run stops there, naming it, with checkpoint 3 kept (it restores, and every value
    logged is finite), and nothing of update 5 logged or saved."""
    run_dir = tmp_path / "run"
    done = run_in_process("lm", ["--steps", "30", "--lr", "1e6", "--warmup", "30", "--n-layer", "1", "--d-model", "32",
                          "--n-head", "2", "--n-kv-head", "1", "--batch-size", "8", "--eval-size", "4",
                          "--log-every", "1", "--checkpoint-every", "3", "--run-dir", str(run_dir)])
    lines = [line for line in done.stderr.splitlines() if not line.lstrip()[:1].isdigit()]  # less the progress bar
    assert done.returncode == 1 and lines == [
        "python -m train.lm: error: the loss is nan at step 5: training stopped there, before logging or saving "
        f"it; the newest checkpoint, step 3, holds the last finite state; {run_dir} keeps it. The same recipe "
        "diverges again from there: start a new run with a smaller learning rate"], done.stderr[-3000:]
    assert committed_steps(run_dir) == [3]
    losses = logged_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())


def test_parameters_that_stop_being_finite_are_never_saved(tmp_path):
    """An update that leaves NaN in the parameters with its own loss still finite (the
    loss is computed before the update): the checkpoint due after it is not saved, the
    run stops naming that update, and the newest checkpoint is the one before."""
    nan_at_update_6 = optax.scale_by_schedule(lambda count: jnp.where(count == 5, jnp.nan, 1.0))
    optimizer = optax.chain(optax.sgd(0.1), nan_at_update_6)
    step = make_train_step(lambda p, batch, key: (jnp.sum((p - batch) ** 2), {}), optimizer)
    with pytest.raises(Diverged, match=r"^the parameters after update 6 hold NaN or inf \(its loss was finite\): "
                                       r"training stopped there, before logging or saving it; the newest checkpoint, "
                                       r"step 3, holds the last finite state$") as raised:
        train_loop(TrainState.create(jnp.zeros(3), optimizer), step, lambda key: jax.random.normal(key, (3,)), seed=0,
                   num_steps=20, run_dir=tmp_path, checkpoint_every=3, log_every=100, progress=False)
    assert (raised.value.step, raised.value.checkpoint) == (6, 3)
    assert committed_steps(tmp_path) == [3]


# ---------------------------------------------------------------------------------------
# Damaged run files

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished `train.reverse` run to step 10 (checkpoints 5 and 10), shared: copy it to change it."""
    return shared_finished_run(tmp_path_factory)


def damage_line(name: str, line: int, text: str):
    def damage(run):
        lines = (run / name).read_text().splitlines(keepends=True)
        lines[line - 1] = text + "\n"
        (run / name).write_text("".join(lines))
    return damage


def replace_file(name: str, text: str):
    return lambda run: (run / name).write_text(text)


DAMAGED = [
    ("metrics-line", damage_line("metrics.jsonl", 1, '{"step": 5, "lo'), "metrics.jsonl line 1 is not valid JSON"),
    ("metrics-no-step", damage_line("metrics.jsonl", 1, '{"loss": 1.0}'),
     "metrics.jsonl line 1 is not a record with an integer step"),
    ("snapshots-line", damage_line("snapshots.jsonl", 1, "{garbled"), "snapshots.jsonl line 1 is not valid JSON"),
    ("snapshots-record", damage_line("snapshots.jsonl", 2, '{"step": 5}'),
     "snapshots.jsonl holds a record the report page cannot read"),
    ("eval-json", replace_file("eval.json", '{"steps": 1'), "eval.json is not valid JSON"),
    ("eval-not-object", replace_file("eval.json", "[1]"), "eval.json holds a list, not a JSON object"),
    ("about-json", replace_file("about.json", "{"), "about.json is not valid JSON"),
    ("about-sessions", replace_file("about.json", '{"program": "python -m train.reverse", "settings": {}, '
                                                  '"sessions": 3}'),
     "about.json does not hold a program, settings and sessions"),
]


@pytest.mark.parametrize("damage, message", [case[1:] for case in DAMAGED], ids=[case[0] for case in DAMAGED])
@pytest.mark.parametrize("command", ["report", "resume"])
def test_a_damaged_run_file_is_named_in_one_line_and_nothing_changes(finished_run, tmp_path, capsys, command,
                                                                     damage, message):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    damage(run_dir)
    before = snapshot(run_dir)
    with pytest.raises(SystemExit) as exit_info:
        if command == "report":
            report.main([str(run_dir)])
        else:
            reverse.main(["--resume", "--steps", "10", "--run-dir", str(run_dir), *CLI_TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert str(run_dir) in err[0]
    assert snapshot(run_dir) == before


def test_the_undamaged_run_rebuilds_and_resumes(finished_run, tmp_path, capsys):
    """The damaged cases' baseline: the copy they damage is rebuilt and resumed as it is."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    assert report.main([str(run_dir)]) == 0
    assert reverse.main(["--resume", "--steps", "10", "--run-dir", str(run_dir), *CLI_TINY]) == 0
    assert json.loads((run_dir / "eval.json").read_text()) == json.loads((finished_run / "eval.json").read_text())
