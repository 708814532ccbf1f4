"""Incremental decoding speed: jaxformer against Hugging Face and against the machine's limit.

    python -m benchmarks.decode [--batch 1 8] [--prompt 128] [--new 256] [--reps 5]
                                [--dtype float32] [--out decode.json] [--plot DIR]

The default model is a small Llama-shaped decoder: vocab 8192, d_model 512, 8 layers, 8
heads, 2 kv heads, SwiGLU 1376, untied (30.5 M parameters), greedy, prompt 128, 256
new tokens. Everything is measured in this one process, so the ratios compare like with
like. Variants, for each batch size:

  jaxformer loop      `generate`: prefill, every step and every pick in one jitted program
  jaxformer scanned   the same, with the model's blocks scanned (`scan_layers=True`, the
                      same weights stacked): one block in the program, the stacked cache
                      updated in place
  jaxformer stream    `stream`: a jitted step driven from Python, cache donated
  jaxformer no cache  the naive way: every step runs the whole sequence again (one
                      compiled forward over the padded [batch, prompt + new] tokens)
  HF generate         transformers on torch, the same weights (`jaxformer.convert.save_hf`),
                      when the peers extra is installed; its greedy tokens must equal ours

Per variant: prefill time, time per decode step, new tokens/s (whole run, prefill
included), compile time, peak memory, and "% of floor": the time a step must take at
least, reading the weights and the live KV cache once at the memory bandwidth measured
in this run, over the measured step time. Medians over `--reps` runs, spread as
(max - min) / median. The scaling part times one cached step and one uncached forward
at each context length of `--contexts` (batch 1), then one cached step at the short
context `--capacity-context` in caches of each capacity of `--capacities` (batch 1), read
whole (every slot of the capacity, as a step read before spans) and read at its span (the
bucket holding the context, `jaxformer.cache.spans`), timed in turns: their ratio is what
the span saves a server whose `--max-seq-len` is far above its requests' lengths.

Speculative decoding (`generate(..., speculative=...)`) against plain greedy `generate`,
timed in turns, on three workloads:

  random weights      the model above, with a random draft that never agrees: what
                      speculation costs when it cannot help (its greedy output falls
                      into loops, though, which prompt lookup finds)
  copy 4x512          `train.lm`'s copy task: given `[BOS] p [SEP]` the model writes the 32
                      symbols of p again, which its context already holds. The model
                      (4 layers, d_model 512: 10.9 M parameters, 44 MB, more than the
                      32 MB L3 cache of the machine in docs/performance.md, as a real
                      model's weights are) is trained here for `--copy-steps` updates
  copy 2x128          the same task on a 0.4 M-parameter model (2 layers, d_model 128,
                      trained for `--draft-steps` updates), which stays in the CPU's
                      caches: its step costs what launching its operations costs, not
                      reading weights, so it shows where speculation gains little

with prompt lookup (`PromptLookup(k, n=3)`) and a draft model (`Draft`: for random
weights a random decoder of d_model 64 and 1 layer; for copy 4x512 the trained 2x128
copy model), `k` from `--spec-k`. Per row: acceptance (accepted / proposed), new tokens
per pass of the model, tokens kept per row and round (each row advances by its own
acceptance), new tokens/s and its ratio to plain greedy's, and whether the tokens are
plain greedy's.

JSON fields: `config`, `machine` (`bandwidth_gb_s`, versions), `settings`, `variants`
(one object per variant and batch: `variant`, `batch`, `prefill_ms`, `step_ms`,
`tokens_per_s` each as `{median, spread}`, `compile_s`, `peak_memory_mb`,
`floor_step_ms`, `floor_pct`, `vs_hf`, `same_tokens`), `scaling` (`context`,
`cached_ms`, `uncached_ms`, `speedup`), `capacity` (`capacity`, `context`, `span`,
`whole_ms`, `span_ms`, `speedup`), `speculative` (`workload`, `batch`, `variant`, `k` (after
fitting `max_seq_len`), `acceptance`, `tokens_per_pass`, `tokens_per_row_round` (the tokens an
unfinished row keeps per round, its own accepted + 1: each row advances by its own acceptance,
so at batch 8 this is the rows' mean, not the batch's least), `tokens_per_s` as `{median, spread}`,
`vs_greedy`, `same_tokens`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import Decoder, DecoderConfig, generate, stream
from jaxformer.convert import with_scan_layers
from jaxformer.decoding import DecodeRequest, Draft, PromptLookup, run, speculative_generate


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=1376)
    p.add_argument("--tied", action="store_true", help="tie the output head to the embedding (default: untied)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--uncached-steps", type=int, default=4, help="steps timed for the no-cache variant")
    p.add_argument("--contexts", type=int, nargs="*", default=[128, 256, 512, 1024, 2048])
    p.add_argument("--capacities", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384],
                   help="cache capacities one step at --capacity-context is timed in, read whole and at its span")
    p.add_argument("--capacity-context", type=int, default=128, help="the tokens cached in those steps")
    p.add_argument("--no-hf", action="store_true", help="skip transformers even if installed")
    p.add_argument("--spec-k", type=int, nargs="*", default=[4, 8, 16], help="speculative rows' proposal lengths "
                   "(none: no speculative rows)")
    p.add_argument("--speculative-only", action="store_true",
                   help="only the speculative table (plain greedy is measured there too)")
    p.add_argument("--copy-steps", type=int, default=80,
                   help="updates of the copy-task model (0: no copy workloads)")
    p.add_argument("--copy-model", type=int, nargs=2, default=[4, 512], metavar=("N_LAYER", "D_MODEL"),
                   help="the copy-task model's size")
    p.add_argument("--draft-steps", type=int, default=200, help="updates of the 2x128 copy model (its draft)")
    p.add_argument("--out", default="decode.json")
    p.add_argument("--plot", metavar="DIR", help="write tokens_per_s.png and context_scaling.png there")
    return p.parse_args(argv)


def _stats(values) -> dict:
    median = statistics.median(values)
    return {"median": median, "spread": (max(values) - min(values)) / median if median else 0.0}


def _seconds(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def measure_bandwidth(mb: int = 512, reps: int = 5) -> float:
    """Bytes per second this machine reads from memory: the best of three jitted kernels
    over `mb` MB (a sum, a max over rows, a matrix-vector product, decoding's own access
    pattern), each the best of `reps` runs. The fastest read is the honest floor."""
    rows = mb * 2 ** 20 // 4 // 4096
    x = jnp.ones((rows, 4096), jnp.float32)
    vector = jnp.ones((1, rows), jnp.float32)
    kernels = [jax.jit(jnp.sum), jax.jit(lambda x: jnp.max(x, axis=1)), jax.jit(lambda x: vector @ x)]
    best = float("inf")
    for kernel in kernels:
        kernel(x).block_until_ready()
        best = min(best, *(_seconds(lambda kernel=kernel: kernel(x)) for _ in range(reps)))
    return x.nbytes / best


def floor_step_seconds(config: DecoderConfig, params, batch: int, context: float, bandwidth: float) -> float:
    """The least time a decode step can take: every weight it multiplies by, plus the
    live part of the KV cache, read once. The embedding table is only gathered from
    (batch rows) unless it is also the output head."""
    itemsize = jnp.dtype(config.dtype).itemsize
    weights = sum(x.size for x in jax.tree.leaves(params)) * itemsize
    if not config.tie_embeddings:
        weights -= (config.vocab_size - batch) * config.d_model * itemsize
    kv = 2 * config.n_layer * batch * context * config.n_kv_head * config.head_dim * itemsize
    return (weights + kv) / bandwidth


def _peak_mb(compiled) -> float:
    """XLA's own account of a compiled program's memory: arguments, outputs, temporaries."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes) / 2 ** 20


