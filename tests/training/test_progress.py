"""`jaxformer.training.progress`: the progress bar off a terminal."""

import io

from jaxformer.training import ProgressBar


def test_progress_bar_prints_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = ProgressBar(100, initial=0, every=25, stream=out)
    for step in range(10, 101, 10):
        bar.update(step, loss=2.0 / step, lr=1e-3, steps_per_sec=12.34)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split("/")[0].strip() for line in lines] == ["30", "50", "80", "100"]
    assert lines[-1].startswith("100/100 [" + "#" * ProgressBar.WIDTH + "]")
    assert "loss 0.0200" in lines[-1] and "lr 1.00e-03" in lines[-1] and "12.3 steps/s" in lines[-1]
