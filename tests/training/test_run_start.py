"""What a run records for `--resume` to match (`jaxformer.training.run_start.run_record`)."""

import dataclasses

import pytest
from conftest import SMALL, filled_layers

from jaxformer.training.run_dir import check_run_config, save_run_config
from jaxformer.training.run_start import run_record


@dataclasses.dataclass
class Settings:
    steps: int = 4
    RESUME_FIELDS = ("steps",)


def test_a_field_added_later_is_recorded_only_where_it_changes_the_model(tmp_path):
    plain = run_record(SMALL, Settings())
    assert "layers" not in plain["model"]  # so that runs recorded before `layers` existed still resume
    save_run_config(tmp_path, plain)
    check_run_config(tmp_path, run_record(SMALL, Settings()))
    wider = run_record(filled_layers(SMALL, widths=[96] * SMALL.n_layer), Settings())
    assert len(wider["model"]["layers"]) == SMALL.n_layer
    with pytest.raises(ValueError, match=r"model\.layers"):
        check_run_config(tmp_path, wider)
