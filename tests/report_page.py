"""Reading a run's report page back, to check it against the files it was built from."""

import base64
import io
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

from jaxformer.training import read_metrics
from jaxformer.training.report_page import colormap, read_snapshots

SECTIONS = ("curves", "attention", "evaluation", "run")  # (and "experts", for a mixture of experts)
_SHOWN = re.compile(r"(-?[\d,]*\.?\d+(?:e[-+]?\d+)?)\s*(%?)$")


class Page(HTMLParser):
    """The parts of the page the checks read: section ids, every figure tagged with its
    source (`data-src` and its text), the heatmap images in order, every link target, the
    steps of the attention snapshots and of the experts' load."""

    def __init__(self, text: str):
        super().__init__()
        self.sections, self.figures, self.images, self.links, self.snapshot_steps = [], [], [], [], []
        self.load_steps = []
        self._open = []  # [tag, src, text] of the figures being read
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.sections.append(attrs.get("id"))
        if "data-src" in attrs:
            self._open.append([tag, attrs["data-src"], ""])
        if tag == "div" and "data-step" in attrs:
            self.snapshot_steps.append(int(attrs["data-step"]))
        if tag == "div" and "data-load-step" in attrs:
            self.load_steps.append(int(attrs["data-load-step"]))
        if tag == "image":
            self.images.append(attrs["href"])
        self.links += [v for k, v in attrs.items() if k in ("href", "src", "action") and v is not None]

    def handle_data(self, data):
        for figure in self._open:
            figure[2] += data

    def handle_endtag(self, tag):
        if self._open and self._open[-1][0] == tag:
            self.figures.append(tuple(self._open.pop()[1:]))


def source_value(src: str, run_dir: Path, snapshots: list[dict] | None = None):
    """The recorded number a `data-src` names (a snapshot's: of `snapshots`, else the run's file)."""
    kind, *path = src.split("/")
    if kind == "snapshots":  # an expert's share of its layer's pairs
        step, layer, expert = int(path[0]), int(path[2]), int(path[3])
        snapshot = next(s for s in (read_snapshots(run_dir) if snapshots is None else snapshots) if s["step"] == step)
        counts = next(g["counts"] for g in snapshot["experts"] if g["layer"] == layer)
        return counts[expert] / sum(counts)
    if kind == "metrics":  # (a name may hold "/": DPO's rewards/chosen)
        step, name = int(path[0]), "/".join(path[1:])
        return next(m for m in read_metrics(run_dir / "metrics.jsonl") if m["step"] == step)[name]
    if kind == "about":
        return json.loads((run_dir / "about.json").read_text())[path[0]]
    results = json.loads((run_dir / "eval.json").read_text())
    if "/".join(path) in results:
        return results["/".join(path)]
    key, length, which = "/".join(path[:-2]), path[-2], path[-1]
    return results[key][length][0 if which == "rate" else 1]


def assert_shown_equals(shown: str, value) -> None:
    """`shown` (as the page prints it: "0.1234", "1.2e-05", "98.7 %", "12,345") is
    `value` to the digits it shows: within half a unit of its last digit. NaN and inf are
    shown as Python writes them ("nan", "inf", "-inf"), and only they are."""
    if isinstance(value, float) and not math.isfinite(value):
        assert shown.split()[-1] == str(value), (shown, value)
        return
    match = _SHOWN.search(shown.strip())
    assert match, f"no number at the end of {shown!r}"
    number, percent = match.group(1).replace(",", ""), match.group(2)
    mantissa, _, exponent = number.partition("e")
    decimals = len(mantissa.partition(".")[2])
    scale = 10.0 ** int(exponent or 0) / (100 if percent else 1)
    tolerance = 0.5 * 10.0 ** -decimals * scale
    assert abs(float(number) / (100 if percent else 1) - value) <= tolerance * (1 + 1e-9), (shown, value)


