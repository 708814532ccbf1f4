"""What the fault-matrix files share: the demos run as a user runs them (in a process of
their own where the process is under test, else in this one), and what a run directory
holds before and after."""

import contextlib
import fcntl
import hashlib
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from conftest import run_main

from jaxformer.training import read_metrics
from train import reverse

REPO = Path(__file__).resolve().parents[2]
CLI_TINY = ["--n-layer", "1", "--d-model", "32", "--d-ff", "32", "--n-head", "2", "--batch-size", "16",
            "--eval-size", "20", "--log-every", "5", "--checkpoint-every", "5"]  # as tests/train/test_reverse.py


# The commands by short name: the demos in train/, the library's commands that train.
LIBRARY_COMMANDS = {"report": "jaxformer.commands.report", "finetune": "jaxformer.commands.finetune"}


def module_of(command: str) -> str:
    """The module `python -m` runs for `command` ("reverse", "lm", "report", "finetune")."""
    return LIBRARY_COMMANDS.get(command, f"train.{command}")


def run_in_process(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m <module_of(module)> argv` run in this process (`conftest.run_main`): the
    status, stdout and stderr a process of its own would give, without a new Python, a
    new JAX and new compiles. For every case where nothing about a separate process is
    under test."""
    return run_main(importlib.import_module(module_of(module)).main, argv)


def shared_finished_run(tmp_path_factory) -> Path:
    """A finished `train.reverse` run to step 10 (checkpoints 5 and 10), trained in-process
    once per pytest run: the first test file (of any xdist worker) to ask trains it, under a
    lock, the others read it. Tests copy it before they change anything.

    Why shared: the files that damage run directories all start from this same run."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if "PYTEST_XDIST_WORKER" in os.environ else root  # (shared by the workers)
    run_dir = root / "finished-reverse-run"
    with open(root / "finished-reverse-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when the file closes)
        if not run_dir.is_dir():
            training = root / f"finished-reverse-run.{os.getpid()}"  # renamed once whole
            assert reverse.main(["--steps", "10", "--run-dir", str(training), *CLI_TINY]) == 0
            training.rename(run_dir)
    return run_dir


def snapshot(directory: Path) -> dict[str, str] | None:
    """Every file and folder under `directory` with its content's hash (None if absent)."""
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


def start_cli(module: str, argv: list[str], stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """`python -m <module_of(module)> argv` started in the background, its output discarded
    (stderr: or written to the file given)."""
    return subprocess.Popen([sys.executable, "-m", module_of(module), *argv], stdout=subprocess.DEVNULL,
                            stderr=stderr, cwd=REPO)


def wait_until(process: subprocess.Popen, ready: Callable[[], bool], timeout: float = 300) -> None:
    """Returns as soon as `ready()` holds (polled every millisecond), `process` running."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, "the run ended before the moment came"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.001)


def kill_when(process: subprocess.Popen, ready: Callable[[], bool], timeout: float = 300) -> None:
    """SIGKILLs `process` as soon as `ready()` holds."""
    wait_until(process, ready, timeout)
    process.send_signal(signal.SIGKILL)
    process.wait()


def logged_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")}


def last_logged_step(run_dir: Path) -> int:
    return max(logged_losses(run_dir), default=0)


def committed_steps(run_dir: Path) -> list[int]:
    """The checkpoints orbax has finished (renamed from their temporary directory)."""
    checkpoints = run_dir / "checkpoints"
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) if checkpoints.is_dir() else []


def mid_run(run_dir: Path) -> bool:
    """Past a finished checkpoint, with updates logged since, and no save under way."""
    done, last = committed_steps(run_dir), last_logged_step(run_dir)
    return len(done) >= 2 and last > done[-1] and not saving_now(run_dir)


def mid_checkpoint(run_dir: Path) -> bool:
    """A save under way, with an earlier one finished to resume from."""
    return last_logged_step(run_dir) >= 3 and bool(committed_steps(run_dir)) and saving_now(run_dir)


def saving_now(run_dir: Path) -> bool:
    """Whether orbax is writing a checkpoint (its temporary directory exists)."""
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(".orbax-checkpoint-tmp" in p.name for p in checkpoints.iterdir())


@contextlib.contextmanager
def small_disk(path, size: str = "64m"):
    """A tmpfs of `size` mounted at `path` for the block (unmounted after)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small disk is a tmpfs mount, which needs root: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk, leave: int = 0) -> None:
    """Fills `disk` up (a file of zeros), then frees `leave` bytes of it again."""
    with open(disk / "filler", "wb", buffering=0) as f:  # (unbuffered: nothing left to flush at close)
        for block in (1 << 16, 1 << 12, 1):  # then smaller ones, to the last byte
            with contextlib.suppress(OSError):
                while True:
                    f.write(bytes(block))
    size = os.path.getsize(disk / "filler")
    os.truncate(disk / "filler", max(size - leave, 0))
