"""What the server has done, for `GET /metrics` in Prometheus' text format (version 0.0.4):
requests by route and status, tokens in and out, the engine's running and waiting rows,
and histograms of the time to the first token and of the time per token after it.

Counted by the app (`CountRequests`, an ASGI wrapper, and `Run`); read by a scraper. One
lock guards the figures: the event loop writes them, a scrape reads them.
"""

from __future__ import annotations

import bisect
import threading

# Seconds: from a millisecond (a step of a tiny model) to a minute (a long queue).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "jaxformer"


class Histogram:
    """Observations counted into cumulative buckets `le` (each also counts those below), with
    their count and sum, as Prometheus reads a histogram."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # per bucket, not yet cumulative
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # the first bucket whose bound is >= value
        if i < len(self.buckets):
            self.counts[i] += 1
        self.count += 1
        self.sum += value

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """The server's counters and histograms; `text(load)` is the page a scraper reads."""

    def __init__(self, routes: tuple[str, ...]):
        self.routes = routes  # paths counted by name; any other is counted as "other"
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, int], int] = {}
        self._prompt_tokens = self._completion_tokens = 0
        self._first_token, self._per_token = Histogram(), Histogram()

    def request(self, path: str, status: int) -> None:
        """One answered request of `path` with HTTP `status`."""
        key = (path if path in self.routes else "other", status)
        with self._lock:
            self._requests[key] = self._requests.get(key, 0) + 1

    def tokens(self, prompt: int = 0, completion: int = 0) -> None:
        with self._lock:
            self._prompt_tokens += prompt
            self._completion_tokens += completion

    def first_token(self, seconds: float) -> None:
        """From a request's submission to its first token."""
        with self._lock:
            self._first_token.observe(seconds)

    def per_token(self, seconds: float, count: int = 1) -> None:
        """`count` tokens that came `seconds` after the ones before them: each observed at `seconds / count`."""
        with self._lock:
            for _ in range(count):
                self._per_token.observe(seconds / count)

    def text(self, load: dict) -> str:
        """The exposition: these figures, and the engine's `load()` (running and waiting rows)."""
        p = PREFIX
        with self._lock:
            lines = [f"# HELP {p}_requests_total HTTP requests answered, by route and status.",
                     f"# TYPE {p}_requests_total counter"]
            lines += [f'{p}_requests_total{{route="{route}",status="{status}"}} {n}'
                      for (route, status), n in sorted(self._requests.items())]
            lines += [f"# HELP {p}_prompt_tokens_total Prompt tokens of the requests the engine took.",
                      f"# TYPE {p}_prompt_tokens_total counter", f"{p}_prompt_tokens_total {self._prompt_tokens}",
                      f"# HELP {p}_completion_tokens_total Tokens the model made for answers.",
                      f"# TYPE {p}_completion_tokens_total counter",
                      f"{p}_completion_tokens_total {self._completion_tokens}",
                      f"# HELP {p}_time_to_first_token_seconds From a request's submission to its first token.",
                      f"# TYPE {p}_time_to_first_token_seconds histogram",
                      *self._first_token.lines(f"{p}_time_to_first_token_seconds"),
                      f"# HELP {p}_time_per_output_token_seconds Between a request's tokens, after the first.",
                      f"# TYPE {p}_time_per_output_token_seconds histogram",
                      *self._per_token.lines(f"{p}_time_per_output_token_seconds")]
        lines += [f"# HELP {p}_running_requests Requests holding an engine row.",
                  f"# TYPE {p}_running_requests gauge", f"{p}_running_requests {load['running']}",
                  f"# HELP {p}_waiting_requests Requests queued for a row.",
                  f"# TYPE {p}_waiting_requests gauge", f"{p}_waiting_requests {load['waiting']}"]
        prefill = load["prefill"]

        def figure(name: str, kind: str, about: str, value) -> list[str]:
            return [f"# HELP {p}_{name} {about}", f"# TYPE {p}_{name} {kind}", f"{p}_{name} {value}"]

        lines += [*figure("prefix_cache_queries_total", "counter", "Prompts started (each looked up).",
                          prefill["prompts"]),
                  *figure("prefix_cache_hits_total", "counter", "Prompts that began from a cached prefix.",
                          prefill["prefix_hits"]),
                  *figure("prefix_cache_cached_tokens_total", "counter", "Prompt tokens copied from the prefix cache.",
                          prefill["cached_tokens"]),
                  *figure("prefill_tokens_total", "counter", "Prompt tokens the model ran (not copied).",
                          prefill["prefilled_tokens"]),
                  *figure("prefix_cache_bytes", "gauge", "Memory the prefix cache's entries hold.",
                          load["prefix_cache"]["bytes"])]
        return "\n".join(lines) + "\n"


class CountRequests:
    """An ASGI wrapper counting each HTTP request by path and the status it was answered with
    (500 for one that ended without answering)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.request(scope["path"], status[0])
