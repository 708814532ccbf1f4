"""`python -m benchmarks.compile_depth` at tiny sizes: both forms decode the same tokens, and
the rows, JSON and plot are written as documented. No timing is asserted."""

import json

from benchmarks import compile_depth

FIELDS = {"n_layer", "form", "generate_compile_s", "generate_first_s", "generate_run_s", "train_compile_s",
          "train_first_s", "train_step_s", "same_tokens"}


def test_both_forms_at_each_depth(tmp_path, capsys):
    out = tmp_path / "compile_depth.json"
    compile_depth.main(["--layers", "1", "3", "--d-model", "32", "--new", "4", "--out", str(out),
                        "--plot", str(tmp_path)])
    rows = json.loads(out.read_text())
    assert [(r["n_layer"], r["form"]) for r in rows] == [(1, "unrolled"), (1, "scanned"), (3, "unrolled"),
                                                         (3, "scanned")]
    for row in rows:
        assert set(row) == FIELDS and row["same_tokens"]
        assert 0 < row["generate_compile_s"] < row["generate_first_s"] and row["train_compile_s"] > 0
    assert (tmp_path / "compile_depth.png").exists()
    printed = capsys.readouterr().out
    assert "scanned: generate compile at 3 layers / at 1 layers" in printed
