"""jaxformer's CPU decoding against llama.cpp's, format by format, each pass a fresh process.

    python -m benchmarks.cpu_decode DIR [--formats F32 BF16 Q8_0 Q4_0] [--new 64] [--prompt 128]
        [--passes 3] [--threads 2] [--batch 1 8] [--work GGUF_DIR] [--out cpu_decode.json]

DIR is a Llama checkpoint folder (`python -m benchmarks.llama_1b DIR` writes a Llama-3.2-1B-shaped
one). llama.cpp runs through llama-cpp-python (the `cpu-peer` extra) on GGUF files made from DIR in
`--work` (default: a temporary directory): the float32 one by `benchmarks.gguf_file.write_gguf`, the
others by llama.cpp's own quantizer from it (`quantize_gguf`, every matrix in the format). Each
format's weights on the two sides:

    F32   llama.cpp F32    jaxformer load_hf(dtype=float32)
    BF16  llama.cpp BF16   jaxformer load_hf(dtype=bfloat16)
    Q8_0  llama.cpp Q8_0   jaxformer load_hf(quantize=Quantization("int8", head=True)), float32 compute
    Q4_0  llama.cpp Q4_0   jaxformer load_hf(quantize=Quantization("int4", group=32, head=True)), float32 compute

Both sides get the same prompt ids and `--threads` threads (llama.cpp's `n_threads` and
`n_threads_batch`; XLA's CPU client uses the machine's cores, 2 here), and cache keys and values in
jaxformer's compute dtype (llama.cpp's `type_k`, `type_v`: F32, or BF16 for BF16). Measured:

- prompt processing: `--prompt` tokens at batch 1, tokens/s. llama.cpp: one `eval` of them (one
  batch, the last token's logits). jaxformer: `generate(max_new_tokens=1)`, the prefill and the
  pick of token 0 (one jitted program, compiled beforehand by `compile_generate` and timed apart).
- decoding: greedy, `--new` tokens after the prompt's first 8 tokens, tokens/s over the decode
  steps alone. llama.cpp: the sum of the per-token `eval` times (the argmax of its logits outside
  them), at batch 1. jaxformer: the whole loop is one program, so its `--new` steps take
  `time(max_new_tokens=new + 1) - time(max_new_tokens=1)` (the same prefill in both, its cache
  `new` slots longer in the first), at each `--batch`; batch 1 is compared, the others beside.

Each row: tokens/s, its weights' bytes (jaxformer: `stored_bytes` of its parameters; llama.cpp: the
GGUF's tensor bytes), for decoding the bytes read per second (weights x steps/s: a step reads
every weight once) and their share of the read floor (`benchmarks.read_floor.read_bandwidth` over a
buffer the size of the largest weights, measured once, in its own process, before the passes).
Medians over `--passes`; in each pass every format runs llama.cpp then jaxformer. Printed: each
row, `jaxformer / llama.cpp` for decoding at batch 1 and for the prompt, and whether the greedy
tokens agree at F32 (the same float32 model: they should).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.decode_1b import seconds
from benchmarks.moe_decode import peak_rss, prompts

FORMATS = ("F32", "BF16", "Q8_0", "Q4_0")
JAXFORMER_NAMES = {"F32": "float32", "BF16": "bfloat16", "Q8_0": "int8", "Q4_0": "int4"}  # each format's weights
DECODE_PROMPT = 8  # decoding starts after the prompt's first tokens
INSTALL = ("benchmarks.cpu_decode needs llama.cpp's Python binding and gguf, the cpu-peer extra: "
           "CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install 'jaxformer[cpu-peer]'")


def missing_extra() -> str | None:
    """What to install when `llama_cpp` or `gguf` does not import, else None."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError:
        return INSTALL
    return None


def prompt_ids(batch: int, length: int, vocab_size: int) -> np.ndarray:
    """`[batch, length]` the benchmarks' prompt ids (`prompts`), inside the model's vocabulary."""
    return prompts(batch, length) % vocab_size


