"""`jaxformer-finetune --method dpo`: a LoRA run's held-out loss and reward metrics against TRL's
DPOTrainer with peft on its adapters (the peers extra), on a tiny checkpoint made here."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import import_peer, run_main, torch_peer, trl_dpo_metrics, trl_dpo_trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import save_random_checkpoint  # noqa: E402

from jaxformer.commands import finetune  # noqa: E402
from jaxformer.dpo import METRICS  # noqa: E402
from jaxformer.text.dataset import HELD_OUT  # noqa: E402

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
