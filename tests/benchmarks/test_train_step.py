"""`python -m benchmarks.train_step` runs both demos' real setups and writes its JSON (no timing asserted)."""

import json

from benchmarks import train_step


def test_times_both_demos(tmp_path, capsys):
    out = tmp_path / "train_step.json"
    assert train_step.main(["--steps", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["demo"], r["variant"]) for r in rows] == [("reverse", "jaxformer"), ("copy", "jaxformer")]
    assert all({"step_ms", "spread", "tokens_per_s", "first_step_s"} <= set(r) for r in rows)
    assert "reference demo wall time" in capsys.readouterr().out