def bench_loop(model, params, prompt, new: int, reps: int) -> dict:
    """`generate`, the whole loop in one jit; the prefill is timed on its own."""
    request = DecodeRequest.create(model, prompt, max_new_tokens=new)
    start = time.perf_counter()
    compiled = run.lower(model, params, request).compile()
    compile_s = time.perf_counter() - start
    capacity = prompt.shape[1] + new - 1
    prefill = jax.jit(lambda p, t: model.apply({"params": p}, t, model.init_cache(t.shape[0], capacity)))
    prompt_j = request.prompt
    tokens = generate(model, params, prompt, max_new_tokens=new)  # (the loop above, through the public API)
    # Warm up: the first runs of a program, and the first after another program ran,
    # are up to twice as slow on this CPU (measured), so neither is timed.
    for _ in range(2):
        prefill(params, prompt_j)[0].block_until_ready()
        jax.block_until_ready(compiled(params, request))
    prefill_s = [_seconds(lambda: prefill(params, prompt_j)) for _ in range(reps)]
    jax.block_until_ready(compiled(params, request))
    total_s = [_seconds(lambda: compiled(params, request)) for _ in range(reps)]
    step_s = [(t - statistics.median(prefill_s)) / (new - 1) for t in total_s]
    return {"tokens": np.asarray(tokens), "prefill_s": prefill_s, "step_s": step_s, "total_s": total_s,
            "compile_s": compile_s, "peak_memory_mb": _peak_mb(compiled)}


