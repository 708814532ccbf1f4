"""The report page from a run's files: its figures, images and links (no model involved)."""

import base64
import json

import numpy as np
import pytest
from report_page import Page, check_report, decode_png

from jaxformer.training import MetricsLog
from jaxformer.training.report_page import (
    REPORT_FILE,
    attention_group,
    colormap,
    drop_snapshots_after,
    experts_group,
    png_bytes,
    read_snapshots,
    record_session,
    record_snapshot,
    result_label,
    write_report,
    write_results,
)

RESULTS = {"steps": 6, "final_loss": 0.5772156, "exact_match": 0.98765, "probe_exact_match": 0.0123,
           "per_length": {"5": [1.0, 3], "6": [0.9375, 16]},
           "examples": [{"label": "seen", "input": ["1", "2"], "target": ["2", "1", "EOS"],
                         "output": ["2", "2", "EOS"]}],
           "sample": "a <sampled> text"}
LABELS = {"steps": result_label("updates trained"), "final_loss": result_label("final training loss"),
          "exact_match": result_label("exact match", "rate"), "probe_exact_match": result_label("probe match", "rate"),
          "per_length": result_label("Match per length", "per_length"),
          "examples": result_label("Decoded", "examples"), "sample": result_label("A sample", "text")}


def make_run(run_dir, *, evaluated=True, experts=False):
    """A run's files as the demos write them: two sessions, three logged steps, snapshots
    at steps 0, 2 and 4, and an evaluation; with `experts`, a mixture of experts' load in
    each snapshot (layers 0 and 2 of 4 experts and layer 1 of 8, each token's 2 choices)."""
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"model": {"n_layer": 1, "d_model": 8}, "seed": 0}))
    trace = [("token ids", (2, 5), ""), ("logits", (2, 5, 7), "")]
    record_session(run_dir, "python -m train.demo", {"steps": 6, "lr": 1e-3}, 12345, trace, 0, "cpu (cpu)")
    record_session(run_dir, "python -m train.demo", {"steps": 6, "lr": 1e-3}, 12345, trace, 4, "other (cpu)")
    log = MetricsLog(run_dir / "metrics.jsonl")
    for step, loss, lr in ((2, 2.718281828, 1.25e-05), (4, 1.4142135, 0.000375), (6, 0.5772156, 0.0001234567)):
        log.write(step, loss=loss, lr=lr, steps_per_sec=1234.5678 / step)
    rng = np.random.default_rng(0)
    tokens = ["a", "b", "<c>"]
    for step in (0, 2, 4):
        heads = rng.dirichlet(np.ones(3), size=(2, 3))  # [n_head, rows, cols], rows sum to 1
        load = [experts_group(layer, rng.multinomial(2 * 40, np.ones(n) / n), note="routed: 40 tokens")
                for layer, n in ((0, 4), (1, 8), (2, 4))] if experts else []
        record_snapshot(run_dir, step, [attention_group("self-attention", 0, heads, tokens, tokens, note="look")],
                        [{"label": "pattern", "output": ["a", "b"], "target": ["a", "c"]}], load)
    if evaluated:
        write_results(run_dir, RESULTS, LABELS)
    return run_dir


def test_every_figure_and_map_is_the_recorded_one(tmp_path):
    run_dir = make_run(tmp_path / "run")
    path = write_report(run_dir)
    assert path == run_dir / REPORT_FILE
    page = check_report(run_dir)
    assert page.snapshot_steps == [0, 2, 4] and len(page.images) == 6
    text = path.read_text()
    assert "12,345" in text and "98.8 %" in text and "from step 4 on other (cpu)" in text
    assert '<span class="tok wrong">2</span>' in text  # the example's wrong token is marked, the right ones not
    assert '<span class="tok">EOS</span>' in text


