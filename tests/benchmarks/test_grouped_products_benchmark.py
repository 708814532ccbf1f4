"""`python -m benchmarks.grouped_products` small (no timing asserted): each way of the grouped
product timed against the dense product of the same rows, for each number of tokens."""

import json

from benchmarks import grouped_products


def test_each_way_is_timed_against_the_dense_product(tmp_path, capsys):
    out = tmp_path / "grouped.json"
    grouped_products.main(["--d-model", "32", "--width", "16", "--experts", "4", "--top-k", "2", "--tokens", "1",
                           "16", "--reps", "1", "--dtype", "float32", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 16]
    assert all(set(r["vs_dense"]) == {"in_blocks", "ragged"} and min(r["seconds"].values()) > 0 for r in rows)
    assert "vs one dense product" in capsys.readouterr().out
