"""OpenAI-compatible serving: jaxformer's continuous batching against one request at a time
and against `transformers serve --continuous-batching`, over HTTP.

    python -m benchmarks.serve [--clients 1 4 16] [--requests 32] [--d-model 256] [--layers 4]
                               [--max-seq-len 256] [--endpoint completions] [--out serve.json]

The model is made here, nothing is downloaded: a Llama-shaped decoder (default d_model
256, 4 layers, 4 heads, 2 kv heads, SwiGLU 704, untied: 3.5 M parameters), random-
initialised, and a byte-level BPE tokenizer (`jaxformer.text.train_bpe`, `--vocab-size`
1024, the model's vocabulary too) trained on a text of made-up words that this script
writes; both go into one Hugging Face folder (`jaxformer.convert.save_hf`,
`jaxformer.text.save_tokenizer`) that every server loads. Each server is started in turn
as a subprocess on a free loopback port, waited for (`GET /health` answers 200), warmed
up (a workload of another seed, at the most clients), driven, then stopped with SIGTERM:

  jaxformer engine          `jaxformer-serve --max-batch 16` (`--max-batch`)
  jaxformer one-at-a-time   the same with `--max-batch 1`: one request at a time
  transformers serve        `transformers serve --continuous-batching --device cpu`, the
                            folder its FORCE_MODEL (which requests must name: the path),
                            when the CLI runs (it needs the serving extra's fastapi and
                            uvicorn); otherwise the output says why. It refuses a body
                            field it does not know (422), so none (`top_k`) is sent; it
                            ignores `stream_options` but ends each stream with usage
  engine, no prefix cache   with `--shared-prefix`: the engine with `--prefix-cache-mb 0`

The workload, the same for every server and number of clients: `--requests` requests
whose prompts are drawn (numpy seed `--seed`) from `--prompt-lengths` tokens of the
tokenizer's own words and whose `max_tokens` from `--new-tokens`; greedy (temperature 0),
streamed, with `stream_options={"include_usage": true}`, through the official `openai`
client, one thread per client, no retries, each wait for the server bounded by `--timeout`
seconds. A model's name is the one its server lists at `GET /v1/models`. Random weights
may still emit EOS early, so completion tokens are counted from each stream's `usage`,
never assumed.

Per server and number of clients: completion tokens/s (all the requests' completion
tokens over the wall time from the first request sent to the last stream closed); TTFT,
from sending a request to its first chunk with non-empty text; ITL, the gaps between a
request's successive chunks with non-empty text (a server may send several tokens in a
chunk, or hold back a token that ends inside a UTF-8 character), p50 and p95 over all the
requests. The ratios are of figures measured in this run, at the most clients
(`max(--clients)`): engine / one-at-a-time throughput, engine / transformers serve
throughput, and the engine's TTFT p50 there over its TTFT p50 at 1 client (an idle
server: one request at a time). With `--shared-prefix N`, every prompt (of the warm-up
too, as a running server has seen its system prompt before) begins with the same text of N
tokens, and the prefix cache's gain is the engine's throughput over the same engine's
without it, and the TTFT p50 without it over the TTFT p50 with it.

The machine is measured too: "other CPU" is the share of its CPU time (all cores) that
neither the server nor this process used during a load (other processes; a virtual
machine's steal time, and any child process of the server's); the client's threads, on
the same cores as the server, count as this process. A row whose other CPU is above a few
% was disturbed.

JSON fields: `machine` (`cpu`, `cpu_count`, versions), `settings`, `model` (`params`,
`vocab_size`, `d_model`, `n_layer`, `n_head`, `n_kv_head`, `max_seq_len`), `servers` (one
object per server: `server`, `command`, `startup_s` (start to /health 200), `model_name`,
`error` (null, or why it was not measured)), `rows` (one per server and number of
clients: `server`, `clients`, `requests`, `prompt_tokens` and `completion_tokens` (sums of
the streams' `usage`), `chunks` (with text), `wall_s`, `tokens_per_s`, `ttft_ms` and
`itl_ms` each as `{p50, p95}`, `other_cpu_pct`), `ratios`
(`engine_vs_one_at_a_time`, `engine_vs_transformers`, `engine_ttft_most_vs_one_client`,
`prefix_cache_throughput`, `prefix_cache_ttft`, each null where a figure is missing, and
`clients`: the number they were taken at).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import Decoder, DecoderConfig
from jaxformer.convert import save_hf
from jaxformer.text import Tokenizer, save_tokenizer, train_bpe

ENGINE, ONE_AT_A_TIME, TRANSFORMERS = "jaxformer engine", "jaxformer one-at-a-time", "transformers serve"
NO_PREFIX_CACHE = "engine, no prefix cache"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Nothing leaves the machine: no update check of the transformers CLI, no Hub look-ups.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab-size", type=int, default=1024, help="the tokenizer's (and so the model's) vocabulary")
    p.add_argument("--words", type=int, default=400, help="distinct made-up words in the tokenizer's text")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=256, help="the model's and the servers' longest sequence")
    p.add_argument("--max-batch", type=int, default=16, help="the engine's --max-batch")
    p.add_argument("--prefill-chunk", type=int, help="passed on to jaxformer-serve (default: its own)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32, help="requests per number of clients (at least max(--clients))")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[8, 32, 64, 120], help="prompt tokens drawn from")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[16, 32, 64], help="max_tokens drawn from")
    p.add_argument("--seed", type=int, default=0, help="the workload's numpy seed (the warm-up's is seed + 1)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions, or /v1/chat/completions (one user message) for every server")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a request may wait for the server's next bytes (the openai client's timeout)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server has to answer /health")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers serve")
    p.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                   help="every prompt begins with the same text of this many tokens (a system prompt); the "
                        "engine is then measured without its prefix cache too")
    p.add_argument("--out", default="serve.json")
    args = p.parse_args(argv)
    if args.requests < max(args.clients):
        p.error(f"--requests {args.requests} is fewer than the most clients, {max(args.clients)}")
    if args.shared_prefix + max(args.prompt_lengths) + max(args.new_tokens) > args.max_seq_len:
        p.error("the shared prefix, the longest prompt and the most new tokens must fit in --max-seq-len")
    return args


# ---- the model, its tokenizer and the workload ----

def make_words(n: int, seed: int = 0) -> list[str]:
    """`n` distinct made-up lowercase words of 2 to 7 letters."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words: dict[str, None] = {}
    while len(words) < n:
        words["".join(rng.choice(letters, rng.integers(2, 8)))] = None
    return list(words)


