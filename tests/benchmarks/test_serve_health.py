"""`benchmarks.serve_health` end to end on a tiny model: every case runs against the real
server and gets the answer it should (the stop strings a 200, the others a 400), each with
/health polled meanwhile. No timing is asserted."""

import json

from benchmarks import serve_health


def test_each_hostile_case_is_answered_and_health_polled_meanwhile(tmp_path):
    out = tmp_path / "health.json"
    result = serve_health.main(["--rounds", "1", "--polls", "5", "--d-model", "32", "--layers", "1",
                                "--max-seq-len", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    rows = {row["case"]: row for row in result["rows"]}
    assert list(rows) == ["idle", "stop strings", "long prompt", "nested JSON"]
    assert rows["idle"]["polls"] == 5
    assert [rows[case]["statuses"] for case in ("stop strings", "long prompt", "nested JSON")] == [[200], [400], [400]]
    assert all(row["polls"] >= 1 and row["health_ms"]["max"] >= row["health_ms"]["p50"] > 0 for row in rows.values())
