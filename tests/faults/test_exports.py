"""The fault matrix, exports: `train.lm --export DIR` is one transaction.

The new export is written into a folder beside DIR and swapped in whole, so a reader
sees the previous export or the new one, never the new weights beside the old
tokenizer; a process killed while it writes leaves the previous export as it was, and
its leftovers (and those of an older layout's temporary files inside DIR) do not stand
in the way of the retry, which removes them. A disk that fills up while exporting is
one line, the previous export kept. Exporting a finished run (`--resume --export`)
changes nothing in the run directory.
"""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, fill, small_disk, snapshot

from jaxformer.files import is_folder_twin
from jaxformer.training.exports import EXPORT_FILES
from train import lm

FLAGS = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--n-kv-head", "1", "--batch-size", "8",
         "--steps", "4", "--warmup", "2", "--eval-size", "4", "--log-every", "2", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two finished copy-task runs of different seeds (so different weights), each
    exported once, in-process."""
    base = tmp_path_factory.mktemp("exports")
    runs = {}
    for seed in (1, 2):
        run_dir, export = base / f"run{seed}", base / f"export{seed}"
        assert lm.main([*FLAGS, "--seed", str(seed), "--run-dir", str(run_dir), "--export", str(export)]) == 0
        runs[seed] = run_dir, export
    return runs


def export_again(run_dir: Path, export: Path, seed: int) -> int:
    """`--resume --export` of a finished run, in-process: its status."""
    return lm.main([*FLAGS, "--seed", str(seed), "--run-dir", str(run_dir), "--resume", "--export", str(export)])


def twins(export: Path) -> list[str]:
    return [p.name for p in export.parent.iterdir() if is_folder_twin(p.name, export.name)]


def test_exporting_a_finished_run_changes_nothing_in_the_run_dir(runs, tmp_path):
    run_dir, export = runs[1]
    before = snapshot(run_dir)
    assert export_again(run_dir, tmp_path / "again", 1) == 0
    assert snapshot(run_dir) == before  # no eval.json rewritten, no session added to about.json
    assert snapshot(tmp_path / "again") == snapshot(export)  # the same export, file for file
    assert twins(tmp_path / "again") == []


def test_an_export_is_swapped_in_whole_with_the_users_permissions(runs, tmp_path):
    """Re-exporting run 2 over run 1's export: the folder is run 2's export, file for
    file (nothing of run 1's left), readable as `open()` and `mkdir` under the umask
    make files and folders."""
    export = tmp_path / "export"
    shutil.copytree(runs[1][1], export)
    assert export_again(runs[2][0], export, 2) == 0
    assert snapshot(export) == snapshot(runs[2][1]) and sorted(os.listdir(export)) == sorted(EXPORT_FILES)
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(export.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE((export / name).stat().st_mode) for name in EXPORT_FILES} == {0o666 & ~umask}


# SIGKILL ends a process: the write runs in one of its own. (`jaxformer/files.py` needs only
# the standard library: loaded alone, without the package's JAX.)
KILLED_WRITE = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("files", sys.argv[2])
files = importlib.util.module_from_spec(spec)
spec.loader.exec_module(files)

def write(folder):  # the new export, half written, then the process is killed
    (folder / "model.safetensors").write_bytes(b"new weights")
    os.kill(os.getpid(), signal.SIGKILL)

files.write_folder_atomically(sys.argv[1], write)
"""


def test_an_export_killed_while_it_writes_leaves_the_old_one_and_the_retry_works(runs, tmp_path):
    run_dir, export = runs[2][0], tmp_path / "export"
    shutil.copytree(runs[1][1], export)
    old = snapshot(export)
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(export), str(REPO / "jaxformer" / "files.py")],
                            cwd=REPO)
    assert killed.returncode == -9
    assert snapshot(export) == old and len(twins(export)) == 1  # the old export whole; the half-written twin beside
    assert export_again(run_dir, export, 2) == 0  # the retry is not refused
    assert snapshot(export) == snapshot(runs[2][1]) and twins(export) == []


def test_an_older_writes_leftover_temporary_file_does_not_block_a_retry(runs, tmp_path):
    """A write cut short inside the folder (`.model.safetensors.XXXX.tmp`, as an atomic
    file write leaves it) is jaxformer's own: the export replaces the folder with it."""
    export = tmp_path / "export"
    shutil.copytree(runs[1][1], export)
    (export / ".model.safetensors.k2j4h1.tmp").write_bytes(b"part of a file")
    assert export_again(runs[1][0], export, 1) == 0
    assert snapshot(export) == snapshot(runs[1][1])


def test_an_export_onto_a_full_disk_is_one_line_and_keeps_the_previous_export(runs, tmp_path, capsys):
    run_dir = runs[2][0]
    with small_disk(tmp_path / "disk", "8m") as disk:
        export = disk / "export"
        shutil.copytree(runs[1][1], export)
        fill(disk)
        old, run = snapshot(export), snapshot(run_dir)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            export_again(run_dir, export, 2)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 1 and len(err) == 1, err
        assert err[0].startswith(f"python -m train.lm: error: cannot write --export {export}: No space left on "
                                 f"device; the trained run is kept in {run_dir}: export it with the same flags and "
                                 f"--resume --run-dir {run_dir} --export {export}"), err
        assert snapshot(export) == old and twins(export) == [] and snapshot(run_dir) == run
