"""`python -m benchmarks.moe_flops` on one layer: XLA's count of a few tokens' forward is the
active parameters' multiply-adds (and attention's few), far below every expert's."""

import json

from benchmarks import moe_flops


def test_the_count_follows_the_active_parameters(tmp_path, capsys):
    out = tmp_path / "flops.json"
    moe_flops.main(["--layers", "1", "--tokens", "1", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 3]
    # (attention over a few positions and the norms add little; every expert would be 2.8x here)
    assert all(1.0 <= r["ratio"] < 1.05 and r["every_expert_ratio"] > 2.5 for r in rows)
    assert "2 x active parameters" in capsys.readouterr().out
