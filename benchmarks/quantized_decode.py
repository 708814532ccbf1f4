"""Greedy decoding with quantized weights against float32, bfloat16 and transformers, each in a
fresh process.

    python -m benchmarks.quantized_decode DIR [--weights float32 bfloat16 int8 int4 nf4 int8+head ...] [--batch 1 8]
        [--prompt 32] [--new 32] [--reps 2] [--no-peer] [--out quantized_decode.json]

DIR is a checkpoint folder (`python -m benchmarks.llama_1b DIR` writes a Llama-3.2-1B-shaped one).
For each kind of weights, a process of its own loads the folder (`load_hf(dtype=...)`, or
`load_hf(quantize=...)` with float32 compute; `F+head`: the embedding and head quantized too),
decodes `--new` greedy tokens after a `--prompt`-token prompt at each batch size (the whole loop one
jitted program, its first call timed apart), and reports new tokens/s, its weights' stored bytes
(int4 and NF4 at half a byte a value) and its peak resident memory (Linux's VmHWM). transformers'
`generate` on torch runs the same prompts in float32 and bfloat16, each in a process too; "its best"
is the faster at each batch. Printed: each row's tokens/s, its ratio to jaxformer float32's and to
transformers' best at that batch, and its peak memory against its weights' bytes plus the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.decode_1b import seconds
from benchmarks.moe_decode import peak_rss, prompts, transformers_side

FLOATS = ("float32", "bfloat16")
FLOAT_BYTES = {"float32": 4, "bfloat16": 2}  # a value's bytes
FORMATS = ("int8", "int4", "nf4")
HEADS = tuple(f"{f}+head" for f in FORMATS)  # the embedding and output head quantized too


def jaxformer_row(folder: str, weights: str, batches: list[int], prompt_len: int, new: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxformer import Decoder, generate
    from jaxformer.command_line import loading_memory
    from jaxformer.config import DTYPES
    from jaxformer.convert import load_hf
    from jaxformer.memory import cache_entry_bytes
    from jaxformer.quantized import Quantization, stored_bytes

    dtype = DTYPES[weights] if weights in FLOATS else jnp.float32
    fmt, _, head = weights.partition("+")
    with loading_memory():  # as jaxformer's commands load
        config, params = load_hf(folder, max_seq_len=prompt_len + new, dtype=dtype,
                                 quantize=None if weights in FLOATS else Quantization(fmt, head=bool(head)))
    model, rows = Decoder(config), []
    for batch in batches:
        prompt = jnp.asarray(prompts(batch, prompt_len), jnp.int32)
        start = time.perf_counter()
        out = generate(model, params, prompt, max_new_tokens=new).block_until_ready()
        first = time.perf_counter() - start
        took = seconds(lambda prompt=prompt: generate(model, params, prompt, max_new_tokens=new).block_until_ready(),
                       reps)
        rows.append({"batch": batch, "tokens_per_s": batch * new / took, "first_call_s": first,
                     "cache_bytes": batch * sum(cache_entry_bytes(entry, prompt_len + new, jnp.dtype(
                         config.cache_storage_dtype).itemsize) for entry in config.cache_entries),
                     "tokens": np.asarray(out[:, prompt_len:]).tolist()})
    return {"impl": "jaxformer", "weights": weights, "weight_bytes": stored_bytes(params), "rows": rows,
            "peak_rss": peak_rss(), "jax": jax.__version__}


def transformers_row(folder: str, weights: str, batches: list[int], prompt_len: int, new: int, reps: int) -> dict:
    side = transformers_side(folder, batches, prompt_len, new, reps, dtype=weights)
    return {"impl": "transformers", "weights": weights, "weight_bytes": side["weights_bytes"], "rows": side["rows"],
            "peak_rss": side["peak_rss"]}


def parameter_count(folder: str) -> int:
    """The checkpoint's parameters, from its safetensors files' headers (nothing read)."""
    from safetensors import safe_open

    count = 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "np") as f:
                count += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
    return count


def memory_total() -> int:
    """This machine's memory in bytes (Linux's MemTotal)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def in_a_process(args, impl: str, weights: str) -> dict:
    """One run, in a fresh Python process (its own peak memory): its JSON result. Float weights
    larger than the machine's memory are not run (the Llama-3.1-8B shape's 32 GB of float32 on a
    24 GB machine): the row says so."""
    if weights in FLOATS:
        need = parameter_count(args.checkpoint) * FLOAT_BYTES[weights]
        if need > memory_total():
            return {"impl": impl, "weights": weights, "failed": [
                f"not run: its {weights} weights, {need / 1e9:.1f} GB, exceed this machine's memory, "
                f"{memory_total() / 2**30:.1f} GiB"]}
    command = [sys.executable, "-m", "benchmarks.quantized_decode", args.checkpoint, "--one", impl, weights,
               "--batch", *map(str, args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
               "--reps", str(args.reps)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"impl": impl, "weights": weights, "failed": ["failed:", *done.stderr.strip().splitlines()[-1:]]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(results: list[dict]) -> list[str]:
    """One line per (run, batch): tokens/s, against jaxformer float32 (bfloat16 where float32 did
    not run) and transformers' best, and peak memory against the weights plus the cache."""
    ok = [r for r in results if "failed" not in r]
    ran = {r["weights"]: r for r in ok if r["impl"] == "jaxformer"}
    baseline = next((w for w in FLOATS if w in ran), None)
    base = {row["batch"]: row["tokens_per_s"] for row in ran[baseline]["rows"]} if baseline else {}
    best: dict[int, float] = {}
    for r in ok:
        if r["impl"] == "transformers":
            for row in r["rows"]:
                best[row["batch"]] = max(best.get(row["batch"], 0.0), row["tokens_per_s"])
    lines = []
    for r in results:
        if "failed" in r:
            lines.append(f"{r['impl']:12s} {r['weights']:9s} {' '.join(r['failed'])}")
            continue
        for row in r["rows"]:
            line = (f"{r['impl']:12s} {r['weights']:9s} batch {row['batch']}: {row['tokens_per_s']:7.2f} tokens/s, "
                    f"weights {r['weight_bytes'] / 2**20:,.0f} MiB, peak RSS {r['peak_rss'] / 2**20:,.0f} MiB")
            if row["batch"] in base:
                line += f"; {row['tokens_per_s'] / base[row['batch']]:.2f}x jaxformer {baseline}"
            if row["batch"] in best:
                line += f", {row['tokens_per_s'] / best[row['batch']]:.2f}x transformers' best"
            if "cache_bytes" in row:
                line += f"; RSS / (weights + cache) {r['peak_rss'] / (r['weight_bytes'] + row['cache_bytes']):.2f}"
            lines.append(line)
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantized_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--weights", nargs="+", default=[*FLOATS, *FORMATS], choices=[*FLOATS, *FORMATS, *HEADS])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="jaxformer alone (no transformers rows)")
    p.add_argument("--out", default="quantized_decode.json")
    p.add_argument("--one", nargs=2, metavar=("IMPL", "WEIGHTS"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args(argv)
    if args.one:
        impl, weights = args.one
        run = jaxformer_row if impl == "jaxformer" else transformers_row
        print(json.dumps(run(args.checkpoint, weights, args.batch, args.prompt, args.new, args.reps)))
        return
    runs = [("jaxformer", w) for w in args.weights] + ([] if args.no_peer else [("transformers", w) for w in FLOATS])
    results = [in_a_process(args, impl, weights) for impl, weights in runs]
    for line in report(results):
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump({"settings": {k: v for k, v in vars(args).items() if k != "one"}, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
