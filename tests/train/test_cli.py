"""The library trainer the demos share (`jaxformer.training.runs`, `flags`, `run_start`): help texts, settings,
builds and run records."""

import dataclasses
import re

import jax
import pytest

from jaxformer.commands import report
from jaxformer.training import flags, run_start, runs
from train import lm, reverse

TINY = {reverse: dict(n_layer=1, d_model=32, d_ff=32, n_head=2, batch_size=4),
        lm: dict(n_layer=1, d_model=32, n_head=2, n_kv_head=1, batch_size=4)}
TARGETS = {reverse: "tgt_out", lm: "targets"}  # the batch's scored ids
DEMOS = (reverse, lm)


@pytest.mark.parametrize("program", report.KINDS)
def test_every_kind_of_run_is_made_by_a_demo(program):
    """Each module `jaxformer-report` serves has what `runs.Demo` names, under the program
    its runs record; the demos' settings are covered by the tests here."""
    demo = report.demo(program)
    for name in runs.Demo.__annotations__:
        assert hasattr(demo, name), name
    for name in ("build", "snapshotter", "main"):
        assert callable(getattr(demo, name)), name
    assert dataclasses.is_dataclass(demo.MODEL_CONFIG) and dataclasses.is_dataclass(demo.Settings)
    assert demo.PROG == program and (demo in TINY or demo.__name__.startswith("jaxformer."))


def help_entries(demo, capsys) -> dict[str, str]:
    """`--help` as {flag: its whole entry on one line}."""
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--help"])
    assert exit_info.value.code == 0
    entries, current = {}, None
    for line in capsys.readouterr().out.split("options:")[1].splitlines():
        if re.match(r"  -", line):  # an entry starts at indent 2; its wrapped lines are indented further
            current = re.findall(r"(?:^|, )(--[a-z-]+)", line.strip())[0]  # "-h, --help  show ..."
            entries[current] = line
        elif current is not None:
            entries[current] += " " + line
    return {name: " ".join(text.split()) for name, text in entries.items()}


@pytest.mark.parametrize("demo", DEMOS, ids=lambda demo: demo.__name__)
def test_help_shows_every_default_once(demo, capsys):
    entries = help_entries(demo, capsys)
    for text in entries.values():
        assert text.count("default:") <= 1, text
        assert "default: None" not in text, text
    for field in dataclasses.fields(demo.Settings):
        default = field.default
        if default is None or isinstance(default, bool) or default == "":
            continue  # the help says in words what happens without the flag
        assert entries[flags.flag(field.name)].count(f"default: {default}") == 1, entries[flags.flag(field.name)]
    assert "default: runs/" in entries["--run-dir"] and "default: one device" in entries["--mesh"]


@pytest.mark.parametrize("demo", DEMOS, ids=lambda demo: demo.__name__)
def test_settings_name_the_flag_of_a_bad_value(demo):
    with pytest.raises(ValueError, match=r"--batch-size must be a positive int \(got 0\)"):
        demo.Settings(batch_size=0)
    with pytest.raises(ValueError, match="--dtype must be one of"):
        demo.Settings(dtype="float16")


@pytest.mark.parametrize("demo", DEMOS, ids=lambda demo: demo.__name__)
def test_build_gives_one_shape_of_setup_and_record(demo):
    settings = demo.Settings(**TINY[demo])
    setup = demo.build(settings)
    assert isinstance(setup, runs.Setup)
    batch = setup.make_batch(jax.random.key(0))
    # (Jitted: one compile, where the eager loss compiles each of its operations.)
    loss, aux = jax.jit(setup.loss_fn)(setup.params, batch, jax.random.key(1))
    assert loss.shape == () and aux == {}
    assert setup.tokens_per_step == batch[TARGETS[demo]].size
    assert isinstance(setup.model.config, demo.MODEL_CONFIG)
    record = run_start.run_record(setup.model.config, settings)
    assert set(record) == {"model", *demo.Settings.RESUME_FIELDS}
    assert record["model"]["d_model"] == 32 and not set(run_start.DTYPE_FIELDS) & set(record["model"])