def jaxformer_weights(fmt: str):
    """`(dtype, quantize)` of `load_hf` for the weights that match llama.cpp's `fmt`."""
    import jax.numpy as jnp

    from jaxformer.quantized import Quantization

    return {"F32": (jnp.float32, None), "BF16": (jnp.bfloat16, None),
            "Q8_0": (jnp.float32, Quantization("int8", head=True)),
            "Q4_0": (jnp.float32, Quantization("int4", group=32, head=True))}[fmt]


def jaxformer_worker(folder: str, fmt: str, batches: list[int], prompt_len: int, new: int) -> dict:
    """jaxformer's prompt processing and its decoding at each of `batches`, on `fmt`'s weights."""
    import jax

    from jaxformer import Decoder
    from jaxformer.command_line import loading_memory
    from jaxformer.convert import load_hf
    from jaxformer.decoding import compile_generate, generate
    from jaxformer.quantized import stored_bytes

    dtype, quantize = jaxformer_weights(fmt)
    with loading_memory():  # as jaxformer's commands load
        config, params = load_hf(folder, max_seq_len=max(prompt_len, DECODE_PROMPT + new) + 1, dtype=dtype,
                                 quantize=quantize)
    model = Decoder(config)
    compiles, out = [], {}

    def timed(prompt: np.ndarray, n: int) -> float:  # a call's seconds, its compile timed apart
        start = time.perf_counter()
        compile_generate(model, params, prompt, max_new_tokens=n)
        compiles.append(time.perf_counter() - start)

        def call():
            out["tokens"] = generate(model, params, prompt, max_new_tokens=n).block_until_ready()
        return seconds(call, 1)

    prompt = prompt_ids(1, prompt_len, config.vocab_size)
    row = {"impl": "jaxformer", "format": fmt, "weights": JAXFORMER_NAMES[fmt], "weight_bytes": stored_bytes(params),
           "prompt_tokens_per_s": prompt_len / timed(prompt, 1), "decode": {}}
    for batch in batches:
        short = prompt_ids(batch, prompt_len, config.vocab_size)[:, :DECODE_PROMPT]
        whole = timed(short, new + 1)
        if batch == 1:
            row["tokens"] = np.asarray(out["tokens"])[0, DECODE_PROMPT:].tolist()
        row["decode"][str(batch)] = batch * new / (whole - timed(short, 1))  # the `new` decode steps alone
    return row | {"compile_s": sum(compiles), "peak_rss": peak_rss(), "jax": jax.__version__}


def llama_cpp_worker(path: str, fmt: str, prompt_len: int, new: int, threads: int) -> dict:
    """llama.cpp's prompt processing and its greedy decoding at batch 1, on the GGUF file `path`."""
    import gguf
    import llama_cpp

    from benchmarks.gguf_file import tensor_bytes

    cache = gguf.GGMLQuantizationType.BF16 if fmt == "BF16" else gguf.GGMLQuantizationType.F32  # jaxformer's
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                          n_ctx=max(prompt_len, DECODE_PROMPT + new), n_batch=prompt_len, n_ubatch=prompt_len,
                          type_k=int(cache), type_v=int(cache), logits_all=False, verbose=False)
    vocab = llm.n_vocab()

    def evaluated(tokens: list[int]) -> float:  # seconds of one eval
        start = time.perf_counter()
        llm.eval(tokens)
        return time.perf_counter() - start

    def picked() -> int:  # greedy: the argmax of the last token's logits
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))))

    prompt = prompt_ids(1, prompt_len, vocab)[0].tolist()
    prompt_s = seconds(lambda: (llm.reset(), llm.eval(prompt)), 1)  # (after one untimed eval of it)
    llm.reset()
    evaluated(prompt[:DECODE_PROMPT])
    tokens, steps = [picked()], 0.0
    for _ in range(new):
        steps += evaluated(tokens[-1:])
        tokens.append(picked())
    return {"impl": "llama.cpp", "format": fmt, "weights": fmt, "weight_bytes": tensor_bytes(path),
            "prompt_tokens_per_s": prompt_len / prompt_s, "decode": {"1": new / steps}, "tokens": tokens,
            "peak_rss": peak_rss(), "llama_cpp": llama_cpp.__version__}


