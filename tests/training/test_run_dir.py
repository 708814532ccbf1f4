"""`jaxformer.training.run_dir`: a run's config.json, and the checks before a run writes anything."""

import pytest

from jaxformer.training import check_run_config, check_run_dir, read_run_config, save_run_config, start_run


def test_run_config_round_trip_and_mismatch(tmp_path):
    config = {"lr": 1e-3, "d_model": 64, "shape": (2, 3)}
    with pytest.raises(ValueError, match="cannot read .*config.json"):
        check_run_config(tmp_path, config)  # nothing saved: nothing to continue
    save_run_config(tmp_path, config)
    check_run_config(tmp_path, config)  # the tuple reads back as a list and still matches
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no temp file left
    different = r"config.json holds a different config: d_model \(saved 64, given 128\)"
    with pytest.raises(ValueError, match=different) as err:
        check_run_config(tmp_path, {**config, "d_model": 128})
    assert "lr" not in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="seed"):
        check_run_config(tmp_path, {**config, "seed": 0})


@pytest.mark.parametrize("content, message", [('{"seed": ', "config.json is not valid JSON"),
                                              ("[1, 2]", "config.json holds a list, not a run config"),
                                              (b"\xff\xfe", "config.json is not valid JSON")])
def test_an_unreadable_config_is_named(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    with pytest.raises(ValueError, match=message):
        read_run_config(tmp_path)
    with pytest.raises(ValueError, match=message):
        check_run_dir(tmp_path, {"seed": 0}, resume=True)


def test_start_run_refuses_a_used_directory_unless_resuming_the_same_run(tmp_path):
    run_dir = tmp_path / "run"
    start_run(run_dir, {"seed": 0}, resume=False)  # creates the directory
    written = (run_dir / "config.json").stat().st_mtime_ns
    with pytest.raises(ValueError, match="is not empty"):
        start_run(run_dir, {"seed": 0}, resume=False)
    start_run(run_dir, {"seed": 0}, resume=True)
    assert (run_dir / "config.json").stat().st_mtime_ns == written  # written once
    with pytest.raises(ValueError, match="holds a different config"):
        start_run(run_dir, {"seed": 1}, resume=True)


def test_check_run_dir_reads_only_and_names_the_path(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [(a_file, False, "is a file, not a directory"),
             (a_file / "run", False, "cannot be created: .*file is a file"),
             (tmp_path / "absent", True, "does not exist: there is no run to resume"),
             (tmp_path, True, "holds no config.json: not a run directory to resume")]
    for run_dir, resume, message in cases:
        with pytest.raises(ValueError, match=message):
            check_run_dir(run_dir, None, resume)
    check_run_dir(tmp_path / "new" / "run", {"seed": 0}, resume=False)  # creatable: fine, and not created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_nested_difference_is_named_by_its_path(tmp_path):
    save_run_config(tmp_path, {"model": {"d_model": 32, "n_head": 2}, "seed": 0})
    with pytest.raises(ValueError, match=r"holds a different config: model.d_model \(saved 32, given 64\); ") as e:
        check_run_config(tmp_path, {"model": {"d_model": 64, "n_head": 2}, "seed": 0})
    assert "n_head" not in str(e.value)
