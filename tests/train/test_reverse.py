"""`python -m train.reverse`: end to end, resume, and bad flags (tiny settings)."""

import json
import logging
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import run_main
from report_page import Page, check_report, chromium, heatmap_colours_shown, render

from jaxformer.commands import report
from jaxformer.sharding import to_host
from jaxformer.training import read_metrics
from jaxformer.training.report_page import build_report, read_snapshots, record_snapshot
from train import reverse

TINY = ["--n-layer", "1", "--d-model", "32", "--d-ff", "32", "--n-head", "2", "--batch-size", "16",
        "--eval-size", "20", "--log-every", "5", "--checkpoint-every", "5"]


def test_end_to_end_smoke(first_ten_steps):
    """The interrupted run of `runs` as it stood after its first 10 steps, and what it printed."""
    run_dir, made_in, done = first_ten_steps
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for expected in ("params:", "shape trace", "cross-attention weights", "NOT square", "exact match",
                     "generalisation probe", "<- source (encoder)", "decoder step"):
        assert expected in out
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [5, 10]
    assert (run_dir / "cross_attention.png").stat().st_size > 1000
    assert (run_dir / "checkpoints" / "10").is_dir()
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["steps"] == 10 and 0.0 <= results["exact_match"] <= 1.0
    assert f"report: {made_in / 'report.html'}" in out
    check_report(run_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run straight to step 15, and one stopped at 10 and resumed to 15 (checkpoints every
    5); a copy of the interrupted run's directory at step 10, and what that first session
    printed. Trained once, in this process, for every test of the module."""
    root = tmp_path_factory.mktemp("reverse")
    straight, interrupted, ten = root / "straight", root / "interrupted", root / "ten"
    assert reverse.main(["--steps", "15", "--run-dir", str(straight), *TINY]) == 0
    first = run_main(reverse.main, ["--steps", "10", "--run-dir", str(interrupted), *TINY])
    shutil.copytree(interrupted, ten)
    assert reverse.main(["--steps", "15", "--run-dir", str(interrupted), "--resume", *TINY]) == 0
    return {"runs": (straight, interrupted), "first_ten_steps": (ten, interrupted, first)}


@pytest.fixture
def runs(trained):
    """(straight, interrupted): both at step 15."""
    return trained["runs"]


@pytest.fixture
def first_ten_steps(trained):
    """(a copy of the interrupted run's directory at step 10, the directory it was made in,
    its `run_main` result)."""
    return trained["first_ten_steps"]


def test_resume_continues_the_same_loss_curve(runs):
    straight, interrupted = runs
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [5, 10, 15]
    np.testing.assert_array_equal([m["loss"] for m in a], [m["loss"] for m in b])
    ra, rb = (json.loads((d / "eval.json").read_text()) for d in (straight, interrupted))
    assert ra["exact_match"] == rb["exact_match"] and ra["final_loss"] == rb["final_loss"]


def test_the_report_of_a_resumed_run_covers_the_whole_run(runs):
    """Every figure and map on both pages is the recorded one (`check_report`); the
    resumed run's page holds the curves and the maps of steps 0 to 15, the same as the
    straight run's, and says where it was resumed."""
    straight, interrupted = runs
    for run_dir in runs:
        page = check_report(run_dir)
        assert page.snapshot_steps == [0, 5, 10, 15]
        # every layer's encoder self, decoder self and cross-attention, every head, at every step
        assert len(page.images) == 4 * 3 * 2
    assert read_snapshots(straight) == read_snapshots(interrupted)  # bitwise the same parameters at each step
    sessions = json.loads((interrupted / "about.json").read_text())["sessions"]
    assert [s["step"] for s in sessions] == [0, 10]
    text = (interrupted / "report.html").read_text()
    assert "from step 10 on" in text and 'class="resume"' in text
    cross = [g for g in read_snapshots(interrupted)[-1]["attention"] if g["name"].startswith("cross")]
    assert cross[0]["rows"][0] == "BOS" and len(cross[0]["cols"]) == reverse.MAP_LENGTH


def test_train_report_rebuilds_the_maps_from_the_checkpoints(runs, tmp_path, capsys):
    """`jaxformer-report` computes the snapshots of the checkpoints kept (the newest
    three) from their parameters: the same as the run recorded, shown on the page and
    written nowhere else (the run's files have one writer). A run older than about.json
    gets a page from its config.json."""
    straight, _ = runs
    run_dir = tmp_path / "copy"
    shutil.copytree(straight, run_dir)
    (run_dir / "snapshots.jsonl").unlink()
    (run_dir / "report.html").unlink()
    demo, settings = report.demo_of(run_dir)
    assert report.snapshot_checkpoints(run_dir, demo, settings) == read_snapshots(straight)[1:]  # steps 5, 10, 15
    assert report.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "snapshots of checkpoints 5, 10, 15 added to the page" in out and f"report: {run_dir / 'report.html'}" in out
    assert not (run_dir / "snapshots.jsonl").exists()
    recorded = tmp_path / "recorded" / "copy"  # the run as if it had recorded those three alone (its title, too)
    shutil.copytree(straight, recorded, ignore=shutil.ignore_patterns("checkpoints", "snapshots.jsonl"))
    for snapshot in read_snapshots(straight)[1:]:
        record_snapshot(recorded, snapshot["step"], snapshot["attention"], snapshot["samples"])
    def unstamped(page):  # (the footer's build time: the two pages may be built a second apart)
        return re.sub(r"<footer>Built \S+ ", "<footer>Built ", page)

    assert unstamped((run_dir / "report.html").read_text()) == unstamped(build_report(recorded))
    check_report(run_dir, read_snapshots(straight)[1:])
    (run_dir / "about.json").unlink()
    assert report.main([str(run_dir)]) == 0
    check_report(run_dir, read_snapshots(straight)[1:])
    assert "predates" in (run_dir / "report.html").read_text()


def test_train_report_refuses_a_directory_without_a_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        report.main([str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not a run directory" in err, err


def test_the_page_renders_in_a_browser(runs, tmp_path):
    """Headless Chromium opens the page from disk: nothing on the console, and the
    screenshot shows the attention maps (many of their colours). A page with a broken
    script is caught the same way."""
    browser = chromium()
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    page_path = runs[1] / "report.html"
    assert render(browser, page_path, tmp_path / "page.png") == []
    assert heatmap_colours_shown(Page(page_path.read_text()), tmp_path / "page.png") >= 20
    broken = tmp_path / "broken.html"
    script = "slider.addEventListener"
    broken.write_text(page_path.read_text().replace(script, "undefinedName(); " + script))
    console = render(browser, broken, tmp_path / "broken.png")
    assert len(console) == 1 and "undefinedName is not defined" in console[0], console


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-5"], "--steps must be a positive int (got -5)"),
    (["--d-model", "30", "--n-head", "4"], "VanillaConfig.d_model must be divisible by n_head=4"),
    (["--label-smoothing", "1.5"], "--label-smoothing must be a finite number in [0, 1) (got 1.5)"),
    (["--resume"], "--resume needs --run-dir"),
    (["--steps", "many"], "invalid int value"),
])
def test_bad_flags_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reverse.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_resume_with_a_different_config_or_into_a_used_dir(runs, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(runs[0], run_dir)  # a finished run of TINY (to step 15)
    with pytest.raises(SystemExit):
        reverse.main(["--steps", "10", "--run-dir", str(run_dir), "--resume", *TINY, "--d-model", "64"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a different config" in err and "model" in err, err
    with pytest.raises(SystemExit):
        reverse.main(["--steps", "10", "--run-dir", str(run_dir), *TINY])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err, err


def test_bfloat16_training_lowers_the_loss(tmp_path):
    run_dir = tmp_path / "bf16"
    assert reverse.main([*TINY, "--steps", "300", "--log-every", "50", "--checkpoint-every", "300", "--warmup", "50",
                         "--dtype", "bfloat16", "--run-dir", str(run_dir)]) == 0
    losses = [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]
    # Measured in bf16, from step 50 to 300, seeds 0, 1, 2: 2.78 -> 2.63, 2.82 -> 2.51, 2.75 -> 2.37 (at step 150
    # seed 0 had only reached 2.70: this tiny model's first steps depend on its draws; the full demo in bf16: 100%).
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1


def test_the_evaluation_finds_its_programs_compiled(caplog):
    """What `prepare_evaluation` compiled while the run trained is what the evaluation runs:
    decoding the trained parameters (on the host, as `runs.train` returns them) compiles
    nothing more. And the shape trace, shapes only, compiles nothing at all."""
    settings = reverse.Settings(n_layer=1, d_model=24, d_ff=24, n_head=2, eval_size=12)  # shapes of this test's own
    setup = reverse.build(settings)
    sets = reverse.prepare_evaluation(setup, settings)
    trained = to_host(jax.tree.map(lambda x: x + 1, setup.params))
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(True):
        reverse.shape_trace(setup.model, setup.params)
        results = [reverse.decoding_exact_match(setup.model, trained, batch) for batch in sets.values()]
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()]
    assert compiled == [], compiled
    assert [r["n"] for r in results] == [12, 12]
