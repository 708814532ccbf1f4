"""A one-line progress bar for a training loop."""

from __future__ import annotations

import sys

from jaxformer.validation import as_int


class ProgressBar:
    """`step/total [####....] loss 1.2345 ...` on stderr, redrawn in place on a terminal;
    elsewhere (where carriage returns would pile up) a plain line every `every` steps and at the end.

    Args:
      total: the last step.
      initial: the step the bar starts from (a resumed run's restored step).
      every: steps between plain lines when not on a terminal; default `total // 10`.
      stream: where to write; default `sys.stderr`.
    """

    WIDTH = 24

    def __init__(self, total: int, initial: int = 0, *, every: int | None = None, stream=None):
        self.total = as_int(total, "ProgressBar total", minimum=1)
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = getattr(self.stream, "isatty", lambda: False)()
        self.every = every if every is not None else max(1, total // 10)
        self._shown = initial  # the last step drawn or printed
        self._drawn = 0  # width of the line on a terminal, to blank a longer old one

    def update(self, step: int, **values) -> None:
        """Shows `step` (the updates done) and `values` (loss, lr, steps_per_sec, any scalar), in order."""
        line = self._format(step, values)
        if self.is_tty:
            self.stream.write("\r" + line.ljust(self._drawn))
            self._drawn = len(line)
        elif step // self.every != self._shown // self.every or step == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._shown = step

    def close(self) -> None:
        """Ends the redrawn line, so what follows starts on a line of its own."""
        if self.is_tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0

    def _format(self, step: int, values: dict) -> str:
        filled = round(self.WIDTH * min(step, self.total) / self.total)
        parts = [f"{step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (self.WIDTH - filled)}]"]
        for name, v in values.items():
            if name == "lr":
                parts.append(f"lr {v:.2e}")
            elif name == "steps_per_sec":
                parts.append(f"{v:.1f} steps/s")
            else:
                parts.append(f"{name} {v:.4f}")
        return "  ".join(parts)
