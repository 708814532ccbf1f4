"""A Qwen3-Next-shaped prefill and training step against the length: time and memory linear in T?
And the prefill against transformers' CPU path on the same folder.

    python -m benchmarks.hybrid_steps [--lengths 2048 8192 32768] [--layers 4] [--experts 16] [--top-k 4]
                                      [--vocab 32768] [--divisor 1] [--param-dtype float32] [--reps 3]
                                      [--timeout 300] [--concurrent-scheduler] [--out hybrid_steps.json]

The folder is made here (transformers' `Qwen3NextForCausalLM`, random, float32, `save_pretrained`);
nothing is downloaded. Its shape is Qwen3-Next-80B-A3B's at every width: d_model 2048; full attention
of 16 query / 2 kv heads of 256 with the output gate and partial rotary 0.25; Gated DeltaNet of 16 key
/ 32 value heads of 128, conv 4; experts of 512 with a shared expert of 512. Reduced so that it fits
a small CPU machine and runs in minutes: `--layers` 4 of the 48 (3 linear + 1 full, as each group of
four ships), `--experts` 16 of the 512 with `--top-k` 4 of the 10, `--vocab` 32,768 of 151,936.
`--divisor` divides every width (d_model, each head's channels, the experts') for a tiny run.

For each length T, each program in a fresh process (one row, `[1, T]` random ids):

- jaxformer's prefill: the jitted forward of `Decoder` (parameters as arguments) to the last
  position's logits; its training step: `jaxformer.training.make_train_step` over the chunked cross
  entropy, full fine-tuning with AdamW (`benchmarks.finetune.jax_step`);
- transformers' prefill: `from_pretrained`, float32, `torch.no_grad`, the last position's logits
  (`logits_to_keep=1`), torch's own fallback kernels for the linear layers (no fla, no causal-conv1d).

Time: the median of `--reps` runs after compiling (torch: after loading), wall and CPU (the
process's user and system seconds, every thread's: on a machine others share, the steadier of the
two). Memory: XLA's account of the compiled program (`memory_analysis()`: arguments + outputs +
temp - aliased) and each process's resident peak (Linux's VmHWM: the weights, compiling and the
runs). Bounded: a jaxformer program whose XLA bytes pass 80 % of what its process could hold (its
resident size and Linux's MemAvailable) is compiled only; where the shorter length's one run,
scaled linearly, would pass `--timeout`, it is compiled only too (transformers' is skipped); a
process still running after `--timeout` seconds is stopped, its finished runs kept; one that fails
(killed for memory) is reported so. Each line says which, with the bound.

On a CPU, XLA orders a program's operations by default so that independent ones may run at once
(`--xla_cpu_enable_concurrency_optimized_scheduler`), which keeps many more buffers alive: this
model's prefill at 2k allocates 1,528 MiB so and 647 MiB ordered for memory, in the same time on 2
cores. jaxformer's probes run ordered for memory (the flag false in their `XLA_FLAGS`, unless the
caller's says otherwise), or as by default with `--concurrent-scheduler`; transformers' are untouched.

Each figure's ratio to the shortest length's is printed beside it (linear in T: 4x at 8k and 16x at
32k; full attention's scores are quadratic in time, linear in memory with `attention_impl`
"blocks"), and transformers' prefill time over jaxformer's (above 1: jaxformer is faster); the two
last-position logits' largest difference says they ran the same model.
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

from benchmarks.finetune import batch_ids, hardware, resident_peak_mb

LENGTHS = (2048, 8192, 32768)
PROGRAMS = ("prefill", "train", "torch")  # jaxformer's prefill and training step, transformers' prefill
FIT = 0.8  # a jaxformer program runs where XLA's bytes are at most this share of what its process could hold
SCHEDULER = "xla_cpu_enable_concurrency_optimized_scheduler"  # XLA:CPU's ordering for concurrency (docstring)
# Qwen3-Next-80B-A3B-Instruct's config.json, its architecture fields (those not set from the flags).
CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "full_attention_interval": 4, "hidden_act": "silu", "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "mlp_only_layers": [],
    "norm_topk_prob": True, "num_attention_heads": 16, "num_key_value_heads": 2, "output_router_logits": False,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "use_sliding_window": False,
}
WIDTHS = {"hidden_size": 2048, "head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
          "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "intermediate_size": 5120}


def folder_config(args) -> dict:
    return dict(CONFIG, **{k: v // args.divisor for k, v in WIDTHS.items()}, num_hidden_layers=args.layers,
                num_experts=args.experts, num_experts_per_tok=args.top_k, vocab_size=args.vocab,
                max_position_embeddings=max(args.lengths))


def make_checkpoint(path: str, args) -> int:
    """Writes the random folder; returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**folder_config(args)))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def emit(**figures) -> None:
    """One line of a probe's report to its parent (read even if the probe is stopped later)."""
    print(json.dumps(figures), flush=True)