def check_report(run_dir: Path, snapshots: list[dict] | None = None) -> Page:
    """Checks the page of `run_dir` against its files: it parses; every section is there;
    every figure is its source's number, and every logged and evaluated number is shown;
    it links to nothing outside itself; each heatmap image is its snapshot's weights
    through the colour map, one pixel a cell, at every recorded step (or of `snapshots`,
    those `jaxformer-report` computed for the page); a mixture of experts' load is shown at
    each step that recorded one, every share of it, its map each expert's share over an even
    one's halved (one half: an even load) through the colour map, layers by experts.

    Returns:
      The parsed page.
    """
    text = (run_dir / "report.html").read_text()
    page = Page(text)
    assert set(SECTIONS) <= set(page.sections), page.sections
    recorded = read_snapshots(run_dir) if snapshots is None else snapshots
    for src, shown in page.figures:
        assert_shown_equals(shown, source_value(src, run_dir, recorded))
    sources = {src for src, _ in page.figures}
    for m in read_metrics(run_dir / "metrics.jsonl"):
        for name in m.keys() - {"step"}:  # every logged value: loss, lr, steps/s, a method's own
            assert f"metrics/{m['step']}/{name}" in sources, name
    results_path = run_dir / "eval.json"
    if results_path.exists():
        results = json.loads(results_path.read_text())
        labels = results.pop("labels", {})
        for key, value in results.items():
            if isinstance(value, float):
                assert f"eval/{key}" in sources, key
            if labels.get(key, {}).get("kind") == "per_length" or (not labels and isinstance(value, dict)):
                assert {f"eval/{key}/{length}/{w}" for length in value for w in ("rate", "n")} <= sources
    # Nothing to fetch: every link is inside the page (#...) or the data itself (data:...).
    assert all(link.startswith(("data:", "#")) for link in page.links), [
        link[:60] for link in page.links if not link.startswith(("data:", "#"))]
    assert not re.search(r"(https?:)?//[\w.-]+\.[a-z]{2,}/|@import|url\(", text)

    snapshots = [s for s in recorded if s["attention"]]
    assert page.snapshot_steps == [s["step"] for s in snapshots]
    expected = [colormap(np.asarray(head)) for s in snapshots for group in s["attention"] for head in group["heads"]]
    loads = [s for s in recorded if s.get("experts")]
    assert page.load_steps == [s["step"] for s in loads] and ("experts" in page.sections) == bool(loads)
    for s in loads:
        assert {f"snapshots/{s['step']}/experts/{g['layer']}/{e}" for g in s["experts"]
                for e in range(len(g["counts"]))} <= sources
        experts = max(len(g["counts"]) for g in s["experts"])
        grid = np.full((len(s["experts"]), experts), np.nan)
        for row, group in enumerate(s["experts"]):
            counts = np.asarray(group["counts"], np.float64)
            grid[row, :len(counts)] = counts / max(counts.sum(), 1) * len(counts) / 2
        expected.append(colormap(grid))
    assert len(page.images) == len(expected)
    for href, pixels in zip(page.images, expected):
        np.testing.assert_array_equal(decode_png(href), pixels)
    return page


def decode_png(href: str) -> np.ndarray:
    """A `data:image/png;base64,...` image as `[height, width, 3]` uint8, read by Pillow."""
    from PIL import Image

    prefix = "data:image/png;base64,"
    assert href.startswith(prefix)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(href[len(prefix):]))).convert("RGB"))


def chromium() -> str | None:
    """The Chromium (or Chrome) on PATH, or None."""
    import shutil

    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def render(browser: str, page: Path, screenshot: Path) -> list[str]:
    """Loads `page` from disk in headless `browser`, saves a screenshot of its first
    2400 pixels, and returns what the page wrote to the console (uncaught errors
    included), one line each."""
    import subprocess

    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--enable-logging=stderr", "--v=0", "--window-size=1280,2400",
                           f"--screenshot={screenshot}", page.absolute().as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert screenshot.exists(), done.stderr[-2000:]
    return [line for line in done.stderr.splitlines() if re.search(r":CONSOLE[:(]", line)]


def heatmap_colours_shown(page: Page, screenshot: Path) -> int:
    """How many distinct colours of the page's heatmap images the screenshot shows."""
    from PIL import Image

    colours = {tuple(c) for href in page.images for c in decode_png(href).reshape(-1, 3)}
    shown = np.unique(np.asarray(Image.open(screenshot).convert("RGB")).reshape(-1, 3), axis=0)
    return sum(tuple(c) in colours for c in shown)
