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
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # torn by a crash mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5]
    assert read_metrics(tmp_path / "missing.jsonl") == []
