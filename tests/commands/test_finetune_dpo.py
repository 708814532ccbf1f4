"""`jaxformer-finetune --method dpo` end to end on a tiny checkpoint made here: the first step's
loss is exactly ln 2, the held-out pairs come to be ranked right, the reference with every
parameter trained, resume, the report page and the refusals; a LoRA run's held-out metrics against TRL's
DPOTrainer with peft (the peers extra). (The loss and rewards against TRL's on two checkpoints:
tests/test_dpo.py.)"""

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import import_peer, run_main, torch_peer, trl_dpo_metrics, trl_dpo_trainer
from report_page import check_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import save_random_checkpoint  # noqa: E402

from jaxformer.commands import finetune  # noqa: E402
from jaxformer.dpo import METRICS  # noqa: E402
from jaxformer.text.dataset import HELD_OUT  # noqa: E402
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


SEQ_LEN = 32
ANIMALS = ["cat", "dog", "bird", "fish", "mouse", "horse"]
# 30 pairs, one preference throughout; the last (held out) answered past --seq-len, so cut.
PAIRS = [{"prompt": f"Where did the {animal} sit? ", "chosen": "On the mat.", "rejected": "On the log."}
         for animal in ANIMALS] * 5
PAIRS[-1] = {"prompt": "Where did the cat sit? ", "chosen": "On the mat.",
             "rejected": "On the log, and the dog sat on the mat; 注意力就是你所需要的一切。"}


@pytest.mark.peers
def test_a_lora_runs_held_out_metrics_are_trls_with_peft_its_reference_the_base(tmp_path):
    """A LoRA run of 8 steps, then TRL's DPOTrainer over the held-out pairs (the file's last 10 %:
    3, in jaxformer's batches of 2, the last filled with a pair that weighs nothing) with peft's
    adapters made from the run's adapter_config.json and loaded from its files: TRL's reference is
    then the base with the adapters off (`peft_config`, no `ref_model`), as jaxformer's is. (A
    `PeftModel` handed to TRL would instead be its own reference: TRL copies its adapters into a
    frozen "ref" adapter.) TRL's loss and metrics of one batch of the 3 pairs, its `max_length` the
    window's `seq_len + 1` ids, equal eval.json's after training within float32's error, as in
    tests/test_dpo.py (rtol 1e-5 on log-probabilities summed over up to 33 tokens, atol 1e-5)."""
    torch = torch_peer()
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    import_peer("trl")  # (before the run: a skip, not a run for nothing)
    checkpoint, data, run_dir = tmp_path / "checkpoint", tmp_path / "pairs.jsonl", tmp_path / "run"
    save_random_checkpoint(checkpoint)
    data.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(data), "--method", "dpo",
                                    "--steps", "8", "--lr", "1e-2", "--warmup", "2", "--batch-size", "2",
                                    "--seq-len", str(SEQ_LEN), "--lora-rank", "4", "--log-every", "4",
                                    "--checkpoint-every", "8", "--run-dir", str(run_dir)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    held_out = PAIRS[-max(1, round(HELD_OUT * len(PAIRS))):]
    assert f"{len(PAIRS) - len(held_out)} pairs to train on, {len(held_out)} held out (1 cut" in done.stdout
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["eval_loss_before"] == np.float32(np.log(2.0))  # the policy was the reference
    assert results["eval_loss"] < results["eval_loss_before"] - 0.1  # the adapters learned the preference

    base = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    adapter = run_dir / finetune.ADAPTER_DIR
    trainer = trl_dpo_trainer(tmp_path / "trl", base, transformers.AutoTokenizer.from_pretrained(str(checkpoint)),
                              held_out, peft_config=peft.PeftConfig.from_pretrained(str(adapter)),
                              max_length=SEQ_LEN + 1)
    loaded = trainer.model.load_adapter(str(adapter), adapter_name="default")
    assert not loaded.missing_keys and not loaded.unexpected_keys
    assert list(trainer.model.peft_config) == ["default"]  # no "ref" adapter: the reference is the base
    loss, metrics = trl_dpo_metrics(trainer, trainer.train_dataset)
    np.testing.assert_allclose(loss, results["eval_loss"], rtol=1e-5, atol=1e-5)
    for name in METRICS:
        np.testing.assert_allclose(metrics[name], results[f"eval_{name}"], rtol=1e-5, atol=1e-5, err_msg=name)
