"""The fault matrix, disks: full, read-only, and the permissions of what is written.

A disk that fills up during a run, or before it starts, ends the command in one line
naming the path (status 1), that line the last the command prints (nothing of orbax's
failed save after it), with nothing torn left behind: every line of the run's
JSON-lines files whole, no temporary file or half-written checkpoint, a new run that
had saved nothing undone, and the checkpoints before kept, from which `--resume`
continues bitwise once there is room again. A read-only run directory is refused in one
line before any work. Files are written with the user's umask, as `open()` would.

The disks are real: small tmpfs mounts, which need root (CI runs as root); without
that, these cases skip, saying why.
"""

import os
import re
import shutil
import stat
import subprocess
import sys
import threading

import pytest
from harness import (
    CLI_TINY,
    REPO,
    committed_steps,
    fill,
    last_logged_step,
    logged_losses,
    run_in_process,
    saving_now,
    shared_finished_run,
    small_disk,
    snapshot,
)
from tiny_llama import checkpoint_and_text

from jaxformer.commands import report
from jaxformer.files import append_line, write_folder_atomically, write_text_atomically
from jaxformer.training import MetricsLog
from train import reverse

ARGV = [*CLI_TINY, "--log-every", "1", "--checkpoint-every", "5"]
FULL = "No space left on device"
LORA = ["--steps", "4", "--warmup", "1", "--batch-size", "2", "--seq-len", "16", "--lora-rank", "4", "--log-every", "2",
        "--checkpoint-every", "2"]


def remount_read_only(disk) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def nothing_torn(run_dir) -> None:
    """Every JSON-lines file ends with a whole line; no temporary file or unfinished
    checkpoint is left."""
    for name in ("metrics.jsonl", "snapshots.jsonl"):
        text = (run_dir / name).read_text()
        assert text.endswith("\n"), f"{name} ends in a torn line"
    leftovers = [p.name for p in run_dir.rglob("*") if p.name.endswith(".tmp") or "orbax-checkpoint-tmp" in p.name]
    assert leftovers == []


def past_a_checkpoint(run_dir) -> bool:
    """Past a finished checkpoint, with updates logged since, and no save under way."""
    done = committed_steps(run_dir)
    return bool(done) and not saving_now(run_dir) and last_logged_step(run_dir) > done[-1]


def fill_when(disk, ready, ended: threading.Event) -> None:
    """Fills `disk` as soon as `ready()` holds (polled every millisecond), unless `ended` is set first."""
    while not ready():
        if ended.wait(0.001):
            return
    fill(disk)


def test_a_disk_that_fills_up_mid_run_ends_it_in_one_line_and_resume_continues_bitwise(tmp_path):
    """The run trains in this process while a thread fills its disk once it is past a
    checkpoint (a disk that never filled would let it end at step 1000, status 0)."""
    with small_disk(tmp_path / "disk") as disk:
        run_dir, ended = disk / "run", threading.Event()
        filler = threading.Thread(target=fill_when, args=(disk, lambda: past_a_checkpoint(run_dir), ended))
        filler.start()
        try:
            done = run_in_process("reverse", ["--steps", "1000", "--run-dir", str(run_dir), *ARGV])
        finally:
            ended.set()
            filler.join()
        stderr = done.stderr
        kept, losses = committed_steps(run_dir), logged_losses(run_dir)
        assert done.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"python -m train\.reverse: error: cannot write {re.escape(str(run_dir))}/\S+: {FULL}; "
                            rf"checkpoint {kept[-1]} is kept in {re.escape(str(run_dir))}: continue from it with the "
                            rf"same flags and --resume --run-dir {re.escape(str(run_dir))}", last), last
        nothing_torn(run_dir)
        (disk / "filler").unlink()
        resumed = run_in_process("reverse", ["--resume", "--steps", str(max(losses)), "--run-dir", str(run_dir), *ARGV])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert logged_losses(run_dir) == losses  # floats compared exactly