def test_a_mixture_of_experts_load_is_drawn_at_each_step_and_a_dense_run_has_none(tmp_path):
    """Each layer's share of the pairs each expert got, as a map (layers by experts) and a table of
    every share, at each recorded step, with its own step slider; a dense run's page has no such
    section. `check_report` reads every share back from the snapshots and every map's pixels, and
    fails a count changed in the file."""
    dense = make_run(tmp_path / "dense")
    write_report(dense)
    page = check_report(dense)
    assert "experts" not in page.sections and page.load_steps == [] and len(page.images) == 6
    assert "snapshots/" not in (dense / REPORT_FILE).read_text()

    run_dir = make_run(tmp_path / "moe", experts=True)
    text = write_report(run_dir).read_text()
    page = check_report(run_dir)
    assert page.load_steps == [0, 2, 4] and page.snapshot_steps == [0, 2, 4]
    assert len(page.images) == 6 + 3  # the heads' maps, then one map of the load a step
    assert sum(src.startswith("snapshots/") for src, _ in page.figures) == 3 * (4 + 8 + 4)
    assert 'id="load-slider"' in text and "routed: 40 tokens" in text
    counts = read_snapshots(run_dir)[2]["experts"][1]["counts"]
    shown = dict(page.figures)[f"snapshots/4/experts/1/{int(np.argmax(counts))}"]
    assert shown == f"{100 * max(counts) / 80:.1f} %"  # 80 pairs: 40 tokens, 2 choices each
    lines = (run_dir / "snapshots.jsonl").read_text().splitlines()
    changed = json.loads(lines[2])
    changed["experts"][1]["counts"][:2] = changed["experts"][1]["counts"][1::-1] if counts[0] != counts[1] else [0, 0]
    (run_dir / "snapshots.jsonl").write_text("\n".join([*lines[:2], json.dumps(changed)]) + "\n")
    with pytest.raises(AssertionError):
        check_report(run_dir)  # the page now shows other shares than the file holds
    with pytest.raises(ValueError, match="one non-negative int per expert"):
        experts_group(0, [1.5, 2.0])


def test_the_results_are_shown_by_the_labels_the_run_recorded(tmp_path):
    """Each result under its recorded label, a rate as %, each table and section titled by
    its own; a result without a label is refused, and one of another kind too."""
    run_dir = make_run(tmp_path / "run")
    text = write_report(run_dir).read_text()
    assert json.loads((run_dir / "eval.json").read_text())["labels"] == LABELS
    assert "<td>exact match</td>" in text and "98.8 %" in text and "<td>probe match</td>" in text
    assert "<h3>Match per length</h3>" in text and "<h3>Decoded</h3>" in text
    assert '<h3>A sample</h3><pre class="sample">a &lt;sampled&gt; text</pre>' in text
    with pytest.raises(ValueError, match="results sample have no label to show them by"):
        write_results(run_dir, RESULTS, {k: v for k, v in LABELS.items() if k != "sample"})
    with pytest.raises(ValueError, match="result kind must be one of number, rate, per_length, examples, text"):
        result_label("exact match", "percent")


def test_a_run_whose_eval_json_holds_no_labels_is_shown_by_its_keys(tmp_path):
    """A run written before eval.json held labels: each result under its key, as its
    value's shape gives (a number, a per-length table, examples, a text)."""
    run_dir = make_run(tmp_path / "run", evaluated=False)
    (run_dir / "eval.json").write_text(json.dumps(RESULTS))
    text = write_report(run_dir).read_text()
    assert "<td>exact_match</td>" in text and "0.9877" in text and "<h3>per_length</h3>" in text
    assert "<h3>examples</h3>" in text and "<h3>sample</h3>" in text
    check_report(run_dir)


