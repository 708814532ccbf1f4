"""A QLoRA training step (LoRA adapters over a frozen base quantized as it is read): its time, the
quantized base's bytes, the compiled step's own memory and the process's peak, each side in a fresh
process.

    python -m benchmarks.qlora_step DIR [--quantize nf4|int4|int8] [--base-dtype float32] [--batch 1]
        [--seq-len 512] [--steps 1] [--remat] [--quantize-head] [--memory-scheduler] [--no-peer]
        [--out qlora_step.json]

DIR is a checkpoint folder with its tokenizer (`python -m benchmarks.llama_1b DIR` writes a
Llama-3.2-1B-shaped one). jaxformer's step is the one `jaxformer-finetune --quantize` runs:
`jaxformer.commands.finetune.build` (the checkpoint read under `loading_memory`, its matrices
quantized as read; LoRA of rank 8, alpha 16 on all seven projections, float32 adapters; AdamW
with clipping), its `loss_fn` made a step by `make_train_step` with the quantized base an argument
of the compiled program (`frozen`), compiled ahead (`memory_analysis()`: its temporaries, the
activations, and its arguments and outputs). It trains on one batch of random ids
(`benchmarks.finetune.batch_ids`; `build`'s data, a file of random words written here, only has to
be long enough). The median of `--steps` timed steps after one untimed one is reported, with the
peak resident memory (Linux's VmHWM) over the whole process (loading and compiling included) and
over the timed steps alone, and the ratio of the whole process's peak to the quantized base's
stored bytes (`jaxformer.quantized.stored_bytes`) plus the step's temporaries, against the goal of
at most 2. `--base-dtype` is the storage of what is not quantized (the embedding, the head, the
norms), as `jaxformer-finetune --base-dtype`. `--memory-scheduler` compiles jaxformer's step with
XLA:CPU ordering it for memory rather than concurrency (`benchmarks.hybrid_steps.SCHEDULER` false, as
that benchmark runs by default; the commands keep XLA's default): at Llama-3.1-8B's shape, 512
tokens, NF4, its temporaries were 8.1 GiB against 10.1 (the step compiled from the config alone, its
`memory_analysis()`). `--remat` (jaxformer-finetune's) changed nothing there ordered for memory and
made them 14.1 GiB otherwise: XLA:CPU moves an unrolled model's recomputations forward
(docs/performance.md).

The peer, where bitsandbytes imports in this Python (a virtual environment of its own that sees
the rest: `python -m venv --system-site-packages`): transformers' model read with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`, in float32 otherwise, peft's
LoRA of the same adapters, `torch.optim.AdamW` (`benchmarks.finetune.torch_steps`), in a process of
its own: its step time, first loss and peak memory, NF4 whatever `--quantize` says. Without
bitsandbytes its row says so and is skipped. Both quantize a matrix's rows by 64 inputs a float32
scale onto the same code book: the first losses are printed with their difference.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.finetune import batch_ids, hardware, parameter_count, peft_lora, reset_peak, torch_steps
from benchmarks.hybrid_steps import SCHEDULER
from benchmarks.moe_decode import peak_rss
from jaxformer.memory import format_bytes

FORMATS = ("nf4", "int4", "int8")
UNTIMED = 1  # steps before the timed ones (the step is compiled ahead, apart from them)
GOAL = 2.0  # peak RSS within this many times the quantized base plus the step's temporaries
WORD_CHARS = 100  # characters of the data file a position: its held-out tenth holds seq_len + 2 tokens


def data_file(folder: str, seq_len: int) -> str:
    """A text file `finetune.build` takes at `seq_len`: random five-letter words, `WORD_CHARS` characters
    a position, so that its held-out tenth has at least `seq_len + 2` tokens (a token of random letters
    spans far fewer than ten)."""
    rng = np.random.default_rng(0)
    letters = np.array(list(string.ascii_lowercase))
    words = ["".join(rng.choice(letters, 5)) for _ in range(WORD_CHARS * (seq_len + 2) // 6)]
    path = os.path.join(folder, "words.txt")
    with open(path, "w") as f:
        f.write(" ".join(words))
    return path


def jaxformer_row(folder: str, quantize: str, base_dtype: str, batch: int, seq_len: int, steps: int,
                  remat: bool, head: bool = False) -> dict:
    """In this (fresh) process: the QLoRA step's times, first loss, bytes and peaks."""
    import jax

    from jaxformer.commands import finetune
    from jaxformer.quantized import stored_bytes
    from jaxformer.training import TrainState, make_train_step

    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-qlora-") as tmp:
        setup = finetune.build(finetune.Settings(checkpoint=folder, data=data_file(tmp, seq_len), quantize=quantize,
                                                 quantize_head=head, base_dtype=base_dtype, batch_size=batch,
                                                 seq_len=seq_len, remat=remat))
    base = finetune.base_of(setup)
    ids = batch_ids(setup.model.config.vocab_size, batch, seq_len)
    tokens = {"tokens": jax.numpy.asarray(ids[:, :-1]), "targets": jax.numpy.asarray(ids[:, 1:])}
    state = TrainState.create(setup.params, setup.optimizer)
    step = make_train_step(setup.loss_fn, setup.optimizer, frozen=base)  # the base an argument, never a constant
    start = time.perf_counter()
    compiled = step.func.lower(state, tokens, jax.random.key(0), **step.keywords).compile()
    compile_s = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    times, first = [], None
    for i in range(UNTIMED + steps):
        if i == UNTIMED:  # the peak so far (loading, compiling, the untimed step), then the timed steps' own
            whole = peak_rss()
            reset_peak()
        start = time.perf_counter()
        state, metrics = compiled(state, tokens, jax.random.key(i), **step.keywords)
        loss = float(metrics["loss"])  # (waits for the step)
        first = loss if first is None else first
        if i >= UNTIMED:
            times.append(time.perf_counter() - start)
    scheduler = "memory" if f"--{SCHEDULER}=false" in os.environ.get("XLA_FLAGS", "") else "default"
    return {"impl": "jaxformer", "quantize": quantize, "head": head, "base_dtype": base_dtype, "remat": remat,
            "scheduler": scheduler,
            "times_s": times, "step_s": statistics.median(times), "compile_s": compile_s, "first_loss": first,
            "base_bytes": stored_bytes(base), "float32_bytes": 4 * parameter_count(folder),
            "temp_bytes": analysis.temp_size_in_bytes, "argument_bytes": analysis.argument_size_in_bytes,
            "output_bytes": analysis.output_size_in_bytes, "alias_bytes": analysis.alias_size_in_bytes,
            "peak_rss": max(whole, peak_rss()), "steps_peak_rss": peak_rss()}