@pytest.mark.parametrize("room", [0, 4096], ids=["full", "room-for-config.json-only"])
def test_a_full_disk_at_the_start_is_one_line_and_no_run_dir_left(tmp_path, room):
    """The disk is full, or holds one page: `config.json` is written, `about.json` is not.
    Either way the new run's directory is gone again: nothing of it can be resumed."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        fill(disk, leave=room)
        run_dir = disk / "run"
        done = run_in_process("reverse", ["--steps", "10", "--run-dir", str(run_dir), *CLI_TINY])
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
        assert re.fullmatch(rf"python -m train\.reverse: error: cannot write .*{re.escape(str(run_dir))}\S*: {FULL}; "
                            rf"no checkpoint had been saved, so nothing of the run in {re.escape(str(run_dir))} "
                            "was kept", lines[0]), lines[0]
        assert not run_dir.exists()


def test_a_line_that_does_not_fit_is_cut_back_off(tmp_path):
    """The last page of the file has room for part of the line, the disk none: the write
    stops part-way, and what it wrote is cut back off, leaving the file as it was."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        path = disk / "metrics.jsonl"
        MetricsLog(path).write(1, loss=1.0)
        with open(path, "ab") as f:  # the file ends 20 bytes before a page boundary
            f.write(b" " * (4096 - 20 - path.stat().st_size) + b"\n")
        before = path.read_bytes()
        fill(disk)
        with pytest.raises(OSError, match=FULL) as raised:
            MetricsLog(path).write(2, loss=0.5, note_of_some_length=1.0, and_another=2.0, and_more=3.0)
        assert raised.value.filename == str(path) and path.read_bytes() == before


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished `train.reverse` run to step 10 (checkpoints 5 and 10), shared: copy it to change it."""
    return shared_finished_run(tmp_path_factory)


@pytest.mark.parametrize("command", ["resume", "report"])
def test_a_read_only_run_dir_is_refused_in_one_line(finished_run, tmp_path, capsys, command):
    with small_disk(tmp_path / "disk") as disk:
        run_dir = disk / "run"
        shutil.copytree(finished_run, run_dir)
        remount_read_only(disk)
        before = snapshot(run_dir)
        with pytest.raises(SystemExit) as exit_info:
            if command == "resume":
                reverse.main(["--resume", "--steps", "20", "--run-dir", str(run_dir), *CLI_TINY])
            else:
                report.main([str(run_dir)])
        err = capsys.readouterr().err.strip().splitlines()
        writes = ("a resumed run writes its checkpoints and metrics there" if command == "resume"
                  else "the report page is written there (report.html)")
        assert exit_info.value.code == 2 and err == [
            f"{'python -m train.reverse' if command == 'resume' else 'jaxformer-report'}: error: {run_dir} is on a "
            f"read-only file system: {writes}"], err
        assert snapshot(run_dir) == before


# ---------------------------------------------------------------------------------------
# Permissions: as open() gives them

def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_run_dir_is_written_with_the_users_umask(finished_run):
    """The finished run was written under the test's umask (022): its files are 0644,
    readable by others, as `open()` makes them; none is left 0600 by a temporary file."""
    umask = os.umask(0o022)
    os.umask(umask)
    files = [p for p in finished_run.iterdir() if p.is_file()]
    assert {p.name for p in files} >= {"config.json", "about.json", "metrics.jsonl", "snapshots.jsonl", "eval.json",
                                       "report.html"}
    assert {p.name: mode(p) for p in files} == {p.name: 0o666 & ~umask for p in files}


def test_atomic_writes_take_the_umask_and_keep_a_replaced_files_mode(tmp_path):
    umask = os.umask(0o027)
    try:
        write_text_atomically(tmp_path / "new.json", "{}")
        append_line(tmp_path / "new.jsonl", "{}")
        write_folder_atomically(tmp_path / "folder", lambda folder: (folder / "a").write_text("a"))
        (tmp_path / "shared.json").write_text("{}")
        os.chmod(tmp_path / "shared.json", 0o604)
        write_text_atomically(tmp_path / "shared.json", "[]")
    finally:
        os.umask(umask)
    assert mode(tmp_path / "new.json") == mode(tmp_path / "new.jsonl") == 0o640
    assert mode(tmp_path / "folder") == 0o750
    assert mode(tmp_path / "shared.json") == 0o604 and (tmp_path / "shared.json").read_text() == "[]"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """`checkpoint/` (tiny_llama's) and `text.txt`, on the ordinary disk."""
    return checkpoint_and_text(tmp_path_factory.mktemp("tiny-llama"), "Keys and values are cached. " * 60)


def finetune_process(root, run_dir, *python) -> subprocess.CompletedProcess:
    """A LoRA `jaxformer-finetune` of `root`'s checkpoint and text into `run_dir`, a process of
    its own (what it prints as the interpreter exits is under test), run by `python`
    (default: `-m jaxformer.commands.finetune`)."""
    return subprocess.run([sys.executable, *(python or ("-m", "jaxformer.commands.finetune")), "--checkpoint",
                           str(root / "checkpoint"), "--data", str(root / "text.txt"), "--run-dir", str(run_dir),
                           *LORA], capture_output=True, text=True, cwd=REPO, timeout=300)


def assert_ends_on_the_full_disk(done, run_dir) -> None:
    """Status 1, and the last line says the disk under `run_dir` is full."""
    assert done.returncode == 1 and "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"jaxformer-finetune: error: cannot write {re.escape(str(run_dir))}\S*: {FULL}; .*",
                        last), last


def test_a_lora_run_whose_disk_fills_up_ends_on_its_one_line(tiny_checkpoint, tmp_path):
    """A 5 MB disk with 300 KB free: the first checkpoint does not fit."""
    with small_disk(tmp_path / "disk", "5m") as disk:
        fill(disk, leave=300_000)
        run_dir = disk / "run"
        done = finetune_process(tiny_checkpoint, run_dir)
        assert not run_dir.exists()  # a new run that kept nothing is undone
    assert_ends_on_the_full_disk(done, run_dir)


# A save that fails on a full disk with one of orbax's commits made but never started (its
# thread cancelled first): the commit's coroutine, unawaited, is held until the process exits.
SAVE_FAILS_WITH_A_COMMIT_NEVER_STARTED = """
import sys
from jaxformer.command_line import exit_process
from jaxformer.commands import finetune
from jaxformer.training import checkpoints

orbax = {}
exec(compile("async def commit():\\n    pass\\n", "orbax/checkpoint/_src/futures/future.py", "exec"), orbax)
held = []

def save(self, step, args):
    held.append(orbax["commit"]())
    raise RuntimeError("writing the array: [os_error_code='28'] No space left on device")

checkpoints.ocp.CheckpointManager.save = save
exit_process(finetune.main(sys.argv[1:]))
"""


def test_a_commit_a_failed_save_never_started_says_nothing_after_the_error(tiny_checkpoint, tmp_path):
    """The logic of the full disk above, on any disk: the failed save's unstarted commit is
    closed, not left to Python's warning that it was never awaited, printed at exit after
    the command's last line."""
    run_dir = tmp_path / "run"
    done = finetune_process(tiny_checkpoint, run_dir, "-c", SAVE_FAILS_WITH_A_COMMIT_NEVER_STARTED)
    assert_ends_on_the_full_disk(done, run_dir)
