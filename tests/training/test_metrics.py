"""`jaxformer.training.metrics`: the JSON-lines log, truncated on resume, read back."""

import numpy as np
import pytest

from jaxformer.training import MetricsLog, read_metrics


def test_metrics_log_truncate_and_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    for step in range(1, 7):
        log.write(step, loss=np.float32(1.0 / step), lr=0.1)
    assert read_metrics(path)[2] == {"step": 3, "loss": pytest.approx(1 / 3), "lr": 0.1}
    log.truncate_after(4)
    log.write(5, loss=0.5)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    assert read_metrics(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize("line, message", [("{oops}", "line 2 is not valid JSON"),
                                           ('{"loss": 1.0}', "line 2 is not a record with an integer step"),
                                           ("[1, 2]", "line 2 is not a record with an integer step")])
def test_a_damaged_line_is_named(tmp_path, line, message):
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 1, "loss": 2.0}}\n{line}\n{{"step": 3, "loss": 1.0}}\n')
    with pytest.raises(ValueError, match=f"{path} {message}"):
        read_metrics(path)
