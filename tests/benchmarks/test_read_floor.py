"""`benchmarks.read_floor`: the best of its passes over the whole buffer, split across the threads,
after one warm pass; its arguments checked before anything is allocated."""

import numpy as np
import pytest

from benchmarks import read_floor


def test_the_bandwidth_is_the_whole_buffer_over_the_best_pass_after_a_warm_one(monkeypatch):
    passes, times = [], iter([100.0, 2.0, 0.5, 4.0])  # the warm pass first: not counted

    def timed(slices):
        passes.append([(part.dtype, part.size) for part in slices])
        return next(times)

    monkeypatch.setattr(read_floor, "read_seconds", timed)
    assert read_floor.read_bandwidth(8 * 1001, threads=3, reps=3) == 8 * 1001 / 0.5
    assert passes == [[(np.uint64, 334), (np.uint64, 334), (np.uint64, 333)]] * 4  # each word read once a pass


def test_a_pass_reads_every_slice_on_a_thread_of_its_own():
    assert read_floor.read_seconds(np.array_split(np.ones(1 << 16, np.uint64), 2)) > 0
    assert read_floor.read_bandwidth(1 << 20, threads=2, reps=1) > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(nbytes=8, threads=2), "nbytes"), (dict(nbytes=64, threads=0), "threads"),
    (dict(nbytes=64, reps=0), "reps")])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        read_floor.read_bandwidth(**kwargs)


def test_the_command_prints_the_bandwidth(capsys):
    read_floor.main(["--bytes", "1e6", "--threads", "2", "--reps", "1"])
    assert capsys.readouterr().out.endswith(" GB/s reading 0.00 GB on 2 threads\n")
