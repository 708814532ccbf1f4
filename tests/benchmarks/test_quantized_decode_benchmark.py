"""`python -m benchmarks.quantized_decode` on a tiny random checkpoint (no timing asserted): each kind of
weights decodes in a process of its own, reports its rows, its stored bytes (int8 a quarter of
float32's matrices, int4 and NF4 about an eighth) and its peak memory; transformers' rows beside."""

import json

import pytest
from conftest import import_peer

from benchmarks import finetune, quantized_decode

pytestmark = pytest.mark.peers  # transformers writes the checkpoint


def test_each_kind_of_weights_decodes_in_its_own_process(tmp_path, capsys):
    import_peer("transformers")
    torch = import_peer("torch")
    path = str(tmp_path / "checkpoint")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        finetune.make_checkpoint(path, d_model=128, layers=1, vocab=512, seq_len=64)
    out = tmp_path / "q.json"
    quantized_decode.main([path, "--batch", "1", "2", "--prompt", "4", "--new", "3", "--reps", "1", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [(r["impl"], r["weights"]) for r in results] == [
        ("jaxformer", w) for w in ("float32", "bfloat16", "int8", "int4", "nf4")] + [
        ("transformers", "float32"), ("transformers", "bfloat16")]
    assert all("failed" not in r and [row["batch"] for row in r["rows"]] == [1, 2] for r in results)
    assert all(len(row["tokens"]) == row["batch"] and len(row["tokens"][0]) == 3 for r in results for row in r["rows"])
    size = {r["weights"]: r["weight_bytes"] for r in results if r["impl"] == "jaxformer"}
    assert size["bfloat16"] * 2 == size["float32"] and size["int8"] < size["float32"] and size["int4"] < size["int8"]
    assert size["nf4"] == size["int4"]  # (both: 4-bit values and a float32 scale per 64)
    printed = capsys.readouterr().out
    for said in ("x jaxformer float32", "x transformers' best", "RSS / (weights + cache)"):
        assert said in printed


def test_float_weights_larger_than_the_memory_are_not_run_and_bfloat16_is_the_baseline(tmp_path, monkeypatch):
    import argparse

    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((1000,), np.float32)}, str(tmp_path / "model.safetensors"))
    assert quantized_decode.parameter_count(str(tmp_path)) == 1000
    monkeypatch.setattr(quantized_decode, "memory_total", lambda: 3000)  # bf16's 2,000 bytes fit, float32's 4,000 not
    args = argparse.Namespace(checkpoint=str(tmp_path))
    row = quantized_decode.in_a_process(args, "jaxformer", "float32")
    assert row["failed"] == ["not run: its float32 weights, 0.0 GB, exceed this machine's memory, 0.0 GiB"]
    ran = [{"impl": "jaxformer", "weights": w, "weight_bytes": 1 << 20, "peak_rss": 1 << 21,
            "rows": [{"batch": 1, "tokens_per_s": t}]} for w, t in (("bfloat16", 2.0), ("int8", 5.0))]
    lines = quantized_decode.report([row, *ran])
    assert lines[0].split() == ["jaxformer", "float32", "not", "run:", "its", "float32", "weights,", "0.0", "GB,",
                                "exceed", "this", "machine's", "memory,", "0.0", "GiB"]
    assert lines[2].endswith("2.50x jaxformer bfloat16")
