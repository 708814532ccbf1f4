"""`jaxformer-report`: telling which demo made a run, from the run's files alone."""

import dataclasses

import pytest

from jaxformer.commands import report
from jaxformer.training import save_run_config
from jaxformer.training.report_page import ABOUT_FILE
from jaxformer.training.run_start import run_record

TINY = dict(n_layer=1, d_model=32, n_head=2, batch_size=4, seed=3)


@pytest.mark.parametrize("program", report.OLDER_THAN_ABOUT)
def test_a_run_older_than_about_json_is_told_by_its_model(program, tmp_path):
    """Without `about.json`, the demo is the one whose model config has the fields
    `config.json` records, and the settings are those it records."""
    demo = report.demo(program)
    fields = {f.name for f in dataclasses.fields(demo.Settings)}
    settings = demo.Settings(**{k: v for k, v in TINY.items() if k in fields})
    setup = demo.build(settings)
    save_run_config(tmp_path, run_record(setup.model.config, settings))
    assert not (tmp_path / ABOUT_FILE).exists()
    assert report.demo_of(tmp_path) == (demo, settings)


def test_a_model_no_demo_builds_is_refused(tmp_path):
    save_run_config(tmp_path, {"model": {"n_layer": 1, "n_experts": 8}, "seed": 0})
    with pytest.raises(ValueError, match=r"config.json records a model none of .* builds \(fields "
                                         r"\['n_experts', 'n_layer'\]\)"):
        report.demo_of(tmp_path)
    save_run_config(tmp_path, {"model": {}, "seed": 0})
    with pytest.raises(ValueError, match="records a model none of"):
        report.demo_of(tmp_path)


def test_a_program_no_demo_is_refused(tmp_path):
    save_run_config(tmp_path, {"model": {"n_layer": 1}, "seed": 0})
    (tmp_path / ABOUT_FILE).write_text('{"program": "python -m train.other", "settings": {}, "sessions": []}')
    with pytest.raises(ValueError, match="names 'python -m train.other', not one of python -m train.reverse, "
                                         "python -m train.lm, jaxformer-finetune"):
        report.demo_of(tmp_path)
