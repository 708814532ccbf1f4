"""`python -m benchmarks.processes` times both layouts at both meshes and writes its JSON
(no timing asserted); the layouts train the same model on the same batches."""

import json

import pytest

from benchmarks import processes


def test_times_one_and_two_processes_at_each_mesh(tmp_path, capsys):
    out = tmp_path / "processes.json"
    assert processes.main(["--steps", "6", "--log-every", "2", "--batch-size", "16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["mesh"], r["processes"], r["devices_each"]) for r in rows] == [
        ("DP", 1, 8), ("DP", 2, 4), ("FSDP x TP", 1, 8), ("FSDP x TP", 2, 4)]
    for one, two in (rows[:2], rows[2:]):
        assert two["final_loss"] == pytest.approx(one["final_loss"], abs=1e-5)
        assert one["vs_one_process"] == 1 and two["vs_one_process"] == pytest.approx(two["step_s"] / one["step_s"])
    assert "vs 1 process" in capsys.readouterr().out


def test_too_few_steps_to_time_are_refused():
    with pytest.raises(SystemExit):
        processes.main(["--steps", "4", "--log-every", "2"])