def peft_bnb_row(folder: str, batch: int, seq_len: int, steps: int, remat: bool) -> dict:
    """In this (fresh) process: peft's LoRA over bitsandbytes' NF4 base, its times, first loss and peak."""
    import bitsandbytes
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    nf4 = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4, device_map="cpu",
                                                              dtype=torch.float32)
    # QLoRA's recipe: the norms in float32, and with --remat peft's gradient checkpointing (recompute per layer).
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=remat)
    model = peft.get_peft_model(model, peft_lora())
    ids = batch_ids(model.config.vocab_size, batch, seq_len)
    times, first = torch_steps(model, ids, steps, untimed=UNTIMED)
    return {"impl": "peft + bitsandbytes", "quantize": "nf4", "remat": remat, "times_s": times,
            "step_s": statistics.median(times), "first_loss": first, "peak_rss": peak_rss(),
            "versions": f"bitsandbytes {bitsandbytes.__version__}, peft {peft.__version__}"}


def in_a_process(args, impl: str) -> dict:
    """One side's run in a fresh Python process (its own peak memory): its JSON result."""
    command = [sys.executable, "-m", "benchmarks.qlora_step", args.checkpoint, "--one", impl,
               "--quantize", args.quantize, "--base-dtype", args.base_dtype, "--batch", str(args.batch),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps), *(["--remat"] if args.remat else []),
               *(["--quantize-head"] if args.quantize_head else [])]
    env = dict(os.environ)
    if impl == "jaxformer" and args.memory_scheduler:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --{SCHEDULER}=false".strip()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1:]  # (a process killed from outside ends on what it last wrote)
        killed = [f"killed by {signal.Signals(-done.returncode).name}"] if done.returncode < 0 else []
        return {"impl": impl, "failed": killed + last}
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> list[str]:
    """The printed lines: each side's step and peak; jaxformer's bytes, step memory and the goal's ratio;
    the ratios between the sides, from this one run."""
    lines = []
    for r in rows:
        if "failed" in r or "skipped" in r:
            lines.append(f"{r['impl']}: {'failed: ' + ' '.join(r['failed']) if 'failed' in r else r['skipped']}")
            continue
        flags = (f"{' --remat' if r['remat'] else ''}{' --quantize-head' if r.get('head') else ''}"
                 f"{' --base-dtype ' + r['base_dtype'] if r.get('base_dtype', 'float32') != 'float32' else ''}"
                 f"{' ordered for memory' if r.get('scheduler') == 'memory' else ''}")
        lines.append(f"{r['impl']} {r['quantize']}{flags}: step {r['step_s']:.3f} s "
                     f"(median of {len(r['times_s'])}), first loss {r['first_loss']:.5f}, "
                     f"peak RSS {format_bytes(r['peak_rss'])}")
        if r["impl"] != "jaxformer":
            continue
        goal = r["base_bytes"] + r["temp_bytes"]
        lines += [f"  compiled in {r['compile_s']:.1f} s; quantized base {format_bytes(r['base_bytes'])} "
                  f"({r['base_bytes'] / r['float32_bytes']:.3f}x float32's {format_bytes(r['float32_bytes'])})",
                  f"  step (memory_analysis): temporaries {format_bytes(r['temp_bytes'])}, arguments "
                  f"{format_bytes(r['argument_bytes'])}, outputs {format_bytes(r['output_bytes'])} "
                  f"({format_bytes(r['alias_bytes'])} of them aliased to arguments)",
                  f"  peak RSS over the timed steps {format_bytes(r['steps_peak_rss'])}",
                  f"  peak RSS / (quantized base + temporaries) = {r['peak_rss'] / goal:.2f} "
                  f"(goal: within {GOAL:g}: {'met' if r['peak_rss'] <= GOAL * goal else 'not met'})"]
    ours = next((r for r in rows if r["impl"] == "jaxformer" and "step_s" in r), None)
    peer = next((r for r in rows if r["impl"] != "jaxformer" and "step_s" in r), None)
    if ours and peer:
        lines.append(f"jaxformer's step takes {ours['step_s'] / peer['step_s']:.2f}x {peer['impl']}'s time, its peak "
                     f"RSS is {ours['peak_rss'] / peer['peak_rss']:.2f}x theirs; the first losses differ by "
                     f"{abs(ours['first_loss'] - peer['first_loss']):.2e}")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qlora_step", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--quantize", choices=FORMATS, default="nf4", help="the base's format (the peer's is NF4)")
    p.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="jaxformer's storage of what is not quantized (embedding, head, norms)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=1, help=f"timed steps, after {UNTIMED} untimed")
    p.add_argument("--remat", action="store_true", help="recompute each block's activations in the backward pass")
    p.add_argument("--quantize-head", action="store_true", help="jaxformer's embedding and head quantized too")
    p.add_argument("--memory-scheduler", action="store_true",
                   help="jaxformer's step compiled with XLA:CPU ordering it for memory, not concurrency")
    p.add_argument("--no-peer", action="store_true", help="jaxformer alone (no peft + bitsandbytes row)")
    p.add_argument("--out", default="qlora_step.json")
    p.add_argument("--one", choices=("jaxformer", "peft"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args(argv)
    for flag, value in (("--batch", args.batch), ("--seq-len", args.seq_len), ("--steps", args.steps)):
        if value < 1:
            p.error(f"{flag} must be at least 1, not {value}")
    if args.one == "jaxformer":
        print(json.dumps(jaxformer_row(args.checkpoint, args.quantize, args.base_dtype, args.batch, args.seq_len,
                                       args.steps, args.remat, args.quantize_head)))
        return
    if args.one == "peft":
        print(json.dumps(peft_bnb_row(args.checkpoint, args.batch, args.seq_len, args.steps, args.remat)))
        return
    print(f"{hardware()}\nbatch {args.batch} x {args.seq_len} tokens; LoRA r=8 alpha 16 on all seven projections, "
          f"float32 adapters, AdamW", flush=True)
    rows = [in_a_process(args, "jaxformer")]
    if not args.no_peer:
        rows.append(in_a_process(args, "peft") if importlib.util.find_spec("bitsandbytes") else
                    {"impl": "peft + bitsandbytes", "skipped": f"skipped: bitsandbytes is not importable in "
                                                              f"{sys.executable}"})
    for line in report(rows):
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump({"settings": {k: v for k, v in vars(args).items() if k != "one"}, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
