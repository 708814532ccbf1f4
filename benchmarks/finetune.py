"""Fine-tuning steps and memory: jaxformer's LoRA step against HF torch + peft's, and a LoRA
run's peak memory against full fine-tuning's, on one random Llama-shaped checkpoint.

    python -m benchmarks.finetune [--d-model 768] [--layers 8] [--vocab 16384] [--batch 4] [--seq-len 256]
                                  [--steps 5] [--out benchmarks/results/finetune.json]
    python -m benchmarks.finetune --checkpoint DIR --lora-only [--batch 1] [--seq-len 512] [--steps 1]

The checkpoint is made here (transformers' `LlamaForCausalLM`, random, saved with
`save_pretrained`), or `--checkpoint` names one (`python -m benchmarks.llama_1b DIR` writes a
Llama-3.2-1B-shaped one); nothing is downloaded. `--lora-only` times the LoRA rows alone
(with and without `--remat` on jaxformer's side) and skips full fine-tuning and the memory
probes: at the 1B shape full fine-tuning's float32 Adam state alone passes 19 GB. Every row
trains on the same batch of random ids, next-token loss on every position, float32, AdamW.

Step time: jaxformer's step is `jaxformer.training.make_train_step` over the loss of
`Decoder(config.replace(lora=...))` (the base read, the adapters trained), LoRA of rank 8
(alpha 16) on all seven projections; torch's is `peft.get_peft_model` of the same model with
the same adapters, `torch.optim.AdamW` over the adapters, forward with the loss, backward,
step and zero_grad, with as many threads as cores. Both start from the same weights with
`B = 0`, so their first losses must agree (checked). The median of `--steps` timed steps
after two untimed ones (compilation, warm-up) is reported; full fine-tuning of both is timed
the same way, for context.

Memory: each jaxformer configuration (LoRA or full, `--remat` off or on, and LoRA over a
bfloat16 base) runs in a fresh Python process that loads the checkpoint, builds the state
and takes three steps; its peak resident memory (Linux's VmHWM: what the operating system
counts for the process over its life, compilation's transient peak and the JAX runtime's
few hundred MB included), its peak over the training steps after the first (Linux's VmHWM,
reset once the first step, which compiles, is done: the parameters, optimizer state and
activations of training), and XLA's own account of the compiled step (`memory_analysis()`:
the step's arguments, outputs and temporaries; the runtime and Python objects not included).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import Decoder, chunked_cross_entropy
from jaxformer.convert import load_hf, load_hf_config
from jaxformer.lora import LoraConfig, init_lora
from jaxformer.training import TrainState, make_train_step

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA, LR = 8, 16.0, 1e-4
MEMORY_CONFIGS = {  # name -> (lora, remat, base dtype)
    "lora": (True, False, "float32"), "lora --remat": (True, True, "float32"),
    "full": (False, False, "float32"), "full --remat": (False, True, "float32"),
    "lora --base-dtype bfloat16": (True, False, "bfloat16"),
    "lora --remat --base-dtype bfloat16": (True, True, "bfloat16")}
PROBE_STEPS = 3


def make_checkpoint(path: str, d_model: int, layers: int, vocab: int, seq_len: int) -> None:
    """A random Llama-shaped checkpoint folder: 4 query heads per kv head, SwiGLU 8/3 wide."""
    import transformers

    heads = d_model // 64
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=d_model,
                                      intermediate_size=d_model * 8 // 3 // 64 * 64,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=max(1, heads // 4), max_position_embeddings=seq_len,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def batch_ids(vocab: int, batch: int, seq_len: int) -> np.ndarray:
    """The batch every row trains on: `[batch, seq_len + 1]` random ids."""
    return np.random.default_rng(0).integers(0, vocab, (batch, seq_len + 1))


def jax_step(path: str, ids: np.ndarray, lora: bool, remat: bool, base_dtype: str = "float32",
             targets: tuple[str, ...] = TARGETS):
    """`(step, state, batch)`: jaxformer's jitted update and its first state, LoRA (on `targets`) or full."""
    config, base = load_hf(path, param_dtype=jnp.dtype(base_dtype))
    adapters = LoraConfig(rank=RANK, alpha=ALPHA, targets=targets) if lora else None
    model = Decoder(config.replace(lora=adapters, remat=remat))
    optimizer = optax.adamw(LR)

    def loss_fn(trained, batch, dropout_key, base=None):  # LoRA's base: an argument of the step, not a constant
        variables = {"params": base, "lora": trained} if lora else {"params": trained}
        hidden, _ = model.apply(variables, batch["tokens"], hidden=True)  # the loss jaxformer-finetune runs
        head = model.output_head(variables["params"])
        return chunked_cross_entropy(hidden, batch["targets"], head, 0.0), {}

    trained = init_lora(base, adapters, jax.random.key(0)) if lora else base
    batch = {"tokens": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}
    step = make_train_step(loss_fn, optimizer, frozen=base if lora else None)
    return step, TrainState.create(trained, optimizer), batch