def floor_worker(nbytes: int, threads: int) -> dict:
    from benchmarks.read_floor import read_bandwidth

    return {"bytes": nbytes, "threads": threads, "bytes_per_s": read_bandwidth(nbytes, threads)}


def in_a_process(args, *worker: str) -> dict:
    """One worker's run (`--worker KIND ...`) in a fresh Python process: its JSON result, or the
    reason it failed."""
    command = [sys.executable, "-m", "benchmarks.cpu_decode", args.checkpoint, "--worker", *worker,
               "--prompt", str(args.prompt), "--new", str(args.new), "--threads", str(args.threads),
               "--batch", *map(str, args.batch)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"failed": " ".join(done.stderr.strip().splitlines()[-1:])}
    return json.loads(done.stdout.strip().splitlines()[-1])


def gguf_files(folder: str, formats: list[str], work: str, threads: int) -> dict[str, str]:
    """Each format's GGUF file in `work`: the float32 one from `folder`, the others quantized from it."""
    from benchmarks.gguf_file import quantize_gguf, write_gguf

    paths = {"F32": write_gguf(folder, os.path.join(work, "model-F32.gguf"))}
    for fmt in formats:
        if fmt != "F32":
            paths[fmt] = os.path.join(work, f"model-{fmt}.gguf")
            quantize_gguf(paths["F32"], paths[fmt], fmt, threads)
    return paths


def summary(passes: list[dict], floor: float) -> dict:
    """One side's row: the medians of its passes' figures, and its decoding's bytes read per second
    and share of the `floor` (bytes per second); the tokens of its first pass."""
    done = [p for p in passes if "failed" not in p]
    if not done:
        return {"failed": passes[0]["failed"]}
    row = {key: done[0][key] for key in ("impl", "format", "weights", "weight_bytes", "tokens")}
    row["prompt_tokens_per_s"] = statistics.median(p["prompt_tokens_per_s"] for p in done)
    row["peak_rss"] = max(p["peak_rss"] for p in done)
    row["decode"] = {}
    for batch in done[0]["decode"]:
        tokens_per_s = statistics.median(p["decode"][batch] for p in done)
        read = row["weight_bytes"] * tokens_per_s / int(batch)  # a step reads every weight once
        row["decode"][batch] = {"tokens_per_s": tokens_per_s, "bytes_per_s": read, "floor_share": read / floor}
    return row | {"passes": len(done), "failed_passes": len(passes) - len(done)}


def report(rows: dict[str, dict[str, dict]], prompt_len: int) -> list[str]:
    """The printed lines: each side's decoding and prompt rows per format, then the ratios."""
    lines = []
    for fmt, sides in rows.items():
        for impl, side in sides.items():
            if "failed" in side:
                lines.append(f"{impl} {fmt}: failed: {side['failed']}")
                continue
            name = f"{side['impl']} {side['weights']}"
            for batch, d in side["decode"].items():
                lines.append(f"{name} decode batch {batch}: {d['tokens_per_s']:.2f} tokens/s, weights "
                             f"{side['weight_bytes'] / 1e9:.3f} GB, {d['bytes_per_s'] / 1e9:.1f} GB/s read, "
                             f"{100 * d['floor_share']:.0f}% of the floor")
            lines.append(f"{name} prompt {prompt_len}: {side['prompt_tokens_per_s']:.1f} tokens/s")
        jax_row, peer = sides["jaxformer"], sides["llama.cpp"]
        if "failed" not in jax_row and "failed" not in peer:
            ratio = {"decode": jax_row["decode"]["1"]["tokens_per_s"] / peer["decode"]["1"]["tokens_per_s"],
                     "prompt": jax_row["prompt_tokens_per_s"] / peer["prompt_tokens_per_s"]}
            sides["ratio"] = ratio
            lines.append(f"jaxformer / llama.cpp {fmt}: decode batch 1 {ratio['decode']:.2f}x, prompt {prompt_len} "
                         f"{ratio['prompt']:.2f}x")
            if fmt == "F32":
                sides["same_tokens"] = jax_row["tokens"] == peer["tokens"]
                lines.append(f"F32 greedy tokens agree: {sides['same_tokens']}")
    return lines


