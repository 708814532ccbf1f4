"""`python -m benchmarks.decode` at a tiny config: it runs, every variant decodes the same
greedy tokens, and the JSON and plots are written as documented. No timing is asserted."""

import importlib.util
import json

from benchmarks import decode

TINY = ["--vocab-size", "64", "--d-model", "32", "--n-layer", "1", "--n-head", "2", "--n-kv-head", "1", "--d-ff", "64",
        "--batch", "1", "2", "--prompt", "4", "--new", "6", "--reps", "1", "--uncached-steps", "2",
        "--contexts", "8", "16", "--capacities", "300", "--capacity-context", "8", "--spec-k"]
SPECULATIVE_FIELDS = {"workload", "batch", "variant", "k", "acceptance", "tokens_per_pass", "tokens_per_row_round",
                      "tokens_per_s", "vs_greedy", "same_tokens"}
ROW_FIELDS = {"variant", "batch", "prefill_ms", "step_ms", "tokens_per_s", "compile_s", "peak_memory_mb",
              "floor_step_ms", "floor_pct", "same_tokens"}


def test_every_variant_decodes_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "decode.json"
    decode.main([*TINY, "--out", str(out), "--plot", str(tmp_path / "plots")])
    result = json.loads(out.read_text())
    assert set(result) == {"config", "machine", "settings", "variants", "scaling", "capacity", "speculative"}
    assert result["speculative"] == []  # (--spec-k without values: none; test_speculative_rows)
    assert result["machine"]["bandwidth_gb_s"] > 0
    peers = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None
    variants = {"jaxformer loop", "jaxformer scanned", "jaxformer stream", "jaxformer no cache"} | (
        {"HF generate"} if peers else set())
    assert {(r["variant"], r["batch"]) for r in result["variants"]} == {(v, b) for v in variants for b in (1, 2)}
    for row in result["variants"]:
        assert ROW_FIELDS <= set(row)
        assert row["same_tokens"], row["variant"]  # greedy tokens equal to the one-jit loop's
        assert {"median", "spread"} <= set(row["step_ms"]) and {"median", "spread"} <= set(row["tokens_per_s"])
        assert ("vs_hf" in row) == peers
    assert [r["context"] for r in result["scaling"]] == [8, 16]
    assert all({"cached_ms", "uncached_ms", "speedup"} <= set(r) for r in result["scaling"])
    # A cache of 300 holding 8 tokens: read whole, and at the span of 256 that holds them.
    assert [(r["capacity"], r["context"], r["span"]) for r in result["capacity"]] == [(300, 8, 256)]
    assert all(r["whole_ms"] > 0 and r["span_ms"] > 0 and r["speedup"] > 0 for r in result["capacity"])
    assert (tmp_path / "plots" / "tokens_per_s.png").exists() and (tmp_path / "plots" / "context_scaling.png").exists()
    printed = capsys.readouterr().out
    assert "new tok/s" in printed and ("HF generate: skipped" in printed) == (not peers)


def test_without_hf_says_so(tmp_path, capsys):
    # (One context of TINY's kept: the model's max_seq_len, and so its programs, are the other runs'.)
    decode.main([*TINY, "--batch", "1", "--contexts", "16", "--no-hf", "--out", str(tmp_path / "d.json")])
    assert "HF generate: skipped (--no-hf)" in capsys.readouterr().out


def test_speculative_rows(tmp_path, capsys):
    """`--speculative-only`: plain greedy and each proposer on the three workloads (the
    copy models trained for 2 updates), every row with plain greedy's tokens."""
    out = tmp_path / "spec.json"
    decode.main([*TINY, "--batch", "1", "--speculative-only", "--spec-k", "2", "--copy-steps", "2",
                 "--copy-model", "1", "32", "--draft-steps", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["variants"] == [] and result["scaling"] == [] and result["capacity"] == []
    assert [(r["workload"], r["variant"]) for r in result["speculative"]] == [
        (w, v) for w in ("random weights", "copy 1x32") for v in ("plain greedy", "lookup k=2", "draft k=2")] + [
        ("copy 2x128", v) for v in ("plain greedy", "lookup k=2")]
    for row in result["speculative"]:
        assert SPECULATIVE_FIELDS <= set(row) and row["batch"] == 1
        assert row["same_tokens"] and row["tokens_per_pass"] >= 1.0, row
        assert (row["acceptance"] is None) == (row["variant"] == "plain greedy") == (row["k"] == 0)
    assert "vs greedy" in capsys.readouterr().out
