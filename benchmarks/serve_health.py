"""How long `GET /health` takes while one hostile request runs on `jaxformer-serve`,
against the same server idle: one request must not hold up the event loop that answers all.

    python -m benchmarks.serve_health [--rounds 5] [--polls 200] [--out serve_health.json]

The model and its tokenizer are `benchmarks.serve`'s (random weights, made here; default
d_model 256, 4 layers, max_seq_len 256). The server is started once on a free loopback port.
Then, in turn, /health is polled `--polls` times from one client with nothing else running
(idle), and as often as it answers while a client sends each hostile request `--rounds`
times, one after another:

  stop strings   a completion of 32 greedy tokens with four stop strings of 250,000
                 characters (just under the 1 MiB body limit), one of them the completion's
                 own text and then more, so that the whole text is held back to the end
  long prompt    a prompt of 1 MiB of words, which the server tokenizes, then refuses (400)
                 as longer than max_seq_len
  nested JSON    a body of 100,000 nested arrays (200 KB), refused (400)

Per case: /health's latency p50, p99 and max (ms), the hostile request's own time (s, p50),
and the ratio of /health's max there to its max idle, measured in this run. The issue's
bound is a max under 100 ms.

JSON fields: `machine`, `settings`, `model`, `rows` (one per case: `case`, `health_ms`
{p50, p99, max}, `polls`, `request_s` (p50), `statuses` (the hostile request's HTTP
statuses), `max_vs_idle`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks import serve

STOP_CHARS = 250_000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="each hostile request, sent one after another")
    p.add_argument("--polls", type=int, default=200, help="/health requests of the idle baseline")
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default="serve_health.json")
    args = p.parse_args(argv)
    # The model's other sizes, and the flags `jaxformer_command` reads, as benchmarks.serve has them.
    defaults = serve.parse_args([])
    for name in ("vocab_size", "words", "heads", "kv_heads", "prefill_chunk"):
        setattr(args, name, getattr(defaults, name))
    return args


def cases(url: str, name: str, words: list[str]) -> dict:
    """`{case: body}`: each hostile request, as JSON or as raw bytes."""
    base = {"model": name, "prompt": " ".join(words[:8]), "max_tokens": 32, "temperature": 0}
    text = httpx.post(url + "/v1/completions", json=base, timeout=300).json()["choices"][0]["text"]
    stops = [text + "~" * STOP_CHARS, "~" * STOP_CHARS, "ab" * (STOP_CHARS // 2), "q" * STOP_CHARS]
    long_prompt = " ".join(words[i % len(words)] for i in range(1 << 20))[:(1 << 20) - 200]
    return {"stop strings": {**base, "stop": stops},
            "long prompt": {**base, "prompt": long_prompt},
            "nested JSON": b"[" * 100_000 + b"]" * 100_000}


def percentiles(values: list[float]) -> dict:
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)), "max": max(values)}


def health_ms(client: httpx.Client) -> float:
    """One /health round trip (ms), on a kept-alive connection: the server's time, not a new client's."""
    started = time.perf_counter()
    client.get("/health").raise_for_status()
    return (time.perf_counter() - started) * 1e3


def under(url: str, client: httpx.Client, body, rounds: int) -> tuple[list[float], list[float], list[int]]:
    """/health's latencies (ms) while `body` is sent `rounds` times; the request's times and statuses."""
    seconds, statuses, done = [], [], threading.Event()

    def send():
        for _ in range(rounds):
            started = time.perf_counter()
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            statuses.append(httpx.post(url + "/v1/completions", timeout=300, **kwargs).status_code)
            seconds.append(time.perf_counter() - started)
        done.set()

    thread = threading.Thread(target=send)
    thread.start()
    latencies = [health_ms(client)]
    while not done.is_set():
        latencies.append(health_ms(client))
    thread.join()
    return latencies, seconds, statuses


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-health-") as work:
        folder = str(Path(work) / "model")
        _, words, model = serve.make_checkpoint(folder, args)
        port = serve.free_port()
        url = f"http://127.0.0.1:{port}"
        with serve.running(serve.jaxformer_command(folder, port, 8, args), port, Path(work) / "server.log", 600), \
                httpx.Client(base_url=url, timeout=30) as client:
            name = client.get("/v1/models").json()["data"][0]["id"]
            hostile = cases(url, name, words)
            for body in hostile.values():  # (a first round of each compiles what it needs)
                under(url, client, body, 1)
            idle = [health_ms(client) for _ in range(args.polls)]
            rows = [{"case": "idle", "health_ms": percentiles(idle), "polls": len(idle), "request_s": None,
                     "statuses": [], "max_vs_idle": 1.0}]
            for case, body in hostile.items():
                latencies, seconds, statuses = under(url, client, body, args.rounds)
                rows.append({"case": case, "health_ms": percentiles(latencies), "polls": len(latencies),
                             "request_s": float(np.median(seconds)), "statuses": statuses,
                             "max_vs_idle": max(latencies) / max(idle)})
    print(f"/health while one hostile request runs ({model['params'] / 1e6:.1f} M params, "
          f"{serve.machine()['cpu']}, {serve.machine()['cpu_count']} cores)")
    print(f"  {'case':14} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'polls':>6} {'request s':>10} "
          f"{'max/idle':>9}  statuses")
    for row in rows:
        h = row["health_ms"]
        request = "" if row["request_s"] is None else f"{row['request_s']:.3f}"
        print(f"  {row['case']:14} {h['p50']:8.2f} {h['p99']:8.2f} {h['max']:8.2f} {row['polls']:6d} {request:>10} "
              f"{row['max_vs_idle']:8.1f}x  {sorted(set(row['statuses']))}")
    result = {"machine": serve.machine(), "settings": vars(args), "model": model, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
