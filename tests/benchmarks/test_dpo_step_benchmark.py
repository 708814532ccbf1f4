"""`python -m benchmarks.dpo_step` on a tiny random checkpoint (no timing asserted): every row of the
preference file it writes fills the window; jaxformer's LoRA DPO step and TRL's DPOTrainer + peft,
each in a process of its own, start at exactly ln 2 and score the same tokens alike; the SFT row
has as many rows; the lines are printed and the JSON holds every row and ratio."""

import json

import numpy as np
import pytest
from conftest import import_peer

from benchmarks import dpo_step, finetune, llama_1b
from jaxformer.text import load_tokenizer
from jaxformer.text.dataset import IGNORE
from jaxformer.text.preference import PreferenceData

pytestmark = pytest.mark.peers  # transformers writes the checkpoint; TRL and peft are the peer

SEQ_LEN = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama-shaped checkpoint (2 layers of 128, 512 ids) with a byte-level BPE tokenizer."""
    import_peer("transformers")
    torch = import_peer("torch")
    path = str(tmp_path_factory.mktemp("dpo") / "checkpoint")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        finetune.make_checkpoint(path, d_model=128, layers=2, vocab=512, seq_len=64)
    llama_1b.write_tokenizer(path, llama_1b.tokenizer())  # (ids below 400: inside the 512)
    return path


def test_every_row_of_the_pairs_fills_the_window(checkpoint, tmp_path):
    path = dpo_step.pairs_file(str(tmp_path), checkpoint, pairs=3, seq_len=SEQ_LEN)
    tokenizer = load_tokenizer(checkpoint)
    data = PreferenceData(path, tokenizer, SEQ_LEN)
    assert data.cut == 4 and data.dropped == 0  # the pair 4 times, each cut to the window
    record = json.loads(open(path).readline())
    prompt = len(tokenizer.encode(record["prompt"]))
    # Past the prompt's last id every target is an answer's token: no padding in any row.
    scored = np.concatenate([data.train["targets"], data.val["targets"]]) != IGNORE  # [4, 2, SEQ_LEN]
    assert scored[..., prompt - 1:].all() and not scored[..., :prompt - 1].any()


def test_a_tiny_run_prints_and_saves_each_row_both_sides_at_ln_2(checkpoint, tmp_path, capsys):
    import_peer("peft")
    import_peer("trl")
    out = tmp_path / "dpo.json"
    dpo_step.main([checkpoint, "--seq-len", str(SEQ_LEN), "--steps", "2", "--out", str(out)])
    results = json.loads(out.read_text())
    assert set(results) == {"hardware", "settings", "jaxformer", "trl", "sft", "ratios"}
    ours, trl, sft = results["jaxformer"], results["trl"], results["sft"]
    # B = 0: each side's policy is its reference, both rewards 0, the loss ln 2 exactly (float32).
    assert ours["first"]["loss"] == trl["first"]["loss"] == dpo_step.LN2
    # The same model scoring the same answer tokens: their sums agree within float32's rounding.
    for name in ("logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(ours["first"][name], trl["first"][name], rtol=1e-5, err_msg=name)
    assert ours["rows"] == trl["rows"] == sft["rows"] == 4  # 2 pairs; SFT's batch of 4 rows
    for row in (ours, trl, sft):
        assert len(row["times_s"]) == 2 and row["step_s"] > 0 and row["peak_rss"] > 0
    for row in (ours, sft):
        assert row["peak_rss"] >= row["steps_peak_rss"] > 0
    assert set(results["ratios"]) == {"speed_vs_trl", "chosen_logps_relative_difference", "dpo_over_sft_peak_rss",
                                      "dpo_over_sft_steps_peak_rss"}
    printed = capsys.readouterr().out
    assert "jaxformer DPO (4 rows): step " in printed and "TRL DPOTrainer + peft (4 rows): step " in printed
    assert "jaxformer SFT (4 rows): step " in printed and " cores; jax " in printed
    assert "first step's loss: jaxformer 0.693147, TRL 0.693147 (ln 2 = 0.693147)" in printed
    assert "x TRL's speed" in printed and "DPO / SFT peak RSS: " in printed
