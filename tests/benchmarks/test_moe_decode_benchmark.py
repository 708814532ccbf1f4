"""`python -m benchmarks.moe_decode` on a tiny random mixture of experts (no timing asserted):
both sides decode the same prompts in processes of their own, jaxformer's rows carry their
ratio to the dense model of the same active size, and each side its peak memory."""

import json

import pytest
from conftest import import_peer

from benchmarks import moe_decode, olmoe_7b

pytestmark = pytest.mark.peers  # transformers writes the checkpoint and is the peer


@pytest.fixture
def checkpoint(tmp_path) -> str:
    transformers, torch = import_peer("transformers"), import_peer("torch")
    config = dict(olmoe_7b.CONFIG, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                  num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=512)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    path = str(tmp_path / "checkpoint")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def test_both_sides_decode_and_report_their_memory(checkpoint, tmp_path, capsys):
    out = tmp_path / "moe.json"
    moe_decode.main([checkpoint, "--batch", "1", "2", "--prompt", "4", "--new", "3", "--reps", "1", "--out", str(out)])
    sides = json.loads(out.read_text())["sides"]
    ours, theirs = sides["jaxformer"], sides["transformers"]
    assert [r["batch"] for r in ours["rows"]] == [r["batch"] for r in theirs["rows"]] == [1, 2]
    assert all(len(r["tokens"]) == r["batch"] and len(r["tokens"][0]) == 3 for r in ours["rows"] + theirs["rows"])
    assert all(r["vs_dense"] > 0 and r["vs_transformers"] > 0 for r in ours["rows"])
    assert all(side["peak_rss"] > side["weights_bytes"] > 0 for side in sides.values())
    assert "the dense model of its active size" in capsys.readouterr().out
