"""A training run's report page: `report.html`, one self-contained file built from the
files the run records.

    run_dir/
      about.json        what ran where: the program, its settings, the parameter count,
                        the shape trace, and each session (the step it started from, the
                        device); `record_session`
      config.json       what a resumed run must match (`jaxformer.training.run_dir`)
      metrics.jsonl     loss, learning rate and steps/s every `log_every` updates (and a
                        method's own: DPO's rewards, GRPO's reward and KL)
      snapshots.jsonl   at step 0 and every checkpoint: attention maps of one example,
                        every layer and head, samples, and a mixture of experts' load
                        (the pairs each layer's router sent to each expert); `record_snapshot`
      eval.json         the final evaluation: the command's results, and under "labels"
                        how each is shown (`result_label`); `write_results`

`write_report(run_dir)` reads these and writes `report.html` atomically: SVG curves, tables,
the attention maps and the experts' load as inline PNG images with their labels on the axes,
and a step slider over the snapshots. It holds no URL: it opens from disk in any browser, offline.

Every number the page shows comes from those files. Each is marked with where it came
from, `data-src="metrics/<step>/<name>"`, `"eval/<key>[/<length>/<rate|n>]"`,
`"snapshots/<step>/experts/<layer>/<expert>"` (an expert's share of its layer's pairs) or
`"about/params"`, so a test can read the page and check every figure against its source.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import math
import struct
import zlib
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from jaxformer.files import append_line, write_text_atomically
from jaxformer.training.metrics import METRICS_FILE, drop_records_after, read_metrics
from jaxformer.training.run_dir import CONFIG_FILE, read_run_file

REPORT_FILE = "report.html"
SNAPSHOTS_FILE = "snapshots.jsonl"
ABOUT_FILE = "about.json"
RESULTS_FILE = "eval.json"

# viridis at 0, 1/16, ..., 1: dark blue for a weight near 0, yellow near 1 (the PNG grid's map).
_VIRIDIS = np.array([[68, 1, 84], [72, 24, 106], [71, 45, 123], [66, 64, 134], [59, 82, 139], [51, 99, 141],
                     [44, 114, 142], [38, 130, 142], [33, 145, 140], [31, 160, 136], [40, 174, 128], [63, 188, 115],
                     [94, 201, 98], [132, 212, 75], [173, 220, 48], [216, 226, 25], [253, 231, 37]], np.float64)
# A weight that is NaN or inf (a model whose numbers stopped being finite) has no place on the map: a
# neutral grey, which viridis never passes through.
_NONFINITE_RGB = np.array([190, 190, 190], np.uint8)

# How the page shows a result of eval.json, by its label's kind: a number; a rate (shown as
# %); a table `{length: [rate, count]}`; decoded examples, `[{"label", "input", "target",
# "output"}, ...]` of tokens; a text.
RESULT_KINDS = ("number", "rate", "per_length", "examples", "text")
LABELS = "labels"  # eval.json's key of the labels, beside the results


# ------------------------------------------------------------------ the run's records

def record_session(run_dir, program: str, settings: dict, params: int, shape_trace, step: int, device: str) -> None:
    """Writes `about.json` (atomically), adding this session to those before it.

    Args:
      run_dir: the run directory.
      program: the command, e.g. "python -m train.reverse".
      settings: every setting of the run, by name.
      params: the model's parameter count.
      shape_trace: `(stage, shape, note)` rows of one forward pass.
      step: the step this session starts from (0, or the restored checkpoint's).
      device: the device this session computes on, in words.

    Raises:
      ValueError: naming `about.json`, when the one there is damaged (`read_about`).
    """
    path = Path(run_dir) / ABOUT_FILE
    sessions = (read_about(run_dir) or {"sessions": []})["sessions"]
    sessions = [s for s in sessions if s["step"] < step]  # a session redone from an earlier checkpoint drops later ones
    sessions.append({"step": int(step), "device": device,
                     "started": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    about = {"program": program, "settings": settings, "params": int(params),
             "shape_trace": [[str(a), str(b), str(c)] for a, b, c in shape_trace], "sessions": sessions}
    write_text_atomically(path, json.dumps(about, indent=2) + "\n")


def result_label(label: str, kind: str = "number") -> dict:
    """How the page shows one result of eval.json: under `label` (a table's or section's
    title, for the kinds that are one), as `kind`, one of `RESULT_KINDS`. A command
    declares one for each of its results (`jaxformer.training.runs.write_results`)."""
    if kind not in RESULT_KINDS:
        raise ValueError(f"result kind must be one of {', '.join(RESULT_KINDS)} (got {kind!r})")
    return {"label": label, "kind": kind}


def write_results(run_dir, results: dict, labels: dict[str, dict]) -> None:
    """Writes `results` to `eval.json` (atomically), with each one's label (`result_label`)
    under "labels", in the order the page shows them.

    Raises:
      ValueError: a result without its label.
      OSError: naming the file, when it cannot be written.
    """
    missing = [key for key in results if key not in labels]
    if missing:
        raise ValueError(f"results {', '.join(missing)} have no label to show them by (result_label)")
    record = {**results, LABELS: {key: labels[key] for key in results}}
    write_text_atomically(Path(run_dir) / RESULTS_FILE, json.dumps(record, indent=2) + "\n")


def attention_group(name: str, layer: int, weights, rows, cols, note: str = "") -> dict:
    """One layer's attention maps, as `record_snapshot` takes them.

    Args:
      name: which attention, e.g. "cross-attention".
      layer: the layer, from 0.
      weights: `[n_head, len(rows), len(cols)]` weights of one example (queries by keys).
      rows: the query tokens, as text.
      cols: the key tokens, as text.
      note: what to look for, shown under the maps' heading.
    """
    weights = np.asarray(weights, np.float64)
    if weights.ndim != 3 or weights.shape[1:] != (len(rows), len(cols)):
        raise ValueError(f"attention weights of shape {weights.shape} do not match {len(rows)} query tokens x "
                         f"{len(cols)} key tokens")
    return {"name": name, "layer": int(layer), "note": note, "rows": [str(r) for r in rows],
            "cols": [str(c) for c in cols], "heads": np.round(weights, 4).tolist()}


def experts_group(layer: int, counts, note: str = "") -> dict:
    """One layer of experts' load, as `record_snapshot` takes it.

    Args:
      layer: the layer, from 0.
      counts: `[E]` ints, the (token, choice) pairs its router sent to each expert
        (`jaxformer.decoder.expert_load`).
      note: which tokens were routed, shown under the map.
    """
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise ValueError(f"expert counts must be one non-negative int per expert (got {counts.dtype} of shape "
                         f"{counts.shape})")
    return {"layer": int(layer), "note": note, "counts": [int(n) for n in counts]}


def token_labels(tokenizer, ids) -> list[str]:
    """Each id's text (`tokenizer`: a `jaxformer.text.Tokenizer`), one label a token,
    whitespace made visible (for the attention maps)."""
    texts = (tokenizer.decode(np.asarray([i]), skip_special_tokens=False) for i in np.asarray(ids))
    return [t.replace(" ", "\u2423").replace("\n", "\u23ce") or "\u2205" for t in texts]


def record_snapshot(run_dir, step: int, attention: list[dict], samples: list[dict] = (),
                    experts: list[dict] = ()) -> None:
    """Appends what the model does at `step` to `snapshots.jsonl`.

    Args:
      run_dir: the run directory.
      step: the updates done.
      attention: `attention_group`s of one example, every layer.
      samples: `{"label": str, "output": str | [token, ...], "target": [token, ...] (optional)}`
        each; a target marks the output's tokens that differ from it.
      experts: `experts_group`s, each layer of experts (a model without experts: none).

    Raises:
      OSError: naming the file, when it cannot be written (nothing of the line is kept).
    """
    record = snapshot_record(step, attention, samples, experts)
    path = Path(run_dir) / SNAPSHOTS_FILE
    if _torn(path):  # a run killed mid-line: keep the whole lines, or this one would be appended to the part
        drop_records_after(path, math.inf)
    append_line(path, json.dumps(record))


def snapshot_record(step: int, attention: list[dict], samples: list[dict] = (), experts: list[dict] = ()) -> dict:
    """One line of `snapshots.jsonl` (`record_snapshot`'s arguments); "experts" only where given."""
    record = {"step": int(step), "attention": list(attention), "samples": list(samples)}
    return {**record, "experts": list(experts)} if experts else record


def _torn(path: Path) -> bool:
    """Whether `path` ends in a line without its newline."""
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def read_snapshots(run_dir) -> list[dict]:
    """The snapshots of a run by step (of a step recorded twice, the later one)."""
    by_step = {r["step"]: r for r in read_metrics(Path(run_dir) / SNAPSHOTS_FILE)}
    return [by_step[s] for s in sorted(by_step)]


def drop_snapshots_after(run_dir, step: int) -> None:
    """Drops the snapshots past `step`, which a resumed run is about to redo."""
    drop_records_after(Path(run_dir) / SNAPSHOTS_FILE, step)


# ------------------------------------------------------------------ the page

def write_report(run_dir, title: str = "training run", computed: list[dict] = ()) -> Path:
    """Builds `run_dir/report.html` from the run's files (`build_report`) and writes it
    atomically.

    Returns:
      The page's path.

    Raises:
      ValueError: see `build_report`.
      OSError: naming the page, when it cannot be written.
    """
    path = Path(run_dir) / REPORT_FILE
    write_text_atomically(path, build_report(run_dir, title, computed))
    return path


def build_report(run_dir, title: str = "training run", computed: list[dict] = ()) -> str:
    """The report page of the run in `run_dir`, as HTML text.

    Files not there yet (no evaluation before the run ends, no snapshot of an older run)
    leave their sections saying so. `computed`: `snapshot_record`s made by the caller for
    checkpoints the run recorded none of (shown, not written to the run's files); a step the
    run recorded is shown as recorded.

    Raises:
      ValueError: naming the file, when a run file is damaged (not valid JSON, or
        records of another shape than this library writes).
    """
    run_dir = Path(run_dir)
    about = read_about(run_dir)
    record = read_run_file(run_dir / CONFIG_FILE)
    metrics = read_metrics(run_dir / METRICS_FILE)
    by_step = {**{s["step"]: s for s in computed}, **{s["step"]: s for s in read_snapshots(run_dir)}}
    snapshots = [by_step[step] for step in sorted(by_step)]
    results = read_run_file(run_dir / RESULTS_FILE)
    with _reading(run_dir / METRICS_FILE):
        sections = [_curves_section(metrics, about)]
    with _reading(run_dir / SNAPSHOTS_FILE):
        sections.append(_attention_section(snapshots))
        if any(s.get("experts") for s in snapshots):
            sections.append(_experts_section(snapshots))
    with _reading(run_dir / RESULTS_FILE):
        sections.append(_evaluation_section(results))
    with _reading(run_dir / SNAPSHOTS_FILE):
        if any(s["samples"] for s in snapshots):
            sections.append(_samples_section(snapshots))
    with _reading(run_dir / ABOUT_FILE):
        sections.append(_run_section(about, record))
    name = (about or {}).get("program", title)
    title = html.escape(f"{name}: {run_dir.name}")
    built = datetime.now(timezone.utc).isoformat(timespec="seconds")
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>\n'
            f"<style>{_STYLE}</style></head>\n<body><h1>{title}</h1>\n" + "\n".join(sections)
            + f"\n<footer>Built {built} from the run's {ABOUT_FILE}, {CONFIG_FILE}, {METRICS_FILE}, {SNAPSHOTS_FILE} "
            f"and {RESULTS_FILE}.</footer>\n<script>{_SCRIPT}</script>\n</body></html>\n")
    return page


def read_about(run_dir) -> dict | None:
    """`about.json` (`record_session`), or None for a run without one.

    Raises:
      ValueError: naming the file, when it is damaged: see `read_run_file`, or its
        `program`, `settings` or `sessions` are not what `record_session` writes.
    """
    path = Path(run_dir) / ABOUT_FILE
    about = read_run_file(path)
    if about is None:
        return None
    sessions = about.get("sessions")
    if (not isinstance(about.get("program"), str) or not isinstance(about.get("settings"), dict)
            or not isinstance(sessions, list)
            or not all(isinstance(s, dict) and type(s.get("step")) is int for s in sessions)):
        raise ValueError(f"{path} does not hold a program, settings and sessions as this library writes them: "
                         "the file is damaged")
    return about


def check_run_files(run_dir) -> None:
    """Reads every record of a run that the page and a resumed run read, and builds the
    page from them without writing it, so that a damaged one is named before anything
    is written.

    Raises:
      ValueError: naming the first damaged file (and its line, for the JSON-lines ones).
    """
    build_report(run_dir)


@contextlib.contextmanager
def _reading(path: Path):
    """Names `path` when the records it gave cannot be drawn (a field of the wrong kind)."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(f"{path} holds a record the report page cannot read ({type(e).__name__}: {e}): the file "
                         "is damaged") from None


def _number(value, src: str, percent: bool = False) -> str:
    """A figure on the page, tagged with the record it comes from (NaN and inf as `nan`, `inf`)."""
    shown = f"{100 * value:.1f} %" if percent and math.isfinite(value) else _general(value)
    return f'<span class="num" data-src="{src}">{shown}</span>'


def _general(value) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def _table(header, rows) -> str:
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _run_section(about, record) -> str:
    parts = ['<section id="run"><h2>The run</h2>']
    if about is None:
        parts.append("<p>This run predates <code>about.json</code>: no device, parameter count or shape trace was "
                     "recorded. Its config:</p>")
    else:
        sessions = about["sessions"]
        where = "; ".join(f"from step {s['step']} on {html.escape(s['device'])} ({s['started']})" for s in sessions)
        parts.append(f"<p><b>{html.escape(about['program'])}</b>: {_number(about['params'], 'about/params')} "
                     f"parameters. Trained {where}.</p>")
        parts.append("<h3>Shape trace of one forward pass</h3>"
                     + _table(["stage", "shape", ""], [[html.escape(c) for c in row] for row in about["shape_trace"]]))
    tables = []
    if about is not None:
        tables.append("<div><h3>Settings</h3>" + _settings_table(about["settings"]) + "</div>")
    if record is not None:
        tables.append("<div><h3>Model config</h3>" + _settings_table(record.get("model", {})) + "</div>")
    parts.append('<div class="side">' + "".join(tables) + "</div>")
    return "\n".join(parts) + "</section>"


def _settings_table(settings: dict) -> str:
    return _table(["name", "value"], [(html.escape(k), html.escape(json.dumps(v))) for k, v in settings.items()])


def _curves_section(metrics, about) -> str:
    parts = ['<section id="curves"><h2>Training curves</h2>']
    if not metrics:
        return parts[0] + "<p>No metrics logged yet.</p></section>"
    resumes = [s["step"] for s in (about or {}).get("sessions", [])[1:]]
    # (name, label, whether the axis starts at 0: not for the loss, whose changes would be flattened)
    charts = [("loss", "training loss (nats per target token; DPO: per pair)", False),
              # Preference optimisation's: the rewards beta * (log pi - log pi_ref) of the chosen and the rejected
              # answers, their margin, and the share of pairs ranked right.
              ("rewards/chosen", "DPO: mean reward of the chosen answers", False),
              ("rewards/rejected", "DPO: mean reward of the rejected answers", False),
              ("rewards/margins", "DPO: mean margin, chosen reward - rejected reward", False),
              ("rewards/accuracies", "DPO: share of pairs whose chosen reward is higher", True),
              # Reinforcement learning's: the sampled completions' reward, its spread, and how far the policy moved.
              ("reward", "GRPO: mean reward of the step's completions", False),
              ("reward_std", "GRPO: spread (standard deviation) of the step's rewards", True),
              ("kl", "GRPO: KL divergence from the reference, per completion token", True),
              ("clip_ratio", "GRPO: share of completion tokens whose ratio was clipped", True),
              ("completion_length", "GRPO: mean completion length (tokens)", True),
              ("lr", "learning rate (per update)", True),
              ("steps_per_sec", "updates per second (the first includes compilation)", True)]
    for name, label, from_zero in charts:
        points = [(m["step"], m[name]) for m in metrics if name in m]
        if points:
            parts.append(_line_chart(name, label, points, resumes, from_zero))
    if resumes:
        parts.append(f"<p>Dashed lines: where the run was resumed (step{'s' if len(resumes) > 1 else ''} "
                     f"{', '.join(map(str, resumes))}).</p>")
    names = list(dict.fromkeys(n for m in metrics for n in m if n != "step"))  # each logged name, first seen first
    parts.append("<details><summary>Every logged value</summary>" + _table(
        ["step", *names], [[m["step"], *(_number(m[n], f"metrics/{m['step']}/{n}") if n in m else "" for n in names)]
                           for m in metrics]) + "</details>")
    return "\n".join(parts) + "</section>"


def _line_chart(name: str, label: str, points, resumes, from_zero: bool, width: int = 560, height: int = 220) -> str:
    """An SVG line chart of `(step, value)` points, each with its value as a tooltip.

    A value that is NaN or inf has no place on the y axis: the line breaks there, the axis
    spans the finite values alone, and a dotted grey line across the chart marks its step
    (with the value as its tooltip).
    """
    left, right, top, bottom = 70, 16, 12, 34
    steps = np.array([p[0] for p in points], np.float64)
    values = np.array([v for _, v in points if math.isfinite(v)], np.float64)  # [finite points]
    x0, x1 = 0.0, max(float(steps.max()), 1.0)
    y0, y1 = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
    if from_zero:
        y0 = min(y0, 0.0)
    if y1 - y0 < 1e-12 * max(abs(y1), 1.0):  # a flat line: give it room
        y0, y1 = y0 - 0.5 * abs(y0 or 1.0), y1 + 0.5 * abs(y1 or 1.0)

    def x(s):
        return left + (s - x0) / (x1 - x0) * (width - left - right)

    def y(v):
        return height - bottom - (v - y0) / (y1 - y0) * (height - top - bottom)

    out = [f'<figure class="chart"><svg width="{width}" height="{height}" role="img" aria-label="{label}">']
    for tick in _ticks(y0, y1):
        out.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y(tick):.1f}" y2="{y(tick):.1f}"/>'
                   f'<text class="tick" x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:.3g}</text>')
    for tick in _ticks(x0, x1):
        out.append(f'<text class="tick" x="{x(tick):.1f}" y="{height - bottom + 16}" text-anchor="middle">'
                   f'{tick:g}</text>')
    for step in resumes:
        out.append(f'<line class="resume" x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{top}" y2="{height - bottom}"/>')
    for run in _finite_runs(points):
        out.append('<polyline class="line" points="' + " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in run) + '"/>')
    for s, v in points:
        tooltip = f'<title data-src="metrics/{s}/{name}">step {s}: {_general(v)}</title>'
        if math.isfinite(v):
            out.append(f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5">{tooltip}</circle>')
        else:
            out.append(f'<line class="nonfinite" x1="{x(s):.1f}" x2="{x(s):.1f}" y1="{top}" y2="{height - bottom}">'
                       f"{tooltip}</line>")
    gaps = "" if values.size == len(points) else " (dotted grey: a value that was NaN or inf)"
    out.append(f'<text class="axis" x="{(left + width - right) / 2}" y="{height - 4}" text-anchor="middle">'
               f'step (updates)</text></svg><figcaption>{label}{gaps}</figcaption></figure>')
    return "".join(out)


def _finite_runs(points) -> list[list]:
    """`(step, value)` points split at each NaN or infinite value: the runs of finite ones
    that one stretch of line joins."""
    runs = [[]]
    for s, v in points:
        if math.isfinite(v):
            runs[-1].append((s, v))
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values spanning `[low, high]`: steps of 1, 2 or 5 times a power of ten."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _evaluation_section(results) -> str:
    parts = ['<section id="evaluation"><h2>Evaluation</h2>']
    if results is None:
        return parts[0] + "<p>Not evaluated yet: the evaluation runs when training ends.</p></section>"
    labels = _labels(results)
    scalars = [(html.escape(shown["label"]), _number(results[key], f"eval/{key}", shown["kind"] == "rate"))
               for key, shown in labels.items() if shown["kind"] in ("number", "rate")]
    parts.append(_table(["", ""], scalars))
    for key, shown in labels.items():
        value, title = results[key], html.escape(shown["label"])
        if shown["kind"] == "per_length":
            lengths = sorted(value, key=int)
            parts.append(f"<h3>{title}</h3>" + _table(
                ["length", "rate", "sequences"],
                [(length, _number(value[length][0], f"eval/{key}/{length}/rate", percent=True),
                  _number(value[length][1], f"eval/{key}/{length}/n")) for length in lengths]))
        elif shown["kind"] == "examples" and value:
            parts.append(f'<h3>{title}</h3><p>Tokens that differ from the target are <span class="wrong">marked'
                         "</span>.</p>" + _table(
                             ["", "input", "target", "output"],
                             [(html.escape(e["label"]), _tokens(e["input"]), _tokens(e["target"]),
                               _tokens(e["output"], e["target"])) for e in value]))
        elif shown["kind"] == "text":
            parts.append(f'<h3>{title}</h3><pre class="sample">{html.escape(value)}</pre>')
    return "\n".join(parts) + "</section>"


def _labels(results: dict) -> dict[str, dict]:
    """Each result's label (`result_label`), as eval.json records them. A run written
    before eval.json held labels is shown by its keys, each as its value's shape gives:
    a number, a per-length table, examples or a text."""
    if LABELS in results:
        labels = results[LABELS]
        for key, shown in labels.items():
            if key not in results or shown["kind"] not in RESULT_KINDS or not isinstance(shown["label"], str):
                raise ValueError(f"the label of {key!r} is not one this library writes")
        return labels
    kinds = ((key, "number" if isinstance(value, (int, float)) else "per_length" if isinstance(value, dict)
              else "examples" if isinstance(value, list) else "text") for key, value in results.items())
    return {key: result_label(key, kind) for key, kind in kinds}


def _tokens(tokens, target=None) -> str:
    """Tokens as text; with a target, each one that differs from it (or runs past it) marked."""
    cells = []
    for i, token in enumerate(tokens):
        wrong = target is not None and (i >= len(target) or token != target[i])
        cells.append(f'<span class="{"tok wrong" if wrong else "tok"}">{html.escape(str(token))}</span>')
    if target is not None and len(tokens) < len(target):
        cells.append('<span class="tok wrong">(missing)</span>')
    return " ".join(cells)


def _attention_section(snapshots) -> str:
    parts = ['<section id="attention"><h2>Attention during training</h2>']
    shown = [s for s in snapshots if s["attention"]]
    if not shown:
        return parts[0] + "<p>No snapshots recorded yet.</p></section>"
    parts.append(
        "<p>Every layer and head on one example: rows are the queries (the token being produced), columns the "
        "keys it may read; colour is the attention weight, "
        '<span class="swatch low"></span> 0 to <span class="swatch high"></span> 1 '
        '(<span class="swatch nonfinite"></span> grey: NaN or inf, a model whose numbers stopped being finite). '
        "Move the slider to see the maps at each recorded step.</p>")
    last = len(shown) - 1
    parts.append(_slider("step", shown))
    for index, snapshot in enumerate(shown):
        hidden = "" if index == last else " hidden"
        parts.append(f'<div class="snapshot" data-step="{snapshot["step"]}"{hidden}>')
        for group in snapshot["attention"]:
            heads = "".join(_heatmap(weights, group["rows"], group["cols"], f"head {h}")
                            for h, weights in enumerate(group["heads"]))
            note = f'<p class="note">{html.escape(group["note"])}</p>' if group.get("note") else ""
            parts.append(f'<h3>{html.escape(group["name"])}, layer {group["layer"]}</h3>{note}<div class="heads">'
                         f"{heads}</div>")
        parts.append("</div>")
    return "\n".join(parts) + "</section>"


def _slider(name: str, shown: list[dict]) -> str:
    """A section's step slider over its snapshots `shown` (the page's script shows the one chosen,
    the last at first): `{name}-slider`, its label `{name}-label`."""
    last, steps = len(shown) - 1, [str(s["step"]) for s in shown]
    return (f'<div class="slider"><label for="{name}-slider">step</label> <input type="range" id="{name}-slider" '
            f'min="0" max="{last}" value="{last}" step="1"> <output id="{name}-label">{steps[-1]}</output> '
            f'<span class="steps" id="{name}-list" data-steps="{",".join(steps)}">({len(shown)} snapshots: steps '
            f'{", ".join(steps)})</span></div>')


def expert_shares(counts) -> np.ndarray:
    """`[E]` float64: each expert's share of a layer's pairs, `counts / sum(counts)` (0 where none)."""
    counts = np.asarray(counts, np.float64)
    return counts / max(counts.sum(), 1.0)


def _experts_section(snapshots) -> str:
    shown = [s for s in snapshots if s.get("experts")]
    parts = ['<section id="experts"><h2>Expert load during training</h2>',
             "<p>Each layer of experts: the share of its router's (token, choice) pairs that went to each expert, "
             "a token's k choices each one pair. An even load gives each of E experts 1/E of them. Colour: the "
             'share against an even one, <span class="swatch low"></span> none to <span class="swatch high"></span> '
             'twice or more (<span class="swatch nonfinite"></span> grey: no such expert in that layer). Move the '
             "slider to see the load at each recorded step.</p>", _slider("load", shown)]
    for index, snapshot in enumerate(shown):
        groups, step = snapshot["experts"], snapshot["step"]
        hidden = "" if index == len(shown) - 1 else " hidden"
        width = max(len(g["counts"]) for g in groups)
        grid = np.full((len(groups), width), np.nan)  # [layers, experts]: share / (1 / E), NaN past a layer's E
        for row, group in enumerate(groups):
            grid[row, :len(group["counts"])] = expert_shares(group["counts"]) * len(group["counts"]) / 2
        rows = [f"layer {g['layer']}" for g in groups]
        notes = "".join(f'<p class="note">{html.escape(note)}</p>'
                        for note in dict.fromkeys(g.get("note", "") for g in groups) if note)
        table = _table(["layer", "pairs", *(f"expert {e}" for e in range(width))], [
            (g["layer"], f"{sum(g['counts']):,}",
             *(_number(share, f"snapshots/{step}/experts/{g['layer']}/{e}", percent=True)
               for e, share in enumerate(expert_shares(g["counts"]))), *[""] * (width - len(g["counts"])))
            for g in groups])
        drawn = _heatmap(grid, rows, [str(e) for e in range(width)], f"step {step}: layers by experts")
        parts.append(f'<div class="snapshot" data-load-step="{step}"{hidden}>{notes}<div class="heads">{drawn}</div>'
                     f"<details><summary>The shares</summary>{table}</details></div>")
    return "\n".join(parts) + "</section>"


def _heatmap(weights, rows, cols, caption: str) -> str:
    """One map: the weights as a PNG (one pixel a cell, scaled without smoothing) with the
    labels (tokens, layers, experts) along the axes."""
    weights = np.asarray(weights, np.float64)
    cell = max(8, min(26, 300 // max(len(rows), len(cols))))  # pixels a cell; 8 keeps a label legible
    font = min(11, cell - 1)
    margin = 8 + font * max(len(str(t)) for t in (*rows, *cols)) * 0.62
    w, h = len(cols) * cell, len(rows) * cell
    image = base64.b64encode(png_bytes(colormap(weights))).decode("ascii")
    out = [f'<figure class="map"><svg width="{margin + w + 4:.0f}" height="{margin + h + 4:.0f}">'
           f'<image x="{margin:.0f}" y="{margin:.0f}" width="{w}" height="{h}" preserveAspectRatio="none" '
           f'href="data:image/png;base64,{image}"/>']
    for i, token in enumerate(rows):
        out.append(f'<text x="{margin - 3:.0f}" y="{margin + (i + 0.5) * cell + font * 0.35:.1f}" '
                   f'font-size="{font}" text-anchor="end">{html.escape(token)}</text>')
    for j, token in enumerate(cols):
        cx, cy = margin + (j + 0.5) * cell + font * 0.35, margin - 3
        out.append(f'<text x="{cx:.1f}" y="{cy:.0f}" font-size="{font}" transform="rotate(-90 {cx:.1f} {cy:.0f})">'
                   f'{html.escape(token)}</text>')
    out.append(f"</svg><figcaption>{caption}</figcaption></figure>")
    return "".join(out)


def _samples_section(snapshots) -> str:
    parts = ['<section id="samples"><h2>Samples during training</h2>']
    for snapshot in snapshots:
        for sample in snapshot["samples"]:
            output, target = sample["output"], sample.get("target")
            text = (_tokens(output, target) if isinstance(output, list)
                    else f'<pre class="sample">{html.escape(output)}</pre>')
            parts.append(f'<div class="sample-row"><b>step {snapshot["step"]}</b>, {html.escape(sample["label"])}: '
                         f"{text}</div>")
    return "\n".join(parts) + "</section>"


# ------------------------------------------------------------------ images

def colormap(weights) -> np.ndarray:
    """`[rows, cols]` weights in [0, 1] as `[rows, cols, 3]` uint8 viridis colours
    (interpolated between 17 samples of the map; values outside [0, 1] are clipped, and
    NaN or inf is the neutral grey `_NONFINITE_RGB`)."""
    weights = np.asarray(weights, np.float64)
    finite = np.isfinite(weights)  # [rows, cols]
    position = np.clip(np.where(finite, weights, 0.0), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    low = np.minimum(np.floor(position).astype(int), len(_VIRIDIS) - 2)
    frac = (position - low)[..., None]
    rgb = np.round(_VIRIDIS[low] * (1 - frac) + _VIRIDIS[low + 1] * frac).astype(np.uint8)  # [rows, cols, 3]
    return np.where(finite[..., None], rgb, _NONFINITE_RGB)


def png_bytes(rgb) -> bytes:
    """An 8-bit RGB PNG of a `[height, width, 3]` uint8 array.

    The format: a signature, then chunks `length | type | data | CRC-32(type + data)`:
    IHDR (size, bit depth 8, colour type 2 = RGB), IDAT (the rows, each after a filter
    byte 0 = none, deflated with zlib), IEND.
    """
    rgb = np.ascontiguousarray(rgb, np.uint8)
    height, width, _ = rgb.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + rgb[i].tobytes() for i in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


# ------------------------------------------------------------------ the page's frame

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px; padding: 0 16px; color: #222; }
h1 { font-size: 22px; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 6px 0; }
td, th { border: 1px solid #ddd; padding: 2px 8px; text-align: left; }
.chart { display: inline-block; margin: 4px 12px 12px 0; } .chart figcaption { text-align: center; color: #444; }
.line { fill: none; stroke: #3b528b; stroke-width: 1.5; } circle { fill: #3b528b; }
.grid { stroke: #eee; } .tick, .axis { font-size: 11px; fill: #555; } .resume { stroke: #c33; stroke-dasharray: 4 3; }
.side { display: flex; flex-wrap: wrap; gap: 32px; align-items: flex-start; }
.heads { display: flex; flex-wrap: wrap; gap: 6px; }
.map { margin: 0; } .map figcaption { text-align: center; font-size: 12px; color: #444; }
.map image { image-rendering: pixelated; } .map text { fill: #333; font-family: monospace; }
.tok { font-family: monospace; } .wrong { background: #f6c4c4; color: #900; font-weight: bold; }
.swatch { display: inline-block; width: 12px; height: 12px; vertical-align: middle; }
.swatch.low { background: rgb(68, 1, 84); } .swatch.high { background: rgb(253, 231, 37); }
.swatch.nonfinite { background: rgb(190, 190, 190); } .nonfinite { stroke: #999; stroke-dasharray: 1 3; }
.slider { position: sticky; top: 0; background: #fff; padding: 6px 0; z-index: 1; }
.slider input { width: 360px; vertical-align: middle; } .steps { color: #666; }
.note { color: #555; margin: 0 0 4px; }
pre.sample { white-space: pre-wrap; background: #f6f6f6; padding: 8px; }
.sample-row { margin: 4px 0; } footer { margin-top: 32px; color: #777; font-size: 12px; }
"""

_SCRIPT = """
(function () {
  document.querySelectorAll(".slider").forEach(function (bar) {
    var slider = bar.querySelector("input");
    var label = bar.querySelector("output");
    var snapshots = bar.parentNode.querySelectorAll(".snapshot");
    function show() {
      var chosen = Number(slider.value);
      snapshots.forEach(function (s, i) { s.hidden = i !== chosen; });
      label.textContent = snapshots[chosen].dataset.step || snapshots[chosen].dataset.loadStep;
    }
    slider.addEventListener("input", show);
    show();
  });
})();
"""