def time_jax(path: str, ids: np.ndarray, lora: bool, steps: int, remat: bool = False,
             targets: tuple[str, ...] = TARGETS) -> tuple[list[float], float]:
    """Each timed step's seconds, and the first step's loss."""
    step, state, batch = jax_step(path, ids, lora, remat, targets=targets)
    times, first = [], None
    for i in range(steps + 2):
        start = time.perf_counter()
        state, metrics = step(state, batch, jax.random.key(i))
        loss = float(metrics["loss"])  # (waits for the step)
        first = loss if first is None else first
        if i >= 2:
            times.append(time.perf_counter() - start)
    return times, first


def time_torch(path: str, ids: np.ndarray, lora: bool, steps: int, targets: tuple[str, ...] = TARGETS
               ) -> tuple[list[float], float]:
    """The same for transformers (+ peft): each timed step's seconds, and the first step's loss."""
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        model = peft.get_peft_model(model, peft_lora(targets))
    return torch_steps(model, ids, steps)


def peft_lora(targets: tuple[str, ...] = TARGETS):
    """peft's config of the adapters every LoRA row trains: rank 8, alpha 16 on `targets`, no dropout."""
    import peft

    return peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets), lora_dropout=0.0)


def torch_steps(model, ids: np.ndarray, steps: int, untimed: int = 2) -> tuple[list[float], float]:
    """`untimed` then `steps` timed AdamW steps of a torch model over its trainable parameters:
    each timed step's seconds, and the first step's loss."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    tokens, targets = torch.tensor(ids[:, :-1]), torch.tensor(ids[:, 1:])
    times, first = [], None
    for i in range(steps + untimed):
        start = time.perf_counter()
        logits = model(input_ids=tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.item()
        first = value if first is None else first
        if i >= untimed:
            times.append(time.perf_counter() - start)
    return times, first


def resident_peak_mb() -> float:
    """The process's resident peak since it started or since `reset_peak` (Linux's VmHWM: this
    process's own, where `ru_maxrss` would carry over the peak of the process that started it)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def reset_peak() -> None:
    """Starts Linux's resident high-water mark again from the current size."""
    Path("/proc/self/clear_refs").write_text("5")


