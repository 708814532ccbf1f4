"""`jaxformer.training.run_dir`: a run's config.json, recorded and checked on resume."""

import pytest

from jaxformer.training import check_run_config, save_run_config, start_run


def test_run_config_round_trip_and_mismatch(tmp_path):
    config = {"lr": 1e-3, "d_model": 64, "shape": (2, 3)}
    check_run_config(tmp_path, config)  # nothing saved yet: nothing to compare
    save_run_config(tmp_path, config)
    check_run_config(tmp_path, config)  # the tuple reads back as a list and still matches
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no temp file left
    with pytest.raises(ValueError, match=r"d_model \(saved 64, given 128\)") as err:
        check_run_config(tmp_path, {**config, "d_model": 128})
    assert "lr" not in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="seed"):
        check_run_config(tmp_path, {**config, "seed": 0})


def test_start_run_refuses_a_used_directory_unless_resuming_the_same_run(tmp_path):
    run_dir = tmp_path / "run"
    start_run(run_dir, {"seed": 0}, resume=False)  # creates the directory
    with pytest.raises(ValueError, match="is not empty"):
        start_run(run_dir, {"seed": 0}, resume=False)
    start_run(run_dir, {"seed": 0}, resume=True)
    with pytest.raises(ValueError, match="holds a different config"):
        start_run(run_dir, {"seed": 1}, resume=True)