def bench_stream(model, params, prompt, new: int, reps: int) -> dict:
    """`stream`: one jitted step per token from Python, timed between yields."""
    runs = []
    for _ in range(reps + 2):  # the first run compiles, the second warms up
        stamps, tokens = [time.perf_counter()], []
        for token in stream(model, params, prompt, max_new_tokens=new):
            tokens.append(token)
            stamps.append(time.perf_counter())
        runs.append((np.diff(stamps), np.stack(tokens, axis=1)))
    first, runs = runs[0], runs[2:]
    total_s = [float(d.sum()) for d, _ in runs]
    return {"tokens": np.concatenate([prompt, runs[0][1]], axis=1), "prefill_s": [float(d[0]) for d, _ in runs],
            "step_s": [float(np.median(d[1:])) for d, _ in runs], "total_s": total_s,
            "compile_s": float(first[0].sum()) - statistics.median(total_s), "peak_memory_mb": None}


def bench_uncached(model, params, prompt, new: int, reps: int, steps: int) -> dict:
    """Greedy without a cache: each step one forward over the sequence padded to its final
    length (causality hides the padding), so one compiled forward serves every step."""
    batch, prompt_len = prompt.shape
    seq = jnp.zeros((batch, prompt_len + new), jnp.int32).at[:, :prompt_len].set(prompt)

    def step(p, seq, t):  # the token at position t from the logits at t - 1
        logits = model.apply({"params": p}, seq)[0]  # [batch, prompt + new, vocab]
        return seq.at[:, t].set(jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, 1, False), -1))

    start = time.perf_counter()
    compiled = jax.jit(step).lower(params, seq, prompt_len).compile()
    compile_s = time.perf_counter() - start
    compiled(params, seq, prompt_len).block_until_ready()  # warm-up
    step_s = []
    for _ in range(reps):
        out = seq
        for t in range(prompt_len, prompt_len + steps):
            start = time.perf_counter()
            out = compiled(params, out, t).block_until_ready()
            step_s.append(time.perf_counter() - start)
    return {"tokens": np.asarray(out)[:, :prompt_len + steps], "prefill_s": [step_s[0]], "step_s": step_s,
            "total_s": [statistics.median(step_s) * new], "compile_s": compile_s,
            "peak_memory_mb": _peak_mb(compiled)}


