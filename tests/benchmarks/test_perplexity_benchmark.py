"""`python -m benchmarks.perplexity` on a tiny random checkpoint (no timing asserted): both
sides score the same text, their float32 NLLs agree, and the JSON holds every row."""

import json

import pytest
from conftest import import_peer

from benchmarks import finetune, perplexity


@pytest.mark.peers
def test_a_tiny_run_scores_the_same_text_on_both_sides(tmp_path, capsys):
    import_peer("transformers")
    path, out = str(tmp_path / "checkpoint"), tmp_path / "perplexity.json"
    finetune.make_checkpoint(path, d_model=128, layers=1, vocab=256, seq_len=64)
    perplexity.main([path, "--tokens", "100", "--window", "32", "--stride", "12", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["dtype"]) for r in rows] == [("jaxformer", "float32"), ("transformers", "float32"),
                                                       ("jaxformer", "bfloat16"), ("transformers", "bfloat16")]
    assert abs(rows[0]["nll"] - rows[1]["nll"]) <= 1e-4 * rows[1]["nll"]  # (the benchmark refuses to go on otherwise)
    assert abs(rows[2]["nll"] - rows[3]["nll"]) <= 2e-2 * rows[3]["nll"]  # bf16 weights and activations on both sides
    assert all(r["ids_per_s"] > 0 for r in rows) and rows[0]["vs_transformers"] > 0
    assert "x transformers" in capsys.readouterr().out
