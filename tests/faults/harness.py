"""What the fault-matrix files share: the demos run as a user runs them, and what a run
directory holds before and after."""

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
CLI_TINY = ["--n-layer", "1", "--d-model", "32", "--d-ff", "32", "--n-head", "2", "--batch-size", "16",
            "--eval-size", "20", "--log-every", "5", "--checkpoint-every", "5"]  # as tests/train/test_reverse.py


def run_cli(module: str, argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m train.<module> argv` from the repository root."""
    return subprocess.run([sys.executable, "-m", f"train.{module}", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def snapshot(directory: Path) -> dict[str, str] | None:
    """Every file and folder under `directory` with its content's hash (None if absent)."""
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


def start_cli(module: str, argv: list[str]) -> subprocess.Popen:
    """`python -m train.<module> argv` started in the background, its output discarded."""
    return subprocess.Popen([sys.executable, "-m", f"train.{module}", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=REPO)


def kill_when(process: subprocess.Popen, ready: Callable[[], bool], timeout: float = 300) -> None:
    """SIGKILLs `process` as soon as `ready()` holds (polled every millisecond)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, "the run ended before the moment to kill it"
        assert time.monotonic() < deadline, "the moment to kill the run never came"
        time.sleep(0.001)
    process.send_signal(signal.SIGKILL)
    process.wait()
