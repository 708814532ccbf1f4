"""`python -m benchmarks.finetune`: its parts on a tiny model (no timing asserted): the two
sides train the same model (their first losses agree), each memory probe runs in a fresh
process and reports what it counts, and the JSON holds every row and ratio."""

import json

import numpy as np
import pytest
from conftest import import_peer

from benchmarks import finetune

TINY = ["--d-model", "128", "--layers", "2", "--vocab", "512", "--batch", "2", "--seq-len", "16", "--steps", "1"]


@pytest.mark.peers
def test_a_tiny_run_writes_every_row_and_ratio(tmp_path, capsys):
    import_peer("peft")
    out = tmp_path / "finetune.json"
    assert finetune.main([*TINY, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["steps"]) == {"jaxformer LoRA", "jaxformer LoRA --remat", "torch + peft LoRA", "jaxformer full",
                                     "torch full"}
    # The same weights and B = 0: both sides' first LoRA losses, and full fine-tuning's, are the base model's.
    first = [row["first_loss"] for row in results["steps"].values()]
    np.testing.assert_allclose(first, first[0], rtol=1e-4)
    assert set(results["memory"]) == set(finetune.MEMORY_CONFIGS)
    for row in results["memory"].values():
        assert 0 < row["training_peak_mb"] <= row["peak_rss_mb"] and row["xla_step_mb"] > 0
    # XLA's account: full fine-tuning's step holds the gradients and two moments of every
    # parameter; LoRA's of the adapters alone.
    memory = results["memory"]
    assert memory["lora"]["xla_step_mb"] < memory["full"]["xla_step_mb"]
    assert "lora_step_speedup_vs_peft" in results["ratios"] and "lora / full training_peak_mb" in results["ratios"]
    assert "first loss" in capsys.readouterr().out


@pytest.mark.peers
def test_lora_only_on_a_given_checkpoint_times_the_lora_rows_alone(tmp_path):
    import_peer("peft")
    path, out = str(tmp_path / "checkpoint"), tmp_path / "finetune.json"
    finetune.make_checkpoint(path, d_model=128, layers=1, vocab=256, seq_len=16)
    assert finetune.main(["--checkpoint", path, "--lora-only", "--batch", "1", "--seq-len", "16", "--steps", "1",
                          "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["steps"]) == {"jaxformer LoRA", "jaxformer LoRA --remat", "torch + peft LoRA"}
    assert results["memory"] == {} and set(results["ratios"]) == {"lora_step_speedup_vs_peft",
                                                                  "lora_remat_step_speedup_vs_peft"}
    first = [row["first_loss"] for row in results["steps"].values()]
    np.testing.assert_allclose(first, first[0], rtol=1e-4)


def test_a_probe_reports_its_peaks_from_a_fresh_process(tmp_path):
    import_peer("transformers")  # (the checkpoint is made by transformers)
    path, ids_file = str(tmp_path / "checkpoint"), str(tmp_path / "ids.npy")
    finetune.make_checkpoint(path, d_model=128, layers=1, vocab=256, seq_len=16)
    np.save(ids_file, finetune.batch_ids(256, 2, 16))
    row = finetune.measure_memory(path, ids_file, "lora --remat")
    assert set(row) == {"peak_rss_mb", "training_peak_mb", "xla_step_mb"} and row["training_peak_mb"] > 0
    with pytest.raises(RuntimeError, match="the 'full' probe failed"):
        finetune.measure_memory(str(tmp_path / "none"), ids_file, "full")
