"""`jaxformer-finetune --method dpo` end to end on a tiny checkpoint made here: the first step's
loss is exactly ln 2, the held-out pairs come to be ranked right, the reference with every
parameter trained, resume, the report page and the refusals. (The loss and rewards against
TRL's DPOTrainer: tests/test_dpo.py.)"""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_main
from report_page import check_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import save_random_checkpoint  # noqa: E402

from jaxformer.commands import finetune  # noqa: E402
from jaxformer.dpo import METRICS  # noqa: E402
from jaxformer.training import read_metrics  # noqa: E402

FAST = ["--method", "dpo", "--warmup", "2", "--batch-size", "4", "--seq-len", "24", "--lora-rank", "4"]
LN2 = float(np.float32(math.log(2)))  # the loss while the policy is the reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dpo") / "checkpoint"
    save_random_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """A preference a tiny model can learn: whatever sat, it sat on the mat, not on what it is
    (the held-out pairs' animals are the training pairs', in new prompts)."""
    rng = np.random.default_rng(0)
    words = ["cat", "dog", "sun", "sky", "log", "keys", "values", "token"]
    records = []
    for _ in range(60):
        subject, other = rng.choice(words, 2, replace=False)
        records.append({"prompt": f"The {subject} sat on the", "chosen": " mat.", "rejected": f" {other}."})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def lora_run(checkpoint, pairs, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(pairs), "--steps", "24",
                                    "--lr", "1e-2", "--log-every", "1", "--checkpoint-every", "12",
                                    "--run-dir", str(run_dir), *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, done


def test_lora_dpo_starts_at_ln_2_and_ranks_the_held_out_pairs_right(lora_run):
    run_dir, done = lora_run
    metrics = read_metrics(run_dir / "metrics.jsonl")
    # Step 1: the adapters' B is zero, so the policy is the reference: every reward 0, the loss ln 2.
    assert metrics[0]["step"] == 1 and metrics[0]["loss"] == LN2
    assert all(metrics[0][name] == 0 for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"))
    assert set(METRICS) <= metrics[-1].keys()
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["eval_loss_before"] == LN2 and results["eval_rewards/accuracies_before"] == 0.0  # all ties
    # After: the held-out chosen answers' reward above the rejected ones' for every pair (6 held out).
    assert results["eval_rewards/accuracies"] == 1.0 and results["eval_loss"] < 0.5 * LN2
    assert results["eval_rewards/margins"] > 0 and results["eval_rewards/chosen"] > results["eval_rewards/rejected"]
    assert "held-out after:" in done.stdout and (run_dir / "adapter" / "adapter_config.json").exists()
    check_report(run_dir)  # every logged value (the rewards too) shown, each result with its label
    assert "DPO: mean margin, chosen reward - rejected reward" in (run_dir / "report.html").read_text()  # charted


def test_full_dpo_reads_the_reference_from_a_table_and_starts_at_ln_2(checkpoint, pairs, tmp_path):
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(pairs), "--steps", "6", "--full",
                                    "--lr", "1e-3", "--log-every", "1", "--checkpoint-every", "6",
                                    "--run-dir", str(tmp_path / "run"), *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "training every parameter" in done.stdout
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert metrics[0]["loss"] == LN2 and metrics[-1]["loss"] < LN2
    results = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert results["eval_loss_before"] == LN2 and results["eval_loss"] < LN2


def test_a_resumed_dpo_run_gives_the_uninterrupted_runs_adapters_bit_for_bit(checkpoint, pairs, tmp_path):
    common = ["--checkpoint", str(checkpoint), "--data", str(pairs), "--steps", "8", "--lora-dropout", "0.1",
              "--log-every", "2", "--checkpoint-every", "4", "--beta", "0.3", *FAST]
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    assert run_main(finetune.main, [*common, "--run-dir", str(straight)]).returncode == 0
    shutil.copytree(straight, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "8")  # a crash after step 4's checkpoint
    shutil.rmtree(interrupted / "adapter")
    done = run_main(finetune.main, [*common, "--run-dir", str(interrupted), "--resume"])
    assert done.returncode == 0 and "resuming at step 4 of 8" in done.stdout
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (straight / "adapter" / name).read_bytes() == (interrupted / "adapter" / name).read_bytes()
    a, b = (read_metrics(d / "metrics.jsonl") for d in (straight, interrupted))
    assert a == [dict(m, steps_per_sec=n["steps_per_sec"]) for m, n in zip(b, a)]  # every value but the speed
    # --beta is part of the recipe: resuming with another is refused.
    other = [*common[:-len(FAST) - 2], "--beta", "0.2", *FAST, "--run-dir", str(interrupted), "--resume"]
    refused = run_main(finetune.main, other)
    assert refused.returncode == 2 and "beta" in refused.stderr


@pytest.mark.parametrize("extra, message", [
    (["--method", "sft", "--beta", "0.1"], "--beta must be given only with --method dpo"),
    (["--beta", "0"], "--beta must be"),
    (["--method", "ppo"], "--method"),
])
def test_bad_flags_are_refused_in_one_line(checkpoint, pairs, tmp_path, extra, message):
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(pairs), "--steps", "4",
                                    "--run-dir", str(tmp_path / "run"), *FAST, *extra])
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_data_that_is_not_pairs_is_refused_naming_the_file_and_line(checkpoint, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(chat), "--steps", "4",
                                    "--run-dir", str(tmp_path / "run"), *FAST])
    assert done.returncode == 2 and f"{chat}:1: a preference record is" in done.stderr, done.stderr
    assert "it has no 'chosen'" in done.stderr and not (tmp_path / "run").exists()