def probe_jax(path: str, ids: np.ndarray, program: str, reps: int, param_dtype: str) -> np.ndarray | None:
    import jax
    import jax.numpy as jnp

    from benchmarks.finetune import jax_step
    from jaxformer import Decoder
    from jaxformer.convert import load_hf

    if program == "prefill":
        config, params = load_hf(path, param_dtype=jnp.dtype(param_dtype))
        model = Decoder(config)

        def prefill(params, tokens):  # [1, T] -> the next token's logits [1, 1, vocab]
            hidden, _ = model.apply({"params": params}, tokens, hidden=True)
            return model.output_head(params).logits(hidden[:, -1:])

        args = (params, jnp.asarray(ids[:, :-1]))
        compiled = jax.jit(prefill).lower(*args).compile()
    else:
        step, state, batch = jax_step(path, ids, lora=False, remat=False, base_dtype=param_dtype)
        args = (state, batch, jax.random.key(0))
        compiled = step.lower(*args).compile()
    m = compiled.memory_analysis()
    needs = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    has = (resident_peak_mb() + available_mb()) * 2 ** 20  # (the arguments are resident already)
    emit(xla_bytes=needs, **({"unfit_mb": has / 2 ** 20} if needs > FIT * has else {}))
    out = None
    for _ in range(reps if needs <= FIT * has else 0):
        start, cpu = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(compiled(*args))
        emit(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu)
        if program == "train":  # (the state is donated: the next step takes the new one)
            args = (out[0], *args[1:])
    return None if out is None or program == "train" else np.asarray(out, np.float32)[0, -1]


def probe_torch(path: str, ids: np.ndarray, reps: int) -> np.ndarray | None:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, out = torch.tensor(ids[:, :-1]), None
    with torch.no_grad():
        for _ in range(reps):
            start, cpu = time.perf_counter(), time.process_time()
            out = model(input_ids=tokens, logits_to_keep=1, use_cache=False).logits
            emit(seconds=time.perf_counter() - start, cpu_seconds=time.process_time() - cpu)
    return None if out is None else out[0, -1].float().numpy()


def available_mb() -> float:
    """The memory Linux could give this process now (MemAvailable), others' processes left as they are."""
    line = next(x for x in open("/proc/meminfo").read().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) / 1024


def probe(args) -> None:
    """In this (fresh) process: one program at one length, each figure a line as soon as it is known.
    Should the machine run out of memory regardless, Linux stops this process first, not another's."""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    ids = batch_ids(args.vocab, 1, args.probe_length)
    if args.probe == "torch":
        logits = probe_torch(args.checkpoint, ids, args.reps)
    else:
        logits = probe_jax(args.checkpoint, ids, args.probe, args.reps, args.param_dtype)
    emit(rss_mb=resident_peak_mb(), **({} if logits is None else {"logits": logits.tolist()}))


def measure(path: str, program: str, T: int, reps: int, args) -> dict:
    """`probe` in a fresh process, stopped after `args.timeout` seconds: the figures it reported."""
    command = [sys.executable, "-m", "benchmarks.hybrid_steps", "--probe", program, "--probe-length", str(T),
               "--checkpoint", path, "--reps", str(reps), "--vocab", str(args.vocab),
               "--param-dtype", args.param_dtype]
    env = dict(os.environ)
    if program != "torch" and not args.concurrent_scheduler and SCHEDULER not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --{SCHEDULER}=false".strip()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, check=False, env=env)
        stdout, stopped, code = done.stdout, False, done.returncode
    except subprocess.TimeoutExpired as e:
        stdout, stopped, code = e.stdout or "", True, None
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    runs = [x for x in lines if "seconds" in x]
    out = {"times_s": [x["seconds"] for x in runs], "cpu_times_s": [x["cpu_seconds"] for x in runs],
           "stopped": stopped, "reps": reps, "exit_code": code}
    for x in lines:
        out |= {k: v for k, v in x.items() if k not in ("seconds", "cpu_seconds")}
    if runs:
        out["seconds"], out["cpu_seconds"] = statistics.median(out["times_s"]), statistics.median(out["cpu_times_s"])
    return out


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-hybrid-") as root:
        path = os.path.join(root, "checkpoint")
        n_params = make_checkpoint(path, args)
        header = (f"{hardware()}\nQwen3-Next-shaped, random, float32 folder: {n_params / 1e6:.0f} M parameters; "
                  f"d_model {2048 // args.divisor}, full attention 16 q / 2 kv heads of {256 // args.divisor} "
                  f"(output gate, partial rotary 0.25), Gated DeltaNet 16 key / 32 value heads of "
                  f"{128 // args.divisor}, conv 4, experts of {512 // args.divisor} + shared; reduced: "
                  f"{args.layers} layers of 48, {args.experts} experts of 512 (top {args.top_k} of 10), vocab "
                  f"{args.vocab} of 151936; jaxformer's parameters {args.param_dtype}; one row [1, T]; XLA:CPU's "
                  f"ordering {'for concurrency' if args.concurrent_scheduler else 'for memory'}")
        print(header, flush=True)
        rows = []
        for T in args.lengths:
            row = {"T": T}
            for program in PROGRAMS:
                before = rows[-1][program] if rows else None
                bound = before and before.get("seconds", float("inf")) * T / rows[-1]["T"] > args.timeout
                if bound and program == "torch":
                    row[program] = {"skipped": True, "times_s": []}
                else:
                    row[program] = measure(path, program, T, 0 if bound else args.reps, args)
                    row[program]["skipped"] = bool(bound)
            rows.append(row)
            print(line(row, rows[0], args.timeout), flush=True)
    return {"settings": vars(args), "hardware": hardware(), "params": n_params, "header": header, "rows": rows}


