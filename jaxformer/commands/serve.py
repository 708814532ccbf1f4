"""`jaxformer-serve`: a checkpoint folder served over the OpenAI API, many requests
decoded at once (continuous batching).

  jaxformer-serve --checkpoint DIR [--port 8000] [--max-batch 8] [--api-key KEY]

Any OpenAI client talks to it (`openai.OpenAI(base_url="http://127.0.0.1:8000/v1")`);
docs/serving.md describes the endpoints, the fields, the engine and the figures. Needs the
`serve` extra (`pip install 'jaxformer[serve]'`). SIGTERM or Ctrl-C stops taking requests,
finishes those running, and exits (0 after SIGTERM, 130 after Ctrl-C); a second one ends
the running requests at once, each with a last error event, and exits with the same status.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time

import jax.numpy as jnp

from jaxformer.command_line import (
    OneLineParser,
    add_quantize_flags,
    check_quantization,
    exit_process,
    fail,
    loading_memory,
    quantization,
    quantized_formats,
    run_command,
)
from jaxformer.config import DTYPES, DecoderConfig
from jaxformer.convert import load_hf, load_hf_config
from jaxformer.decoder import Decoder
from jaxformer.families import family_of
from jaxformer.memory import cache_entry_bytes, format_bytes, free_bytes, prefill_bytes
from jaxformer.runtime import enable_compilation_cache
from jaxformer.serving.engine import Engine
from jaxformer.text.tokenizer import check_fits_model, load_tokenizer
from jaxformer.validation import as_float, as_int

PROG = "jaxformer-serve"
# A chosen --max-seq-len is a multiple of this: every prefill chunk (a power of two up to
# 256) then ends on it, and a length a person reads at a glance.
LENGTH_STEP = 256
# Of the free memory, what the server's arrays may take: the rest is the runtime's own (the
# compiler, the Python process, the HTTP server) and the estimate's margin.
USABLE = 0.85


def parse_args(argv=None):
    p = OneLineParser(PROG, __doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a Hugging Face folder: config.json, model.safetensors (or shards), tokenizer.json")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--model-name", default=None, help="the model's name in the API (default: the folder's name)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded at once (rows of the batch)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="longest prompt + completion of a request (default: the checkpoint's "
                        "max_position_embeddings, or the largest that fits the memory, said at start); the "
                        "cache holds --max-batch rows of it")
    p.add_argument("--prefill-chunk", type=int, default=64,
                   help="prompt tokens prefilled per step of the batch, a power of two: a long prompt "
                        "delays the running streams by one chunk at a time")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--prefix-cache-mb", type=int, default=1024, metavar="MB",
                   help="memory for prefilled prompts, which later prompts that begin the same way copy "
                        "(each costs one row of the cache; least recently used out first); 0: off")
    p.add_argument("--dtype", default="float32", help=f"compute and weight dtype, one of {', '.join(DTYPES)}")
    add_quantize_flags(p)
    p.add_argument("--api-key", default=os.environ.get("JAXFORMER_API_KEY"),
                   help="a key every /v1 request must send as 'Authorization: Bearer KEY' "
                        "(default: $JAXFORMER_API_KEY, else none)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the largest request body read")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long a request's body may take to arrive (408 past it)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (warning: no line a request)")
    args = p.parse_args(argv)
    try:
        if args.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)} (got {args.dtype!r})")
        as_int(args.port, "--port", minimum=0, maximum=65535)
        for flag in ("max_batch", "max_body_bytes", "prefill_chunk"):
            as_int(getattr(args, flag), "--" + flag.replace("_", "-"), minimum=1)
        as_int(args.max_queue, "--max-queue", minimum=0)
        as_int(args.prefix_cache_mb, "--prefix-cache-mb", minimum=0)
        as_float(args.body_timeout, "--body-timeout", above=0)
        if args.prefill_chunk & (args.prefill_chunk - 1):
            raise ValueError(f"--prefill-chunk must be a power of two (got {args.prefill_chunk})")
        if args.max_seq_len is not None:
            as_int(args.max_seq_len, "--max-seq-len", minimum=2)
        if args.api_key is not None and not args.api_key:
            raise ValueError("--api-key must not be empty")
        args.quantization = quantization(args)
    except ValueError as e:
        p.error(str(e))
    return args


def serving_bytes(config: DecoderConfig, max_seq_len: int, max_batch: int, prefill_chunk: int,
                  weights: int | None = None) -> int:
    """Bytes the server holds at its peak with `max_seq_len` positions a row, by its parts:
    the weights (`weights`: a quantized model's, `check_quantization`; None: every tensor in the
    parameter dtype); the cache (k and v of every layer) of `max_batch` rows, the row a prompt is
    prefilled into, and as many rows again for a step's copy of the rows it decodes (a step of
    fewer rows than the batch reads them out and writes them back); and one prompt chunk's
    prefill work (`prefill_bytes` of one row, less that row's cache, counted already)."""
    c = config
    if weights is None:
        weights = sum(math.prod(t.shape) for t in family_of(c).tensors(c)) * jnp.dtype(c.param_dtype).itemsize
    itemsize = jnp.dtype(c.cache_storage_dtype).itemsize
    row_cache = sum(cache_entry_bytes(entry, max_seq_len, itemsize) for entry in c.cache_entries)  # each layer's own
    work = prefill_bytes(c, 1, min(prefill_chunk, max_seq_len), max_seq_len) - row_cache
    return weights + (2 * max_batch + 1) * row_cache + work


def largest_fitting(config: DecoderConfig, free: int, max_batch: int, prefill_chunk: int,
                    weights: int | None = None) -> int:
    """The largest multiple of `LENGTH_STEP` (or the model's own context, if less) whose
    `serving_bytes` fit in `free`; 0 if not even the smallest does."""
    top = config.max_seq_len // LENGTH_STEP
    if serving_bytes(config, config.max_seq_len, max_batch, prefill_chunk, weights) <= free:
        return config.max_seq_len
    low, high = 0, top  # the bytes grow with the length: bisect on the multiples
    while low < high:
        mid = (low + high + 1) // 2
        if serving_bytes(config, mid * LENGTH_STEP, max_batch, prefill_chunk, weights) <= free:
            low = mid
        else:
            high = mid - 1
    return low * LENGTH_STEP


def choose_max_seq_len(config: DecoderConfig, args, weights: int | None = None) -> tuple[int, str | None]:
    """`(max_seq_len, what to tell)`, from config.json alone, before a weight is read: --max-seq-len
    if it fits (else a ValueError naming the largest that does), or without it the largest
    that fits, saying so when that is less than the checkpoint's context. `weights`: as
    `serving_bytes`'."""
    free = free_bytes()
    wanted = config.max_seq_len if args.max_seq_len is None else args.max_seq_len
    if free is None:
        return wanted, None
    free = (int(free[0] * USABLE), f"{free[1]} ({USABLE:.0%} of {format_bytes(free[0])} free)")
    sized = config.replace(max_seq_len=wanted)
    if serving_bytes(sized, wanted, args.max_batch, args.prefill_chunk, weights) <= free[0]:
        return wanted, None
    fits = largest_fitting(sized, free[0], args.max_batch, args.prefill_chunk, weights)
    where = f"{format_bytes(free[0])} usable on {free[1]}"
    needs = format_bytes(serving_bytes(sized, wanted, args.max_batch, args.prefill_chunk, weights))
    if fits == 0:
        raise ValueError(f"--checkpoint {args.checkpoint}: its weights and a cache of {min(LENGTH_STEP, wanted):,} "
                         f"positions for --max-batch {args.max_batch} rows do not fit in the {where}: try a smaller "
                         f"--max-batch or --dtype bfloat16")
    if args.max_seq_len is not None:
        raise ValueError(f"--max-seq-len {wanted:,} needs about {needs} with --max-batch {args.max_batch} (the "
                         f"weights and the cache), more than the {where}; the largest that fits is {fits:,}")
    return fits, (f"max_seq_len {fits:,} (the checkpoint allows {wanted:,}, which needs about {needs} at "
                  f"--max-batch {args.max_batch}; {where}): pass --max-seq-len to choose")


def load(args):
    """The engine and the tokenizer of --checkpoint, every limit checked (`ValueError`, `OSError`)."""
    tokenizer = load_tokenizer(args.checkpoint)
    config = load_hf_config(args.checkpoint, max_seq_len=args.max_seq_len, dtype=DTYPES[args.dtype])
    weights = check_quantization(config, args.quantization)  # (the quantized model's bytes, which the cache sizes by)
    max_seq_len, note = choose_max_seq_len(config, args, weights)
    if note is not None:
        say(note)
    with loading_memory():
        config, params = load_hf(args.checkpoint, max_seq_len=max_seq_len, dtype=DTYPES[args.dtype],
                                 quantize=args.quantization)
    check_fits_model(tokenizer, config.vocab_size, args.checkpoint)
    engine = Engine(Decoder(config), params, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                    max_queue=args.max_queue, stop_ids=tokenizer.stop_ids,
                    prefix_cache_bytes=args.prefix_cache_mb << 20)
    return engine, tokenizer


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port`, before anything is loaded: a port in use is found in
    a moment, not after the model has loaded and compiled (`ValueError` naming the flags)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: a restart may take the port at once)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}") from None
    return sock


def main(argv=None) -> int:
    return run_command(PROG, lambda: _main(argv))


def _main(argv) -> int:
    args = parse_args(argv)
    try:
        import uvicorn

        from jaxformer.serving.app import create_app
        from jaxformer.serving.server import Server
    except ImportError as e:
        fail(PROG, f"{e.name} is missing: the server needs the serve extra, pip install 'jaxformer[serve]'")
    enable_compilation_cache()
    started = time.perf_counter()
    try:
        sock = listen(args.host, args.port)
        engine, tokenizer = load(args)
    except (OSError, ValueError) as e:
        fail(PROG, str(e))
    name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    quantized = quantized_formats(engine.params)
    quantized = f" ({quantized})" if quantized else ""
    say(f"{name}{quantized} loaded in {time.perf_counter() - started:.1f} s; compiling the engine's programs for "
        f"max_seq_len {engine.capacity} (the longer the context, the longer this takes)")
    engine.warmup(lambda done, total, what: say(f"compiled {done} of {total}: {what}"))  # before the first request
    say(f"{name} ready in {time.perf_counter() - started:.1f} s: batch {engine.max_batch}, max_seq_len "
        f"{engine.capacity}, prefill chunk {engine.prefill_chunk}")
    app = create_app(engine, tokenizer, name, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     body_timeout_s=args.body_timeout, on_shutdown=[engine.close])
    # uvicorn answers SIGTERM by finishing the open requests, then sends the signal again to
    # the handler it found; this one lets the command end as it should, with status 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=None)
    Server(config, app.state.abort, say).run(sockets=[sock])
    return 0


def say(line: str) -> None:
    """One line of the command's own on stderr."""
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    exit_process(main())
