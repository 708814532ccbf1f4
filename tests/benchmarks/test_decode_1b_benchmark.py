"""`python -m benchmarks.decode_1b` on a tiny random checkpoint (no timing asserted): with
transformers, both sides decode the same prompts and float32's greedy tokens agree; with
`--no-peer` (an accelerator run) jaxformer's rows alone, bfloat16 against float32."""

import json

import pytest
from conftest import import_peer

from benchmarks import decode_1b, finetune

ARGS = ["--batch", "1", "2", "--prompt", "4", "--new", "3", "--reps", "1"]


pytestmark = pytest.mark.peers  # transformers writes the checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> str:
    import_peer("transformers")
    path = str(tmp_path / "checkpoint")
    finetune.make_checkpoint(path, d_model=128, layers=1, vocab=512, seq_len=64)  # the prompts' ids are below 400
    return path


def test_no_peer_times_jaxformer_alone_against_its_float32(checkpoint, tmp_path, capsys):
    out = tmp_path / "decode.json"
    decode_1b.main([checkpoint, *ARGS, "--no-peer", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["dtype"], r["batch"]) for r in rows] == [
        ("jaxformer", dtype, batch) for dtype in ("float32", "bfloat16") for batch in (1, 2)]
    assert all(len(r["tokens"]) == r["batch"] and len(r["tokens"][0]) == 3 for r in rows)
    assert [r["vs_float32"] for r in rows[:2]] == [1.0, 1.0] and all(r["vs_float32"] > 0 for r in rows[2:])
    assert "x float32" in capsys.readouterr().out and not any("vs_transformers" in r for r in rows)


def test_against_transformers_the_float32_tokens_agree(checkpoint, tmp_path):
    out = tmp_path / "decode.json"
    decode_1b.main([checkpoint, *ARGS, "--dtypes", "float32", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["batch"]) for r in rows] == [("jaxformer", 1), ("jaxformer", 2), ("transformers", 1),
                                                       ("transformers", 2)]
    assert all(r["same_tokens"] and r["vs_transformers"] > 0 for r in rows)
