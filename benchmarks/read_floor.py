"""The machine's floor for reading weights, measured without XLA: how fast plain code streams
through a buffer the size of a model's weights, which a decode step at batch 1 reads once.

    python -m benchmarks.read_floor [--bytes 4.9e9] [--threads 2] [--reps 3]

Each of `threads` Python threads reduces its slice of the buffer with a numpy ufunc that releases
the GIL (`np.maximum.reduce` over uint64 words); the slices are read at once, as a decode step's
threads read theirs. On a 2-core AMD EPYC (Zen 4) virtual machine, maximum, add, xor and or read
one buffer alike (within 5% of each other), and a C loop of AVX-512 loads over 2 MiB pages reads
in the same range; the figure moves more from one buffer (and process) to the next, mostly 28 to
35 GB/s on 2 threads, now and then above 50. The buffer is written first, so that every page is
the process's own (a freshly mapped zero page reads from no memory at all).
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from jaxformer.validation import as_int


def read_seconds(slices: list[np.ndarray]) -> float:
    """Wall time of one pass: each slice reduced on a thread of its own, all at once."""
    threads = [threading.Thread(target=np.maximum.reduce, args=(part,)) for part in slices]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def read_bandwidth(nbytes: int, threads: int = 2, reps: int = 3) -> float:
    """Bytes per second a plain streaming read of an `nbytes` buffer reaches on `threads` threads:
    the best of `reps` passes after one warm pass.

    Raises:
      ValueError: `nbytes` under 8 per thread, `threads` or `reps` under 1 (naming the argument).
    """
    as_int(threads, "threads", minimum=1)
    as_int(reps, "reps", minimum=1)
    as_int(nbytes, "nbytes", minimum=8 * threads)
    words = np.ones(nbytes // 8, np.uint64)  # [nbytes / 8]: written, so every page is resident
    slices = np.array_split(words, threads)
    read_seconds(slices)
    return words.nbytes / min(read_seconds(slices) for _ in range(reps))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.read_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=float, default=4.9e9, help="the buffer's size (default: the 1B's float32 weights)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    bandwidth = read_bandwidth(int(args.bytes), args.threads, args.reps)
    print(f"{bandwidth / 1e9:.1f} GB/s reading {args.bytes / 1e9:.2f} GB on {args.threads} threads")


if __name__ == "__main__":
    main()