def probe(path: str, ids_file: str, name: str) -> dict:
    """In this (fresh) process: one configuration's steps, then its peak memory: over the
    whole process (compilation's transient peak included), and over the training steps
    after the first (which compiles)."""
    lora, remat, base_dtype = MEMORY_CONFIGS[name]
    ids = np.load(ids_file)
    step, state, batch = jax_step(path, ids, lora, remat, base_dtype)
    program, bound = (step.func, step.keywords) if isinstance(step, functools.partial) else (step, {})  # LoRA's base
    analysis = program.lower(state, batch, jax.random.key(0), **bound).compile().memory_analysis()
    state, metrics = step(state, batch, jax.random.key(0))
    jax.block_until_ready(metrics)
    whole = resident_peak_mb()
    reset_peak()
    for i in range(1, PROBE_STEPS + 1):
        state, metrics = step(state, batch, jax.random.key(i))
        jax.block_until_ready(metrics)
    xla = None if analysis is None else (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                                         + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
    training = resident_peak_mb()
    return {"peak_rss_mb": max(whole, training), "training_peak_mb": training,
            "xla_step_mb": None if xla is None else xla / 2**20}


def measure_memory(path: str, ids_file: str, name: str) -> dict:
    """`probe` of one configuration in a fresh Python process."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.finetune", "--probe", name, "--checkpoint", path,
                           "--ids", ids_file], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the {name!r} probe failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def hardware() -> str:
    """The CPU's model name and core count, and the versions compared."""
    import peft
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, peft {peft.__version__}")


def parameter_count(path: str) -> int:
    """The checkpoint's parameters, from its config alone (nothing read)."""
    model = Decoder(load_hf_config(path))
    return sum(x.size for x in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0), *model.init_inputs())))


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-finetune-") as tmp:
        path, ids_file = args.checkpoint or os.path.join(tmp, "checkpoint"), os.path.join(tmp, "ids.npy")
        if args.checkpoint is None:
            make_checkpoint(path, args.d_model, args.layers, args.vocab, args.seq_len)
        config = load_hf_config(path)
        ids = batch_ids(config.vocab_size, args.batch, args.seq_len)
        np.save(ids_file, ids)
        n_params = parameter_count(path)
        print(f"{hardware()}\nmodel: d_model {config.d_model}, {config.n_layer} layers, vocab {config.vocab_size}, "
              f"{n_params / 1e6:.1f} M params; batch {args.batch} x {args.seq_len} tokens, float32; "
              f"LoRA r={RANK} on {len(TARGETS)} projections\n")
        rows = [("jaxformer LoRA", functools.partial(time_jax, lora=True)),
                ("jaxformer LoRA --remat", functools.partial(time_jax, lora=True, remat=True)),
                ("torch + peft LoRA", functools.partial(time_torch, lora=True))]
        if not args.lora_only:
            rows += [("jaxformer full", functools.partial(time_jax, lora=False)),
                     ("torch full", functools.partial(time_torch, lora=False))]
        steps = {}
        for name, timer in rows:
            times, first = timer(path, ids, steps=args.steps)
            steps[name] = {"median_s": statistics.median(times), "times_s": times, "first_loss": first}
            print(f"  {name:24s} step {statistics.median(times):7.3f} s (median of {len(times)})   "
                  f"first loss {first:.5f}")
        agree = abs(steps["jaxformer LoRA"]["first_loss"] - steps["torch + peft LoRA"]["first_loss"])
        if agree > 1e-4 * abs(steps["torch + peft LoRA"]["first_loss"]):
            raise RuntimeError(f"the first LoRA losses differ by {agree}: the two sides do not train the same model")
        memory = {} if args.lora_only else {name: measure_memory(path, ids_file, name) for name in MEMORY_CONFIGS}
        if memory:
            print(f"\n  {'configuration':36s} {'peak RSS MB':>12s} {'training MB':>12s} {'XLA step MB':>12s}")
        for name, m in memory.items():
            xla = m["xla_step_mb"]
            print(f"  {name:36s} {m['peak_rss_mb']:12.0f} {m['training_peak_mb']:12.0f} "
                  f"{'-' if xla is None else f'{xla:12.0f}'}")
    peft_s = steps["torch + peft LoRA"]["median_s"]
    ratios = {"lora_step_speedup_vs_peft": peft_s / steps["jaxformer LoRA"]["median_s"],
              "lora_remat_step_speedup_vs_peft": peft_s / steps["jaxformer LoRA --remat"]["median_s"]}
    if not args.lora_only:
        ratios["full_step_speedup_vs_torch"] = steps["torch full"]["median_s"] / steps["jaxformer full"]["median_s"]
    for suffix in ("", " --remat") if memory else ():
        for measure in ("peak_rss_mb", "training_peak_mb", "xla_step_mb"):
            full = memory[f"full{suffix}"][measure]
            if full:
                ratios[f"lora{suffix.replace(' --', '_')} / full{suffix.replace(' --', '_')} {measure}"] = \
                    memory[f"lora{suffix}"][measure] / full
                ratios[f"lora{suffix.replace(' --', '_')}_bf16_base / full{suffix.replace(' --', '_')} {measure}"] = \
                    memory[f"lora{suffix} --base-dtype bfloat16"][measure] / full
    print()
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}{'x' if 'speedup' in name else ''}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if v is not None}
    return {"hardware": hardware(), "settings": settings, "params": n_params, "steps": steps, "memory": memory,
            "ratios": ratios}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps of each row, after two untimed ones")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    p.add_argument("--probe", choices=MEMORY_CONFIGS, help=argparse.SUPPRESS)  # (the memory subprocess)
    p.add_argument("--checkpoint", help="an existing checkpoint folder (then --d-model, --layers, --vocab unused)")
    p.add_argument("--lora-only", action="store_true", help="the LoRA rows alone: no full fine-tuning, no memory probe")
    p.add_argument("--ids", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe is not None:
        print(json.dumps(probe(args.checkpoint, args.ids, args.probe)))
        return 0
    results = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