def missing(m: dict, timeout: float) -> str:
    """Why a program has no figure."""
    if "unfit_mb" in m:
        return f"does not fit: XLA's bytes over {FIT:.0%} of the {m['unfit_mb']:,.0f} MiB its process could hold"
    if m["skipped"]:
        return f"skipped: one run scaled linearly from the shorter length passes {timeout:.0f} s"
    if m["stopped"]:
        return f"stopped after {timeout:.0f} s"
    return "none" if m["exit_code"] == 0 else f"its process failed, exit code {m['exit_code']} (-9: out of memory)"


def line(row: dict, first: dict, timeout: float) -> str:
    """One length's figures, each with its ratio to the first length's."""
    def figure(program: str, key: str, unit: str, scale: float = 1.0) -> str:
        value, base = row[program].get(key), first[program].get(key)
        if value is None:
            return f"- ({missing(row[program], timeout)})"
        if key == "rss_mb" and not row[program]["times_s"]:  # (a peak of loading and compiling alone)
            return f"{value:,.0f} {unit} (compiling only)"
        ratio = f" ({value / base:.1f}x)" if base else ""
        return f"{value / scale:,.{2 if unit == 's' else 0}f} {unit}{ratio}"

    parts = [f"T={row['T']} ({row['T'] / first['T']:.0f}x):"]
    for program, name in (("prefill", "jaxformer prefill"), ("train", "jaxformer train step")):
        runs = row[program]["times_s"]
        parts.append(f"{name} {figure(program, 'seconds', 's')} [{len(runs)} of {row[program]['reps']} runs], "
                     f"CPU {figure(program, 'cpu_seconds', 's')}, "
                     f"XLA {figure(program, 'xla_bytes', 'MiB', 2 ** 20)}, RSS {figure(program, 'rss_mb', 'MiB')};")
    parts.append(f"transformers prefill {figure('torch', 'seconds', 's')}, CPU {figure('torch', 'cpu_seconds', 's')}, "
                 f"RSS {figure('torch', 'rss_mb', 'MiB')}")
    mine, theirs = row["prefill"], row["torch"]
    if "seconds" in mine and "seconds" in theirs:
        parts.append(f"; transformers / jaxformer prefill {theirs['seconds'] / mine['seconds']:.2f}x, "
                     f"CPU {theirs['cpu_seconds'] / mine['cpu_seconds']:.2f}x")
    if "logits" in mine and "logits" in theirs:
        a, b = np.asarray(mine["logits"]), np.asarray(theirs["logits"])
        parts.append(f"; last logits differ by {np.max(np.abs(a - b)):.1e} (of max {np.max(np.abs(b)):.1e})")
    return " ".join(parts)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hybrid_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--layers", type=int, default=4, help="of the shipped 48: every fourth full attention")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--divisor", type=int, default=1, help="divides every width (a tiny run)")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each program, after compiling")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each program's process may run")
    p.add_argument("--concurrent-scheduler", action="store_true",
                   help="jaxformer's programs ordered as XLA:CPU does by default (for concurrency, not memory)")
    p.add_argument("--out", default="hybrid_steps.json")
    p.add_argument("--probe", choices=PROGRAMS, help=argparse.SUPPRESS)  # (the measuring subprocess)
    p.add_argument("--probe-length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe is not None:
        probe(args)
        return None
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
