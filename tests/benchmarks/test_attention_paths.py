"""`python -m benchmarks.attention_paths` times every path, forward and gradient, at each length,
and writes its JSON (no timing asserted)."""

import json

from benchmarks import attention_paths


def test_a_short_run_times_every_path_at_every_length(tmp_path, capsys):
    out = tmp_path / "attention_paths.json"
    attention_paths.main(["--lengths", "64", "128", "--repeats", "1", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["backend"] == "cpu" and results["dtype"] == "float32"
    assert [(r["T"], r["path"]) for r in results["rows"]] == [
        (T, path) for T in (64, 128) for path in ("dense", "jnp blocks", "in_blocks")]
    assert all(r["forward_seconds"] > 0 and r["gradient_seconds"] > 0 for r in results["rows"])
    assert "fwd+bwd ms" in capsys.readouterr().out