def test_the_checks_catch_a_wrong_figure_or_image(tmp_path):
    """`check_report` has teeth: a figure that no longer matches its file, or a map whose
    weights changed, fails it."""
    run_dir = make_run(tmp_path / "run")
    write_report(run_dir)
    results = json.loads((run_dir / "eval.json").read_text())
    (run_dir / "eval.json").write_text(json.dumps({**results, "exact_match": 0.97}))
    with pytest.raises(AssertionError):
        check_report(run_dir)
    (run_dir / "eval.json").write_text(json.dumps(results))
    check_report(run_dir)
    lines = (run_dir / "snapshots.jsonl").read_text().splitlines()
    changed = json.loads(lines[0])
    changed["attention"][0]["heads"][0][0] = [0.0, 0.5, 0.5]
    (run_dir / "snapshots.jsonl").write_text("\n".join([json.dumps(changed), *lines[1:]]) + "\n")
    with pytest.raises(AssertionError):
        check_report(run_dir)


def test_a_run_without_evaluation_or_snapshots_says_so(tmp_path):
    run_dir = make_run(tmp_path / "run", evaluated=False)
    (run_dir / "snapshots.jsonl").unlink()
    text = write_report(run_dir).read_text()
    assert "Not evaluated yet" in text and "No snapshots recorded yet" in text
    check_report(run_dir)


def test_snapshots_past_a_resumed_step_are_dropped_and_redone(tmp_path):
    run_dir = make_run(tmp_path / "run")
    drop_snapshots_after(run_dir, 2)
    assert [s["step"] for s in read_snapshots(run_dir)] == [0, 2]
    record_snapshot(run_dir, 4, [], [])
    record_snapshot(run_dir, 4, [], [{"label": "again", "output": "text"}])  # the later line of a step wins
    assert [s["step"] for s in read_snapshots(run_dir)] == [0, 2, 4]
    assert read_snapshots(run_dir)[-1]["samples"][0]["label"] == "again"


def test_a_line_torn_by_a_crash_is_dropped_before_the_next_one(tmp_path):
    run_dir = make_run(tmp_path / "run")
    with open(run_dir / "snapshots.jsonl", "a") as f:
        f.write('{"step": 6, "attention": [')  # killed mid-write
    assert [s["step"] for s in read_snapshots(run_dir)] == [0, 2, 4]
    record_snapshot(run_dir, 6, [], [])
    assert [s["step"] for s in read_snapshots(run_dir)] == [0, 2, 4, 6]


def test_a_session_from_an_earlier_checkpoint_replaces_the_later_ones(tmp_path):
    run_dir = make_run(tmp_path / "run")
    record_session(run_dir, "python -m train.demo", {}, 1, [], 2, "third")
    sessions = json.loads((run_dir / "about.json").read_text())["sessions"]
    assert [(s["step"], s["device"]) for s in sessions] == [(0, "cpu (cpu)"), (2, "third")]


def test_png_is_read_back_by_pillow_pixel_for_pixel():
    rgb = np.random.default_rng(1).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode_png("data:image/png;base64," + base64.b64encode(png_bytes(rgb)).decode()),
                                  rgb)


def test_colormap_runs_from_dark_blue_to_yellow_through_viridis():
    mpl = pytest.importorskip("matplotlib")
    weights = np.linspace(0, 1, 1025)[None, :]
    got = colormap(weights)[0].astype(int)
    want = np.round(np.asarray(mpl.colormaps["viridis"](weights[0]))[:, :3] * 255).astype(int)
    assert np.abs(got - want).max() <= 5  # 17 samples of the map, linearly between them (measured: 5)
    np.testing.assert_array_equal(colormap([[-1.0, 2.0]])[0], [[68, 1, 84], [253, 231, 37]])  # clipped


def test_attention_group_checks_the_labels_fit():
    with pytest.raises(ValueError, match="3 query tokens x 2 key tokens"):
        attention_group("x", 0, np.zeros((1, 3, 3)), ["a", "b", "c"], ["a", "b"])


def test_page_parser_sees_sections_and_links():
    page = Page('<section id="a"><a href="https://example.com/x">x</a><span data-src="about/params">1</span>'
                "</section>")
    assert page.sections == ["a"] and page.links == ["https://example.com/x"]
    assert page.figures == [("about/params", "1")]
