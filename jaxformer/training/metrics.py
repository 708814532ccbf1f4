"""The metrics log of a run: `metrics.jsonl`, one JSON object per logged step."""

from __future__ import annotations

import json
from pathlib import Path

from jaxformer.files import append_line, write_text_atomically

METRICS_FILE = "metrics.jsonl"


def read_metrics(path) -> list[dict]:
    """The records of a metrics file, one dict a line in file order (`[]` for no file).

    A last line torn by a crash is ignored.

    Args:
      path: the metrics file (`run_dir / METRICS_FILE`).

    Raises:
      ValueError: naming the file and the line that is not a record with an integer `step`.
    """
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if line.endswith("\n") and line.strip():
            records.append(_record(path, number, line))
    return records


def _record(path: Path, number: int, line: str) -> dict:
    """Line `number` of a JSON-lines file of step records, checked."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {number} is not valid JSON ({e.msg}): the file is damaged; "
                         "remove that line to use the rest") from None
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        raise ValueError(f"{path} line {number} is not a record with an integer step: the file is damaged; "
                         "remove that line to use the rest")
    return record


def drop_records_after(path, step: int) -> None:
    """Rewrites a JSON-lines file of `{"step": int, ...}` records atomically without those past
    `step`; a missing file stays missing.
    """
    path = Path(path)
    if path.exists():
        keep = [r for r in read_metrics(path) if r["step"] <= step]
        write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in keep))


class MetricsLog:
    """A JSON-lines metrics file (created with its directory), one `{"step": int, name: float}`
    object a line, each appended whole (`jaxformer.files.append_line`).
    """

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, **values) -> None:
        """Appends the line of `step` (the updates done), each of `values` as a float.

        Raises:
          OSError: naming the file, when the line could not be written (it is not kept).
        """
        record = {"step": int(step), **{name: float(v) for name, v in values.items()}}
        append_line(self.path, json.dumps(record))

    def truncate_after(self, step: int) -> None:
        """Drops the lines past `step`: on resume, their updates are about to be redone."""
        drop_records_after(self.path, step)
