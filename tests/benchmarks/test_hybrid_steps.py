"""`python -m benchmarks.hybrid_steps` on a tiny Qwen3-Next-shaped folder (no timing asserted): each
program at each length reports its time, XLA bytes and resident peak, and both prefills give the
same last logits."""

import json

import numpy as np
import pytest
from conftest import import_peer

from benchmarks import hybrid_steps

pytestmark = pytest.mark.peers


def test_each_program_at_each_length_reports_its_figures(tmp_path, capsys):
    import_peer("transformers")
    out = tmp_path / "hybrid_steps.json"
    hybrid_steps.main(["--lengths", "64", "128", "--divisor", "16", "--experts", "4", "--top-k", "2",
                       "--vocab", "512", "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [row["T"] for row in rows] == [64, 128]
    for row in rows:
        assert all(row[p]["seconds"] > 0 and row[p]["rss_mb"] > 0 for p in hybrid_steps.PROGRAMS)
        assert row["prefill"]["xla_bytes"] > 0 and row["train"]["xla_bytes"] > 0
        mine, theirs = np.asarray(row["prefill"]["logits"]), np.asarray(row["torch"]["logits"])
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * np.max(np.abs(theirs)))
    assert rows[1]["train"]["xla_bytes"] > rows[0]["train"]["xla_bytes"]
    assert "transformers / jaxformer prefill" in capsys.readouterr().out
