"""`python -m benchmarks.deltanet_length` measures the chunked rule and the layer at each length and
writes its JSON (no timing asserted)."""

import json

from benchmarks import deltanet_length


def test_a_short_run_measures_each_program_at_each_length(tmp_path, capsys):
    out = tmp_path / "deltanet_length.json"
    deltanet_length.main(["--lengths", "128", "256", "--time-heads", "2", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [row["T"] for row in rows] == [128, 256]
    programs = ("rule_forward", "rule_backward", "layer_forward", "layer_backward")
    assert all(row[program]["temp"] > 0 for row in rows for program in programs)
    assert all(row[program]["seconds"] > 0 for row in rows for program in programs[:2])
    assert rows[1]["rule_forward"]["temp"] > rows[0]["rule_forward"]["temp"]
    assert "rule_backward cpu_seconds" in capsys.readouterr().out