def corpus(words: list[str], n_words: int = 20000, seed: int = 0) -> str:
    """The tokenizer's training text: the words drawn Zipf-like, separated by spaces."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, len(words) + 1)
    return " ".join(words[i] for i in rng.choice(len(words), n_words, p=weights / weights.sum()))


def make_checkpoint(folder: str, args) -> tuple[Tokenizer, list[str], dict]:
    """The random decoder and its tokenizer (with a chat template, for `--endpoint chat`),
    written as one Hugging Face folder. Returns `(tokenizer, words, the model's sizes)`."""
    words = make_words(args.words)
    tokenizer = dataclasses.replace(train_bpe([corpus(words)], args.vocab_size), chat_template=CHAT_TEMPLATE)
    config = DecoderConfig(vocab_size=tokenizer.vocab_size, n_layer=args.layers, n_head=args.heads,
                           n_kv_head=args.kv_heads, d_model=args.d_model, max_seq_len=args.max_seq_len,
                           tie_embeddings=False)
    params = Decoder(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    save_hf(config, params, folder, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    save_tokenizer(tokenizer, folder)
    sizes = {"params": sum(x.size for x in jax.tree.leaves(params)),
             **{k: getattr(config, k) for k in ("vocab_size", "d_model", "n_layer", "n_head", "n_kv_head",
                                                "max_seq_len")}}
    return tokenizer, words, sizes


def make_workload(tokenizer: Tokenizer, words: list[str], n: int, prompt_lengths, new_tokens,
                  seed: int) -> list[tuple[str, int]]:
    """`n` requests `(prompt, max_tokens)`, lengths drawn with numpy seed `seed`. A prompt is
    words drawn at random, each after a space: the byte-level pre-tokenizer splits before
    each space, so a text's tokens are its words' tokens, and where the next word would
    overshoot the length asked for, a one-token word takes its place."""
    rng = np.random.default_rng(seed)
    sizes = {w: len(tokenizer.encode(" " + w, add_special_tokens=False)) for w in words}
    singles = [w for w in words if sizes[w] == 1]
    if not singles:
        raise ValueError("no word of the tokenizer's text is one token: raise --vocab-size")
    workload = []
    for _ in range(n):
        text, left = "", int(rng.choice(prompt_lengths))
        while left:
            word = words[rng.integers(len(words))]
            if sizes[word] > left:
                word = singles[rng.integers(len(singles))]
            text, left = text + " " + word, left - sizes[word]
        workload.append((text, int(rng.choice(new_tokens))))
    return workload


# ---- the figures ----

def percentiles(values) -> dict:
    """p50 and p95 (numpy's linear interpolation); None for no values."""
    if len(values) == 0:
        return {"p50": None, "p95": None}
    p50, p95 = np.percentile(np.asarray(values, np.float64), [50, 95])
    return {"p50": float(p50), "p95": float(p95)}


@dataclasses.dataclass
class Timing:
    """One streamed request: when it was sent, when each chunk with text came, and its
    prompt and completion tokens from `usage`."""

    sent: float
    chunks: list[float]
    prompt_tokens: int
    completion_tokens: int

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return np.diff(self.chunks).tolist()


def summarise(timings: list[Timing], wall_s: float) -> dict:
    """Throughput over the wall time, and TTFT and ITL percentiles in ms, of one load."""
    tokens = sum(t.completion_tokens for t in timings)
    return {"requests": len(timings), "prompt_tokens": sum(t.prompt_tokens for t in timings),
            "completion_tokens": tokens, "chunks": sum(len(t.chunks) for t in timings),
            "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
            "ttft_ms": percentiles([1e3 * t.ttft for t in timings if t.chunks]),
            "itl_ms": percentiles([1e3 * g for t in timings for g in t.gaps])}


# ---- the client ----

def stream_request(client, model: str, endpoint: str, prompt: str, max_tokens: int) -> Timing:
    """One greedy streamed request; raises if the stream carries no usage."""
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    sent = time.perf_counter()
    if endpoint == "chat":
        stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
    else:
        stream = client.completions.create(prompt=prompt, **common)
    chunks, usage = [], None
    for chunk in stream:
        now = time.perf_counter()
        if chunk.choices:
            choice = chunk.choices[0]
            text = choice.delta.content if endpoint == "chat" else choice.text
            if text:
                chunks.append(now)
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk (stream_options.include_usage)")
    return Timing(sent, chunks, usage.prompt_tokens, usage.completion_tokens)


def cpu_seconds(pid: int | None) -> tuple[float, float] | None:
    """`(busy CPU seconds of the whole machine, CPU seconds of process pid and of this one)`,
    from /proc; None without it (or a pid)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        server = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    hz, own = os.sysconf("SC_CLK_TCK"), os.times()
    busy = sum(ticks) - ticks[3] - ticks[4]  # user .. steal, less idle and iowait
    return busy / hz, (int(server[11]) + int(server[12])) / hz + own.user + own.system


def run_load(client, model: str, endpoint: str, workload: list[tuple[str, int]], clients: int,
             server_pid: int | None = None) -> dict:
    """The workload through `clients` threads, each sending its next request when its last
    one has ended; `summarise`d, with `other_cpu_pct`: the share of the machine's CPU time
    that went to anything but the server `server_pid` and this process (other processes, and
    steal time of a virtual machine), None where /proc cannot tell."""
    before = cpu_seconds(server_pid)
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        futures = [pool.submit(stream_request, client, model, endpoint, prompt, new) for prompt, new in workload]
        timings = [f.result() for f in futures]
        wall_s = time.perf_counter() - start
    after = cpu_seconds(server_pid)
    other = None if before is None or after is None else max(0.0, after[0] - before[0] - after[1] + before[1])
    return {**summarise(timings, wall_s),
            "other_cpu_pct": None if other is None else 100 * other / (wall_s * os.cpu_count())}


# ---- the servers ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jaxformer_command(folder: str, port: int, max_batch: int, args, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "jaxformer.commands.serve", "--checkpoint", folder, "--port", str(port),
               "--host", "127.0.0.1", "--max-batch", str(max_batch), "--max-seq-len", str(args.max_seq_len), *extra]
    return command + (["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else [])


def transformers_command(folder: str, port: int) -> list[str]:
    return [shutil.which("transformers") or "transformers", "serve", "--continuous-batching", "--device", "cpu",
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), folder]


def transformers_serve_problem() -> str | None:
    """Why `transformers serve --continuous-batching` cannot run here, or None."""
    if shutil.which("transformers") is None:
        return "no `transformers` command on PATH (pip install 'transformers[serving]')"
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{', '.join(missing)} not installed (pip install 'transformers[serving]')"
    try:
        done = subprocess.run(["transformers", "serve", "--help"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **OFFLINE})
    except subprocess.TimeoutExpired:
        return "`transformers serve --help` did not answer in 120 s"
    if done.returncode != 0:
        return f"`transformers serve --help` failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    if "--continuous-batching" not in done.stdout:
        return "this `transformers serve` has no --continuous-batching"
    return None


@contextlib.contextmanager
def running(command: list[str], port: int, log: Path, startup_timeout: float):
    """The server `command` as a subprocess until /health answers 200; yields `(process, the
    seconds that took)`, then stops it with SIGTERM (SIGKILL after 30 s). Raises when it exits
    or is not healthy in time; its output goes to `log`."""
    import httpx
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE})
    try:
        start = time.perf_counter()
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            if process.poll() is not None:
                raise RuntimeError(f"exited with {process.returncode} before /health answered")
            if time.perf_counter() - start > startup_timeout:
                raise RuntimeError(f"/health did not answer 200 in {startup_timeout:.0f} s")
            time.sleep(0.25)
        yield process, time.perf_counter() - start
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench_server(name: str, command: list[str], port: int, log: Path, workloads: dict, args) -> tuple[dict, list]:
    """One server: started, warmed up (the warm-up workload's first request alone, then all of
    it at the most clients: whatever the server compiles for a shape, it compiles there),
    measured at each number of clients, stopped. Returns `(server, rows)`."""
    import openai
    print(f"{name}: {' '.join(command)}", flush=True)
    with running(command, port, log, args.startup_timeout) as (process, startup_s):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=args.timeout,
                               max_retries=0)
        model = client.models.list().data[0].id
        print(f"  healthy after {startup_s:.1f} s, model {model!r}; warming up", flush=True)
        run_load(client, model, args.endpoint, workloads["warm-up"][:1], 1)
        run_load(client, model, args.endpoint, workloads["warm-up"], max(args.clients))
        rows = []
        for clients in args.clients:
            rows.append({"server": name, "clients": clients,
                         **run_load(client, model, args.endpoint, workloads["measured"], clients, process.pid)})
            print_rows(rows[-1:])
    return {"server": name, "command": command, "startup_s": startup_s, "model_name": model, "error": None}, rows


# ---- the report ----

def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        other = "-" if r["other_cpu_pct"] is None else f"{r['other_cpu_pct']:.0f}%"
        print(f"  {r['server']:24s} {r['clients']:7d} {r['tokens_per_s']:9.1f} {_ms(r['ttft_ms']['p50']):>9s} "
              f"{_ms(r['ttft_ms']['p95']):>9s} {_ms(r['itl_ms']['p50']):>8s} {_ms(r['itl_ms']['p95']):>8s} "
              f"{other:>9s}", flush=True)


def print_header() -> None:
    print(f"  {'server':24s} {'clients':>7s} {'tokens/s':>9s} {'TTFT p50':>9s} {'TTFT p95':>9s} "
          f"{'ITL p50':>8s} {'ITL p95':>8s} {'other CPU':>9s}   (times in ms)")
    print("  " + "-" * 90, flush=True)


def _figure(rows: list[dict], server: str, clients: int, *keys: str):
    row = next((r for r in rows if r["server"] == server and r["clients"] == clients), None)
    for key in keys:
        row = None if row is None else row[key]
    return row


def _ratio(a, b):
    return None if a is None or not b else a / b


def ratios(rows: list[dict], clients: int) -> dict:
    """The run's ratios at `clients` clients (see the module's docstring)."""
    engine = _figure(rows, ENGINE, clients, "tokens_per_s")
    return {"clients": clients,
            "engine_vs_one_at_a_time": _ratio(engine, _figure(rows, ONE_AT_A_TIME, clients, "tokens_per_s")),
            "engine_vs_transformers": _ratio(engine, _figure(rows, TRANSFORMERS, clients, "tokens_per_s")),
            "engine_ttft_most_vs_one_client": _ratio(_figure(rows, ENGINE, clients, "ttft_ms", "p50"),
                                                     _figure(rows, ENGINE, 1, "ttft_ms", "p50")),
            "prefix_cache_throughput": _ratio(engine, _figure(rows, NO_PREFIX_CACHE, clients, "tokens_per_s")),
            "prefix_cache_ttft": _ratio(_figure(rows, NO_PREFIX_CACHE, clients, "ttft_ms", "p50"),
                                        _figure(rows, ENGINE, clients, "ttft_ms", "p50"))}


def print_ratios(r: dict) -> None:
    def show(value):
        return "-" if value is None else f"{value:.2f}x"
    print(f"\nat {r['clients']} clients: engine / one-at-a-time throughput {show(r['engine_vs_one_at_a_time'])}, "
          f"engine / transformers serve throughput {show(r['engine_vs_transformers'])}, "
          f"engine TTFT p50 / its TTFT p50 at 1 client {show(r['engine_ttft_most_vs_one_client'])}")
    if r["prefix_cache_throughput"] is not None:
        print(f"the prefix cache: throughput {show(r['prefix_cache_throughput'])}, TTFT p50 "
              f"{show(r['prefix_cache_ttft'])} shorter than without it")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    versions = {}
    for package in ("jax", "jaxlib", "transformers", "torch", "openai"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {"cpu": cpu, "cpu_count": os.cpu_count(), **versions}


def main(argv=None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-serve-") as work:
        result = bench(args, Path(work))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return result


def bench(args, work: Path) -> dict:
    """The checkpoint written into `work`, each server measured on it in turn, the report."""
    folder = str(work / "serve-bench-model")
    tokenizer, words, model = make_checkpoint(folder, args)
    shared = make_workload(tokenizer, words, 1, [args.shared_prefix], [1], args.seed + 2)[0][0] \
        if args.shared_prefix else ""
    workloads = {name: [(shared + prompt, n) for prompt, n in
                        make_workload(tokenizer, words, args.requests, args.prompt_lengths, args.new_tokens, seed)]
                 for name, seed in (("measured", args.seed), ("warm-up", args.seed + 1))}
    print(f"serve benchmark: {model['params'] / 1e6:.1f} M params, vocab {model['vocab_size']}, {args.requests} "
          f"requests per load (prompts {args.prompt_lengths} tokens, max_tokens {args.new_tokens}), "
          f"/v1/{args.endpoint}, {os.cpu_count()} CPU cores", flush=True)
    plans = [(ENGINE, lambda port: jaxformer_command(folder, port, args.max_batch, args)),
             (ONE_AT_A_TIME, lambda port: jaxformer_command(folder, port, 1, args))]
    if args.shared_prefix:
        plans.insert(1, (NO_PREFIX_CACHE, lambda port: jaxformer_command(folder, port, args.max_batch, args,
                                                                       "--prefix-cache-mb", "0")))
    problem = "--no-transformers" if args.no_transformers else transformers_serve_problem()
    servers, rows = [], []
    if problem is None:
        plans.append((TRANSFORMERS, lambda port: transformers_command(folder, port)))
    else:
        print(f"transformers serve: skipped ({problem})", flush=True)
        servers.append({"server": TRANSFORMERS, "command": None, "startup_s": None, "model_name": None,
                        "error": problem})
    print_header()
    for name, command in plans:
        port = free_port()
        log = work / f"{name.replace(' ', '-')}.log"
        try:
            server, measured = bench_server(name, command(port), port, log, workloads, args)
        except Exception as e:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:]) if log.exists() else ""
            print(f"{name}: failed ({type(e).__name__}: {e})\n{name}'s log ends:\n{tail}", flush=True)
            if name != TRANSFORMERS:
                raise
            server, measured = {"server": name, "command": command(port), "startup_s": None, "model_name": None,
                                "error": f"{type(e).__name__}: {e}"}, []
        servers.append(server)
        rows += measured

    print()
    print_header()
    print_rows(rows)
    result_ratios = ratios(rows, max(args.clients))
    print_ratios(result_ratios)
    return {"machine": machine(), "settings": vars(args), "model": model, "servers": servers, "rows": rows,
            "ratios": result_ratios}


if __name__ == "__main__":
    sys.exit(main() and 0)
