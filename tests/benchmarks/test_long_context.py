"""`python -m benchmarks.long_context` compiles both steps at each length, runs those up to
`--time-up-to`, and writes its JSON (no timing asserted)."""

import json

from benchmarks import long_context


def test_a_short_run_writes_every_length_and_times_the_short_ones(tmp_path, capsys):
    out = tmp_path / "long_context.json"
    long_context.main(["--lengths", "256", "1024", "--time-up-to", "256", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["backend"] == "cpu" and [r["T"] for r in results["rows"]] == [256, 1024]
    short, long = results["rows"]
    assert short["dense_seconds"] > 0 and short["blocks_seconds"] > 0 and "dense_seconds" not in long
    # At 1024 x 1024 scores the dense step's temporaries are several times the blocks' (its [8, T, T] scores).
    assert long["dense_temp_bytes"] > 1.5 * long["blocks_temp_bytes"] > 0
    printed = capsys.readouterr().out
    assert "dense/blocks" in printed and "time blocks/dense" in printed
