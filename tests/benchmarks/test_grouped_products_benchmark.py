"""`python -m benchmarks.grouped_products` small (no timing asserted): each way of the grouped
product timed against the dense product of the same rows, for each number of tokens, and the
rates at which the experts' product and the dense one of the active size read their weights."""

import json

from benchmarks import grouped_products


def test_each_way_is_timed_against_the_dense_product(tmp_path, capsys):
    out = tmp_path / "grouped.json"
    grouped_products.main(["--d-model", "32", "--width", "16", "--experts", "4", "--top-k", "2", "--tokens", "1",
                           "16", "--reps", "1", "--dtype", "float32", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 16]
    assert all(set(r["vs_dense"]) == {"in_blocks", "unrolled", "ragged"} and min(r["seconds"].values()) > 0
               for r in rows)
    assert all(set(r["read_gb_per_s"]) == {"in_blocks", "dense_active_row"} and min(r["read_gb_per_s"].values()) > 0
               for r in rows)
    printed = capsys.readouterr().out
    assert "vs one dense product" in printed and "weights read at" in printed
