"""`python -m train.reverse`: end to end, resume, and bad flags (tiny settings)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxformer.training import read_metrics
from train import reverse

TINY = ["--n-layer", "1", "--d-model", "32", "--d-ff", "32", "--n-head", "2", "--batch-size", "16",
        "--eval-size", "20", "--log-every", "5", "--checkpoint-every", "5"]


def test_end_to_end_smoke(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "train.reverse", "--steps", "10", "--run-dir", str(run_dir), *TINY],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for expected in ("params:", "shape trace", "cross-attention weights", "NOT square", "exact match",
                     "generalisation probe", "<- source (encoder)", "decoder step"):
        assert expected in out
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [5, 10]
    assert (run_dir / "cross_attention.png").stat().st_size > 1000
    assert (run_dir / "checkpoints" / "10").is_dir()
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["steps"] == 10 and 0.0 <= results["exact_match"] <= 1.0


def test_resume_continues_the_same_loss_curve(tmp_path, capsys):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert reverse.main(["--steps", "15", "--run-dir", str(straight), *TINY]) == 0
    assert reverse.main(["--steps", "10", "--run-dir", str(interrupted), *TINY]) == 0
    assert reverse.main(["--steps", "15", "--run-dir", str(interrupted), "--resume", *TINY]) == 0
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [5, 10, 15]
    np.testing.assert_array_equal([m["loss"] for m in a], [m["loss"] for m in b])
    ra, rb = (json.loads((d / "eval.json").read_text()) for d in (straight, interrupted))
    assert ra["exact_match"] == rb["exact_match"] and ra["final_loss"] == rb["final_loss"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-5"], "--steps must be >= 1"),
    (["--d-model", "30", "--n-head", "4"], "VanillaConfig.d_model: must be divisible by n_head=4"),
    (["--label-smoothing", "1.5"], "--label-smoothing must be in [0, 1)"),
    (["--resume"], "--resume needs --run-dir"),
    (["--steps", "many"], "invalid int value"),
])
def test_bad_flags_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reverse.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_resume_with_a_different_config_or_into_a_used_dir(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert reverse.main(["--steps", "5", "--run-dir", str(run_dir), *TINY]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        reverse.main(["--steps", "10", "--run-dir", str(run_dir), "--resume", *TINY, "--d-model", "64"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a different config" in err and "model" in err, err
    with pytest.raises(SystemExit):
        reverse.main(["--steps", "10", "--run-dir", str(run_dir), *TINY])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err, err


def test_bfloat16_training_lowers_the_loss(tmp_path):
    run_dir = tmp_path / "bf16"
    assert reverse.main([*TINY, "--steps", "150", "--log-every", "50", "--checkpoint-every", "150", "--warmup", "50",
                         "--dtype", "bfloat16", "--run-dir", str(run_dir)]) == 0
    losses = [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]
    # Measured: 2.83 -> 2.64 in bf16, 2.81 -> 2.58 in float32 (the full demo in bf16: 100% exact).
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1
