"""`python -m train.lm`: both tasks end to end, and bad flags or data (tiny settings)."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxformer.training import read_metrics
from train import lm

TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--n-kv-head", "1", "--batch-size", "8",
        "--log-every", "5", "--checkpoint-every", "5", "--warmup", "2"]


def test_copy_task_end_to_end(tmp_path):
    run_dir = tmp_path / "copy"
    done = subprocess.run([sys.executable, "-m", "train.lm", "--steps", "10", "--eval-size", "20",
                           "--run-dir", str(run_dir), *TINY], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for expected in ("params", "chance loss", "KV-cached greedy decoding on 20 unseen patterns", "exact match"):
        assert expected in done.stdout
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [5, 10]
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["steps"] == 10 and 0.0 <= results["exact_match"] <= 1.0


def test_text_task_samples_a_continuation(tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    run_dir = tmp_path / "text"
    assert lm.main(["--task", "text", "--data", str(data), "--steps", "6", "--seq-len", "16",
                    "--sample-tokens", "30", "--prompt", "the ", "--top-p", "0.9", "--run-dir", str(run_dir),
                    *TINY]) == 0
    out = capsys.readouterr().out
    assert "validation loss" in out
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["sample"].startswith("the ") and len(results["sample"]) == 4 + 30
    assert set(results["sample"]) <= set("the quick brown fox jumps over the lazy dog. ")


def test_resume_continues_the_same_loss_curve(tmp_path, capsys):
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "15", "--eval-size", "4", *TINY]
    assert lm.main(["--run-dir", str(straight), *common]) == 0
    assert lm.main(["--run-dir", str(interrupted), *common]) == 0
    # A crash after step 10's checkpoint: the last checkpoint never landed.
    shutil.rmtree(interrupted / "checkpoints" / "15")
    assert lm.main(["--run-dir", str(interrupted), "--resume", *common]) == 0
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [5, 10, 15]
    np.testing.assert_array_equal([m["loss"] for m in a], [m["loss"] for m in b])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a different recipe is refused
        lm.main(["--run-dir", str(interrupted), "--resume", *common, "--lr", "1e-3"])
    assert "holds a different config" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--task", "text"], "--task text needs --data"),
    (["--task", "text", "--data", "/nonexistent/file.txt"], "cannot read --data"),
    (["--n-head", "3"], "DecoderConfig.d_model: must be divisible by n_head=3"),
    (["--warmup", "900"], "--warmup (900) must not exceed --steps (800)"),
    (["--task", "poem"], "invalid choice"),
])
def test_bad_flags_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("content, message", [(b"", "too few"), (b"abc" * 5, "too few"), (b"\xff\xfe\x00bad", "cannot read")])
def test_bad_data_files(tmp_path, capsys, content, message):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    with pytest.raises(SystemExit):
        lm.main(["--task", "text", "--data", str(data), "--seq-len", "16", "--run-dir", str(tmp_path / "r"), *TINY])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
