"""The metrics log of a run: `metrics.jsonl`, one JSON object per logged step."""

from __future__ import annotations

import json
from pathlib import Path

from jaxformer.files import write_text_atomically

METRICS_FILE = "metrics.jsonl"


def read_metrics(path) -> list[dict]:
    """The records of a metrics file, in file order.

    A line counts once its newline is written: a last line torn by a crash mid-write is
    ignored, not an error.

    Args:
      path: the metrics file (`run_dir / METRICS_FILE`).

    Returns:
      One dict per line (`[]` if the file does not exist).
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n") and line.strip():
            records.append(json.loads(line))
    return records


def drop_records_after(path, step: int) -> None:
    """Rewrites a JSON-lines file (atomically) without its records whose step is above
    `step`; a missing file stays missing.

    Args:
      path: a file of `{"step": int, ...}` lines.
      step: the last step to keep.
    """
    path = Path(path)
    if path.exists():
        keep = [r for r in read_metrics(path) if r["step"] <= step]
        write_text_atomically(path, "".join(json.dumps(r) + "\n" for r in keep))


class MetricsLog:
    """A JSON-lines metrics file: one `{"step": int, name: float, ...}` object a line.

    Lines are appended and flushed as they are written, so a crashed run keeps every
    line up to the crash.

    Args:
      path: the file; created (with its directory) if missing, appended to otherwise.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def write(self, step: int, **values) -> None:
        """Appends one line.

        Args:
          step: the updates done when the values were taken.
          **values: the metrics, each written as a float.
        """
        record = {"step": int(step), **{name: float(v) for name, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def truncate_after(self, step: int) -> None:
        """Drops the lines with a step above `step`.

        On resume from checkpoint s the interrupted run's lines after s describe updates
        that are about to be redone; dropping them keeps each step logged once.

        Args:
          step: the last step to keep.
        """
        self._file.close()
        drop_records_after(self.path, step)
        self._file = open(self.path, "a")

    def close(self) -> None:
        """Closes the file."""
        self._file.close()