def hf_model(config: DecoderConfig, params):
    """transformers' model with jaxformer's weights, or None without the peers extra."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from jaxformer.convert import save_hf
    folder = tempfile.mkdtemp(prefix="jaxformer-bench-hf-")
    save_hf(config, params, folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def bench_hf(model, prompt: np.ndarray, new: int, reps: int) -> dict:
    import torch
    ids = torch.tensor(prompt, dtype=torch.long)

    def run():
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                  min_new_tokens=new, eos_token_id=None, pad_token_id=0)

    start = time.perf_counter()
    tokens = run().numpy()
    first_s = time.perf_counter() - start
    prefill_s = []
    for _ in range(reps):
        with torch.inference_mode():
            start = time.perf_counter()
            model(ids, use_cache=True)
            prefill_s.append(time.perf_counter() - start)
    total_s = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        total_s.append(time.perf_counter() - start)
    step_s = [(t - statistics.median(prefill_s)) / (new - 1) for t in total_s]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    kv = 2 * cfg.num_hidden_layers * prompt.shape[0] * (prompt.shape[1] + new) * cfg.num_key_value_heads \
        * cfg.head_dim * 4
    return {"tokens": tokens, "prefill_s": prefill_s, "step_s": step_s, "total_s": total_s,
            "compile_s": first_s - statistics.median(total_s), "peak_memory_mb": (weights + kv) / 2 ** 20}


def bench_scaling(model, params, contexts, reps: int) -> list[dict]:
    """Batch 1: one cached step at each context length, against one uncached forward over it."""
    step = jax.jit(lambda p, t, cache: model.apply({"params": p}, t, cache), donate_argnums=2)
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t)[0][:, -1])
    rows = []
    for context in contexts:
        tokens = jnp.ones((1, context), jnp.int32)
        _, cache = step(params, tokens, model.init_cache(1, capacity=context + reps + 1))
        token = jnp.ones((1, 1), jnp.int32)
        _, cache = step(params, token, cache)  # compiles the one-token step
        cached = []
        for _ in range(reps):
            start = time.perf_counter()
            logits, cache = step(params, token, cache)
            logits.block_until_ready()
            cached.append(time.perf_counter() - start)
        forward(params, tokens)
        uncached = [_seconds(lambda tokens=tokens: forward(params, tokens)) for _ in range(max(2, reps // 2))]
        c, u = statistics.median(cached), statistics.median(uncached)
        rows.append({"context": context, "cached_ms": 1e3 * c, "uncached_ms": 1e3 * u, "speedup": u / c})
        print(f"  context {context:5d}: cached step {1e3 * c:8.2f} ms   uncached forward {1e3 * u:9.2f} ms   "
              f"{u / c:7.1f}x", flush=True)
    return rows


def bench_capacity(model, params, context: int, capacities, reps: int) -> list[dict]:
    """Batch 1, `context` tokens cached: one step in a cache of each capacity, its attention
    reading every slot against reading the span that holds the context, timed in turns."""
    step = jax.jit(lambda p, t, cache: model.apply({"params": p}, t, cache), donate_argnums=2)
    token = jnp.ones((1, 1), jnp.int32)
    rows = []
    for capacity in capacities:
        _, cache = step(params, jnp.ones((1, context), jnp.int32), model.init_cache(1, capacity=capacity))
        times = {None: [], context + 1: []}  # span None: every slot; context + 1: the bucket of this step's reach

        def timed(cache, needed):  # one step from position `context` (set back each time: the same work)
            cache = cache.spanning(needed).replace(pos=jnp.asarray([context], jnp.int32))
            start = time.perf_counter()
            logits, cache = step(params, token, cache)
            logits.block_until_ready()
            return time.perf_counter() - start, cache

        for needed in times:  # compiles both programs
            _, cache = timed(cache, needed)
        for _ in range(reps):
            for needed in times:
                seconds, cache = timed(cache, needed)
                times[needed].append(seconds)
        whole, spanned = (statistics.median(times[needed]) for needed in times)
        span = cache.spanning(context + 1).span
        rows.append({"capacity": capacity, "context": context, "span": span, "whole_ms": 1e3 * whole,
                     "span_ms": 1e3 * spanned, "speedup": whole / spanned})
        print(f"  capacity {capacity:6d}, context {context}: whole cache {1e3 * whole:8.2f} ms   span {span:5d} "
              f"{1e3 * spanned:8.2f} ms   {whole / spanned:6.2f}x", flush=True)
    return rows


def bench_speculative(model, params, prompt, new: int, reps: int, proposers: dict, workload: str,
                      **options) -> list[dict]:
    """Plain greedy `generate` and each speculative variant, timed in turns (so that a
    slow moment of the machine falls on all of them), as rows of the speculative table."""
    batch = prompt.shape[0]
    runs = {"plain greedy": lambda: generate(model, params, prompt, max_new_tokens=new, **options)}
    runs |= {name: functools.partial(generate, model, params, prompt, max_new_tokens=new, speculative=spec, **options)
             for name, spec in proposers.items()}
    tokens = {name: np.asarray(call()) for name, call in runs.items()}  # compiles
    for call in runs.values():  # warm-up
        jax.block_until_ready(call())
    seconds = {name: [] for name in runs}
    for _ in range(reps):
        for name, call in runs.items():
            seconds[name].append(_seconds(call))
    plain = statistics.median(seconds["plain greedy"])
    rows = []
    for name in runs:
        stats = None if name == "plain greedy" else speculative_generate(
            model, params, prompt, proposers[name], max_new_tokens=new, **options)[1]
        rows.append({"workload": workload, "batch": batch, "variant": name, "k": stats.k if stats else 0,
                     "acceptance": stats.acceptance if stats else None,
                     "tokens_per_pass": stats.tokens_per_pass if stats else 1.0,
                     "tokens_per_row_round": stats.tokens_per_row_round if stats else 1.0,
                     "tokens_per_s": _stats([batch * new / t for t in seconds[name]]),
                     "vs_greedy": plain / statistics.median(seconds[name]),
                     "same_tokens": bool(np.array_equal(tokens[name], tokens["plain greedy"]))})
    return rows


def _print_header(header: str) -> None:
    print(header)
    print("-" * len(header))


def print_speculative(rows: list[dict]) -> None:
    _print_header(f"{'workload':15s} {'batch':>5s} {'variant':16s} {'k':>2s} {'accepted':>8s} {'tok/pass':>8s} "
                  f"{'tok/row-round':>13s} {'new tok/s':>10s} {'spread':>7s} {'vs greedy':>9s}  same tokens")
    for r in rows:
        accepted = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        rate = r["tokens_per_s"]
        print(f"{r['workload']:15s} {r['batch']:5d} {r['variant']:16s} {r['k']:2d} {accepted:>8s} "
              f"{r['tokens_per_pass']:8.2f} {r['tokens_per_row_round']:13.2f} {rate['median']:10.1f} "
              f"{100 * rate['spread']:6.0f}% "
              f"{r['vs_greedy']:8.2f}x  {r['same_tokens']}")


def copy_model(n_layer: int, d_model: int, steps: int, batch_size: int, max_seq_len: int):
    """`train.lm`'s copy task, trained for `steps` updates with the demo's recipe (heads of
    64 dimensions or at least 2, a quarter of them kv heads). Returns `(model, params)`,
    the model allowed `max_seq_len` positions (RoPE has no table of positions to learn:
    the demo's limit leaves no room for long proposals)."""
    from jaxformer.training import TrainState, make_train_step, step_keys
    from train import lm

    n_head = max(2, d_model // 64)
    settings = lm.Settings(steps=steps, warmup=min(50, steps), batch_size=batch_size, n_layer=n_layer,
                           d_model=d_model, n_head=n_head, n_kv_head=max(1, n_head // 4))
    setup = lm.build(settings)
    state = TrainState.create(setup.params, setup.optimizer)
    step = make_train_step(setup.loss_fn, setup.optimizer)
    start = time.perf_counter()
    for s in range(steps):
        data_key, dropout_key = step_keys(settings.seed, s)
        state, metrics = step(state, setup.make_batch(data_key), dropout_key)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    print(f"  copy model {n_layer}x{d_model} ({n_params / 1e6:.1f} M params): loss {float(metrics['loss']):.4f} "
          f"after {steps} updates ({time.perf_counter() - start:.0f} s)", flush=True)
    return Decoder(setup.model.config.replace(max_seq_len=max_seq_len)), state.params


def _row(name: str, batch: int, result: dict, new: int, floor_s: float) -> dict:
    step = _stats(result["step_s"])
    tokens_per_s = _stats([batch * new / t for t in result["total_s"]])
    return {"variant": name, "batch": batch, "prefill_ms": _stats([1e3 * t for t in result["prefill_s"]]),
            "step_ms": {"median": 1e3 * step["median"], "spread": step["spread"]}, "tokens_per_s": tokens_per_s,
            "compile_s": result["compile_s"], "peak_memory_mb": result["peak_memory_mb"],
            "floor_step_ms": 1e3 * floor_s, "floor_pct": 100 * floor_s / step["median"]}


def print_table(rows: list[dict]) -> None:
    _print_header(f"{'variant':20s} {'batch':>5s} {'prefill ms':>11s} {'step ms':>9s} {'spread':>7s} "
                  f"{'new tok/s':>10s} {'vs HF':>6s} {'floor %':>8s} {'compile s':>9s} {'memory MB':>10s}  same tokens")
    for r in rows:
        vs_hf = f"{r['vs_hf']:.2f}x" if r.get("vs_hf") else "-"
        memory = f"{r['peak_memory_mb']:.1f}" if r["peak_memory_mb"] is not None else "-"
        print(f"{r['variant']:20s} {r['batch']:5d} {r['prefill_ms']['median']:11.1f} {r['step_ms']['median']:9.2f} "
              f"{100 * r['step_ms']['spread']:6.0f}% {r['tokens_per_s']['median']:10.1f} {vs_hf:>6s} "
              f"{r['floor_pct']:7.0f}% {r['compile_s']:9.2f} {memory:>10s}  {r['same_tokens']}")


def plot(result: dict, folder: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    rows, batches = result["variants"], sorted({r["batch"] for r in result["variants"]})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [next((r["tokens_per_s"]["median"] for r in rows if r["variant"] == name and r["batch"] == b), 0)
                  for b in batches]
        ax.bar(np.arange(len(batches)) + i * width, values, width, label=name)
    ax.set_xticks(np.arange(len(batches)) + width * (len(names) - 1) / 2, [f"batch {b}" for b in batches])
    ax.set_ylabel("new tokens / s")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("greedy decoding, " + result["settings"]["summary"])
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "tokens_per_s.png"), dpi=120)
    if result["scaling"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        contexts = [r["context"] for r in result["scaling"]]
        ax.plot(contexts, [r["cached_ms"] for r in result["scaling"]], "o-", label="cached step")
        ax.plot(contexts, [r["uncached_ms"] for r in result["scaling"]], "s-", label="uncached (whole prefix)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context length")
        ax.set_ylabel("ms per new token (batch 1)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "context_scaling.png"), dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # (Speculative rounds write up to k proposals past the last token: room for them.)
    max_context = max([args.prompt + args.new + max(args.spec_k, default=0),
                       *[c + args.reps + 1 for c in args.contexts], *args.capacities])
    config = DecoderConfig(vocab_size=args.vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                           n_kv_head=args.n_kv_head, d_model=args.d_model, d_ff=args.d_ff, max_seq_len=max_context,
                           tie_embeddings=args.tied, dtype=args.dtype)
    model = Decoder(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    scanned_config, stacked_params = with_scan_layers(config, params, True)
    scanned_model = Decoder(scanned_config)
    bandwidth = measure_bandwidth()
    summary = (f"{n_params / 1e6:.1f} M params, prompt {args.prompt}, {args.new} new tokens, {args.dtype}, "
               f"{os.cpu_count()} CPU cores")
    print(f"decode benchmark: {summary}; memory bandwidth {bandwidth / 1e9:.1f} GB/s (best read of 512 MB)",
          flush=True)
    hf = None if args.no_hf or args.speculative_only else hf_model(config, params)
    if hf is None and not args.speculative_only:
        print("HF generate: skipped (" + ("--no-hf" if args.no_hf else
              "transformers/torch not installed: pip install -e '.[peers]'") + ")", flush=True)

    rows = []
    for batch in ([] if args.speculative_only else args.batch):
        prompt = jax.random.randint(jax.random.key(batch), (batch, args.prompt), 0, args.vocab_size)
        prompt = np.asarray(prompt, np.int32)
        floor_s = floor_step_seconds(config, params, batch, args.prompt + args.new / 2, bandwidth)
        results = {"jaxformer loop": bench_loop(model, params, prompt, args.new, args.reps),
                   "jaxformer scanned": bench_loop(scanned_model, stacked_params, prompt, args.new, args.reps),
                   "jaxformer stream": bench_stream(model, params, prompt, args.new, args.reps),
                   "jaxformer no cache": bench_uncached(model, params, prompt, args.new, args.reps,
                                                        args.uncached_steps)}
        if hf is not None:
            results["HF generate"] = bench_hf(hf, prompt, args.new, args.reps)
        reference = results["jaxformer loop"]["tokens"]
        for name, result in results.items():
            row = _row(name, batch, result, args.new, floor_s)
            width = result["tokens"].shape[1]
            row["same_tokens"] = bool(np.array_equal(result["tokens"], reference[:, :width]))
            rows.append(row)
        if hf is not None:
            hf_rate = rows[-1]["tokens_per_s"]["median"]
            for row in rows[-len(results):]:
                row["vs_hf"] = row["tokens_per_s"]["median"] / hf_rate
        print_table([r for r in rows if r["batch"] == batch])
        print(flush=True)

    scaling = []
    if args.contexts and not args.speculative_only:
        print("per-token time against context length (batch 1):", flush=True)
        scaling = bench_scaling(model, params, args.contexts, args.reps)
    capacity = []
    if args.capacities and not args.speculative_only:
        print(f"one cached step at context {args.capacity_context} against the cache's capacity (batch 1), "
              "reading every slot or the span:", flush=True)
        capacity = bench_capacity(model, params, args.capacity_context, args.capacities, args.reps)

    speculative = []
    if args.spec_k:
        print("\nspeculative decoding against plain greedy (same run, timed in turns):", flush=True)
        draft_config = config.replace(n_layer=1, d_model=64, n_head=2, n_kv_head=1, d_ff=None)
        draft = Decoder(draft_config)
        draft_params = draft.init(jax.random.key(1), jnp.zeros((1, 1), jnp.int32))["params"]
        workloads = [("random weights", model, params, draft, draft_params,
                      lambda b: np.asarray(jax.random.randint(jax.random.key(b), (b, args.prompt), 0,
                                                              args.vocab_size), np.int32), args.new)]
        if args.copy_steps:
            from train.tasks import COPY_LEN, copy_prompts
            room = 2 * COPY_LEN + 2 + max(args.spec_k)  # [BOS] p [SEP], the copy, the last round's proposals
            small, small_params = copy_model(2, 128, args.draft_steps, batch_size=64, max_seq_len=room)
            big, big_params = copy_model(*args.copy_model, args.copy_steps, batch_size=32, max_seq_len=room)
            copy_prompt = lambda b: np.asarray(copy_prompts(jax.random.key(100 + b), b)[0])  # noqa: E731
            name = "copy {}x{}".format(*args.copy_model)
            workloads += [(name, big, big_params, small, small_params, copy_prompt, COPY_LEN),
                          ("copy 2x128", small, small_params, None, None, copy_prompt, COPY_LEN)]
        for workload, m, p, d, dp, prompts, new in workloads:
            for batch in args.batch:
                proposers = {}
                for k in args.spec_k:
                    proposers[f"lookup k={k}"] = PromptLookup(k=k, n=3)
                    if d is not None:
                        proposers[f"draft k={k}"] = Draft(d, dp, k=k)
                speculative += bench_speculative(m, p, prompts(batch), new, args.reps, proposers, workload)
        print_speculative(speculative)
    versions = {"jax": jax.__version__}
    if hf is not None:
        import torch
        import transformers
        versions |= {"torch": torch.__version__, "transformers": transformers.__version__}
    result = {"config": {k: str(v) if k.endswith("dtype") else v for k, v in vars(config).items()},
              "machine": {"bandwidth_gb_s": bandwidth / 1e9, "cpu_count": os.cpu_count(), **versions},
              "settings": {**vars(args), "summary": summary}, "variants": rows, "scaling": scaling,
              "capacity": capacity, "speculative": speculative}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}/tokens_per_s.png and context_scaling.png")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