def run(args) -> dict:
    """The GGUF files, the floor, the passes: every row and its ratios."""
    from benchmarks.gguf_file import tensor_bytes

    with tempfile.TemporaryDirectory(prefix="cpu-decode-") as scratch:
        work = args.work or scratch
        os.makedirs(work, exist_ok=True)
        paths = gguf_files(args.checkpoint, args.formats, work, args.threads)
        largest = max(tensor_bytes(paths[fmt]) for fmt in args.formats)
        floor = in_a_process(args, "floor", str(largest))
        if "failed" in floor:
            raise SystemExit(f"the read floor's process failed: {floor['failed']}")
        print(f"read floor: {floor['bytes_per_s'] / 1e9:.1f} GB/s over {largest / 1e9:.3f} GB on {args.threads} "
              "threads", flush=True)
        passes = {fmt: {"llama.cpp": [], "jaxformer": []} for fmt in args.formats}
        for _ in range(args.passes):
            for fmt in args.formats:
                passes[fmt]["llama.cpp"].append(in_a_process(args, "llama.cpp", fmt, paths[fmt]))
                passes[fmt]["jaxformer"].append(in_a_process(args, "jaxformer", fmt))
    rows = {fmt: {impl: summary(runs, floor["bytes_per_s"]) for impl, runs in sides.items()}
            for fmt, sides in passes.items()}
    return {"floor": floor, "rows": rows, "passes": passes}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--new", type=int, default=64, help="tokens decoded after the prompt's first 8")
    p.add_argument("--prompt", type=int, default=128, help="the prompt processed at once")
    p.add_argument("--passes", type=int, default=3, help="fresh processes per side and format (medians)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="jaxformer's decoding batches (llama.cpp: 1)")
    p.add_argument("--work", help="where the GGUF files are written (default: a temporary directory)")
    p.add_argument("--out", default="cpu_decode.json")
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # a child's run: KIND [FORMAT] [PATH]
    args = p.parse_args(argv)
    for name, value, least in (("--new", args.new, 1), ("--prompt", args.prompt, DECODE_PROMPT),
                               ("--passes", args.passes, 1), ("--threads", args.threads, 1)):
        if value < least:
            p.error(f"{name} must be at least {least}, got {value}")
    if 1 not in args.batch or min(args.batch) < 1:
        p.error(f"--batch must include 1 (compared with llama.cpp) and hold sizes >= 1, got {args.batch}")
    missing = missing_extra()
    if missing:
        print(missing, file=sys.stderr)
        raise SystemExit(1)
    if args.worker:
        kind, *rest = args.worker
        if kind == "floor":
            result = floor_worker(int(rest[0]), args.threads)
        elif kind == "llama.cpp":
            result = llama_cpp_worker(rest[1], rest[0], args.prompt, args.new, args.threads)
        else:
            result = jaxformer_worker(args.checkpoint, rest[0], args.batch, args.prompt, args.new)
        print(json.dumps(result))
        return
    result = run(args)
    for line in report(result["rows"], args.prompt):
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump({"settings": {k: v for k, v in vars(args).items() if k != "worker"}, **result}, f, indent=1)


if __name__ == "__main__":
    main()
