"""`python -m benchmarks.train_step` runs both demos' real setups and writes its JSON (no timing asserted)."""

import json

import pytest

from benchmarks import train_step


def test_times_both_demos(tmp_path, capsys):
    out = tmp_path / "train_step.json"
    assert train_step.main(["--steps", "1", "--out", str(out)]) == 0  # one timed update after the first
    results = json.loads(out.read_text())
    rows = results["rows"]
    assert [(r["demo"], r["variant"]) for r in rows] == [("reverse", "jaxformer"), ("copy", "jaxformer")]
    assert all({"step_ms", "spread", "tokens_per_s", "first_step_s", "gflop", "gflops", "peak_fraction"} <= set(r)
               for r in rows)
    # Without --reference the peak is jnp's alone, and every row's rate is measured against it.
    peak = results["matmul_peak"]
    assert peak["size"] == train_step.PEAK_SIZE and set(peak) == {"size", "jax_gflops"} and peak["jax_gflops"] > 0
    for r in rows:
        assert r["gflops"] > 0 and r["peak_fraction"] == pytest.approx(r["gflops"] / peak["jax_gflops"])
        assert r["gflops"] == pytest.approx(r["gflop"] * 1e3 / r["step_ms"])  # the count over the median step
    # XLA's count of each update: the copy task's forward and backward passes alone are
    # 6 x its 0.79 M matrix parameters x 64 x 65 tokens (~19.6 GFLOP less the attention's
    # causal savings, none here), the reverse task's far less.
    copy, reverse = rows[1]["gflop"], rows[0]["gflop"]
    assert 15 < copy < 25 and 0.3 < reverse < 2
    printed = capsys.readouterr().out
    assert "reference demo wall time" in printed and "GFLOP/s" in printed and "matmul peak" in printed
