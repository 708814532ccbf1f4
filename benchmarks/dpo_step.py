"""A LoRA DPO step: `jaxformer-finetune --method dpo`'s against TRL's `DPOTrainer` with peft, on one
checkpoint folder and the same pairs; and a LoRA DPO run's peak memory against a LoRA SFT run's of
as many rows.

    python -m benchmarks.dpo_step DIR [--pairs 2] [--seq-len 512] [--steps 3] [--out dpo_step.json]

DIR is a checkpoint folder with its tokenizer (`python -m benchmarks.llama_1b DIR` writes a
Llama-3.2-1B-shaped one). The preference file, written here, holds one pair `--pairs + 1` times
(jaxformer holds its last tenth out, TRL takes the first `--pairs`): a prompt of about a quarter
of the window, and two answers each long enough that prompt and answer pass `--seq-len + 1` ids.
Every row of either side is then the whole window (jaxformer's rows cut to `--seq-len` inputs,
TRL's sequences to `max_length = --seq-len + 1` ids: the same `--seq-len` predicted positions, the
same answer tokens scored), and whichever training pairs a batch draws, both sides train on the
same rows.

jaxformer's step is built as `jaxformer-finetune --method dpo` builds it:
`jaxformer.commands.finetune.build(Settings(method="dpo", ...))` (LoRA of rank 8, alpha 16 on all
seven projections, beta 0.1, float32), then run as `jaxformer.training.runs.train` runs it:
`make_train_step(setup.loss_fn, setup.optimizer, frozen=setup.frozen)` on
`TrainState.create(setup.params, setup.optimizer)`, update `s` on `setup.make_batch(data_key)`,
`(data_key, dropout_key) = step_keys(seed, s)`. A step's time is the call until its metrics are
on the host (the batch drawn before it): the policy's forward and backward, the reference's
forward (the base, adapters off) and AdamW's update with clipping, one compiled program.

TRL's step: `trl.DPOTrainer` of the transformers model of the same folder in float32 with
`peft_config` (peft's adapters of the same config, no `ref_model`: its reference is the base with
the adapters off, as jaxformer's), `DPOConfig(bf16=False, use_cpu=True, report_to=[], beta=0.1,
max_length=seq_len + 1, gradient_checkpointing=False)` (TRL's default checkpoints the gradient;
jaxformer's `--remat` is off), a batch of `--pairs` pairs, the same peak learning rate and
clipping, torch on as many threads as cores. `trainer.train()` runs the steps, and a `TrainerCallback` times each from
its `on_step_begin` to its `on_step_end`: `training_step` (the policy's forward and backward, the
reference's forward), the gradient's clipping, AdamW's step, the schedule's and `zero_grad`; the
batch's loading and collation before it, and the logging after, are outside, as jaxformer's batch is.

Each side runs in a fresh process; the median of `--steps` timed steps after 2 untimed ones
(compilation, warm-up) is reported, with the first step's loss (ln 2 on both: `B = 0`, so the
policy is its reference) and mean log-probability of the chosen answers under the policy (the
same model scoring the same tokens: equal within float32's rounding).

Memory: jaxformer's DPO process above, and a LoRA SFT process built and stepped the same way
(`Settings(method="sft")` on a text file, a batch of `2 x --pairs` rows of `--seq-len`: the rows
of DPO's pairs): each one's peak resident memory (Linux's VmHWM) over its whole life (loading and
compiling included) and over the timed steps. DPO's reference is the base with its adapters off,
the weights held once, so the ratio stays near 1 (what DPO adds is the reference's forward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.finetune import ALPHA, RANK, hardware, peft_lora, reset_peak
from benchmarks.moe_decode import peak_rss
from benchmarks.qlora_step import data_file
from jaxformer.commands.dpo import BETA  # DPO's reward scale, 0.1: --beta's default, TRL's
from jaxformer.memory import format_bytes

UNTIMED = 2  # steps before the timed ones: the first compiles
SEED = 0
LN2 = float(np.float32(np.log(2.0)))  # the first step's loss: the policy is its reference
FIRST = ("loss", "logps/chosen", "logps/rejected")  # what both sides log of the first step


def words(tokenizer, prefix: str, count: int, rng: np.random.Generator) -> str:
    """Random five-letter words, each after a space, until `prefix` and they make at least `count` ids."""
    text = ""
    while len(tokenizer.encode(prefix + text)) < count:
        text += " " + "".join(rng.choice(list(string.ascii_lowercase), 5))
    return text


def pairs_file(folder: str, checkpoint: str, pairs: int, seq_len: int) -> str:
    """A preference file of one pair, `pairs + 1` times: its prompt about `seq_len / 4` ids, each
    answer making at least `seq_len + 2` ids with it (both sides cut every row to the window)."""
    from jaxformer.text import load_tokenizer

    tokenizer, rng = load_tokenizer(checkpoint), np.random.default_rng(SEED)
    prompt = words(tokenizer, "", seq_len // 4, rng).lstrip()
    record = {"prompt": prompt, "chosen": words(tokenizer, prompt, seq_len + 2, rng),
              "rejected": words(tokenizer, prompt, seq_len + 2, rng)}
    path = os.path.join(folder, "pairs.jsonl")
    Path(path).write_text((json.dumps(record) + "\n") * (pairs + 1))
    return path


def jaxformer_row(checkpoint: str, data: str, method: str, pairs: int, seq_len: int, steps: int) -> dict:
    """In this (fresh) process: jaxformer's LoRA step of `method` ("dpo", or "sft" on `2 pairs`
    rows), its times, first metrics and peaks."""
    import jax

    from jaxformer.commands import finetune
    from jaxformer.training import TrainState, make_train_step, step_keys

    dpo = method == "dpo"
    settings = finetune.Settings(checkpoint=checkpoint, data=data, method=method, beta=BETA if dpo else None,
                                 lora_rank=RANK, lora_alpha=ALPHA, batch_size=pairs if dpo else 2 * pairs,
                                 seq_len=seq_len, dtype="float32", base_dtype="float32", seed=SEED)
    setup = finetune.build(settings)
    state = TrainState.create(setup.params, setup.optimizer)
    step = make_train_step(setup.loss_fn, setup.optimizer, frozen=setup.frozen)
    times, first = [], None
    for s in range(UNTIMED + steps):
        data_key, dropout_key = step_keys(settings.seed, s)
        batch = jax.block_until_ready(setup.make_batch(data_key))
        if s == UNTIMED:  # the peak so far (loading, compiling, the untimed steps), then the timed steps' own
            whole = peak_rss()
            reset_peak()
        start = time.perf_counter()
        state, metrics = step(state, batch, dropout_key)
        metrics = jax.device_get(metrics)  # (waits for the step)
        if s >= UNTIMED:
            times.append(time.perf_counter() - start)
        first = first or {name: float(value) for name, value in metrics.items() if name in FIRST}
    return {"impl": f"jaxformer {method.upper()}", "rows": 2 * pairs, "times_s": times,
            "step_s": statistics.median(times), "first": first, "peak_rss": max(whole, peak_rss()),
            "steps_peak_rss": peak_rss()}


def trl_row(checkpoint: str, data: str, pairs: int, seq_len: int, steps: int) -> dict:
    """In this (fresh) process: TRL's DPOTrainer with peft's LoRA, its times, first metrics and peak."""
    import datasets
    import torch
    import transformers
    import trl

    from jaxformer.commands import finetune

    torch.set_num_threads(os.cpu_count())
    times = []

    class StepTimes(transformers.TrainerCallback):
        """Each optimizer step's seconds, from its `on_step_begin` to its `on_step_end`."""

        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.start)

    defaults = finetune.Settings()
    records = [json.loads(line) for line in Path(data).read_text().splitlines()][:pairs]  # jaxformer's training pairs
    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-dpo-trl-") as tmp:
        args = trl.DPOConfig(output_dir=tmp, report_to=[], bf16=False, use_cpu=True, disable_tqdm=True, beta=BETA,
                             max_length=seq_len + 1, gradient_checkpointing=False, per_device_train_batch_size=pairs,
                             max_steps=UNTIMED + steps, logging_steps=1, save_strategy="no",
                             learning_rate=defaults.lr, max_grad_norm=defaults.clip, seed=SEED)
        trainer = trl.DPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(checkpoint,
                                                                                         dtype=torch.float32),
                                 args=args, processing_class=transformers.AutoTokenizer.from_pretrained(checkpoint),
                                 train_dataset=datasets.Dataset.from_list(records), peft_config=peft_lora(),
                                 callbacks=[StepTimes()])
        trainer.train()
    logged = trainer.state.log_history[0]  # the first step's (logging_steps=1)
    return {"impl": "TRL DPOTrainer + peft", "rows": 2 * pairs, "times_s": times[UNTIMED:],
            "step_s": statistics.median(times[UNTIMED:]), "first": {name: float(logged[name]) for name in FIRST},
            "peak_rss": peak_rss(), "versions": f"trl {trl.__version__}"}


def in_a_process(args, one: str, data: str) -> dict:
    """One row's run in a fresh Python process (its own peak memory): its JSON result."""
    command = [sys.executable, "-m", "benchmarks.dpo_step", args.checkpoint, "--one", one, "--data", data,
               "--pairs", str(args.pairs), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {one} row failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(ours: dict, trl: dict, sft: dict) -> dict:
    """The figures against their baselines of the same run."""
    return {"speed_vs_trl": trl["step_s"] / ours["step_s"],
            "chosen_logps_relative_difference": abs(ours["first"]["logps/chosen"] / trl["first"]["logps/chosen"] - 1),
            "dpo_over_sft_peak_rss": ours["peak_rss"] / sft["peak_rss"],
            "dpo_over_sft_steps_peak_rss": ours["steps_peak_rss"] / sft["steps_peak_rss"]}


def report(rows: list[dict], figures: dict) -> list[str]:
    """The printed lines: each row's step, first metrics and peak; then the ratios."""
    lines = []
    for r in rows:
        first = r["first"]
        chosen = f", logps/chosen {first['logps/chosen']:.4f}" if "logps/chosen" in first else ""
        steps_peak = f" ({format_bytes(r['steps_peak_rss'])} over the timed steps)" if "steps_peak_rss" in r else ""
        lines.append(f"{r['impl']} ({r['rows']} rows): step {r['step_s']:.3f} s (median of {len(r['times_s'])}), "
                     f"first loss {first['loss']:.6f}{chosen}, peak RSS {format_bytes(r['peak_rss'])}{steps_peak}")
    ours, trl = rows[0], rows[1]
    lines += [f"jaxformer's DPO step runs at {figures['speed_vs_trl']:.2f}x TRL's speed (TRL's time / jaxformer's; "
              f"goal: at least 1.0x)",
              f"first step's loss: jaxformer {ours['first']['loss']:.6f}, TRL {trl['first']['loss']:.6f} "
              f"(ln 2 = {LN2:.6f}); the chosen answers' log-probabilities differ by "
              f"{figures['chosen_logps_relative_difference']:.1e} relatively",
              f"DPO / SFT peak RSS: {figures['dpo_over_sft_peak_rss']:.3f} over the process, "
              f"{figures['dpo_over_sft_steps_peak_rss']:.3f} over the timed steps (the reference is the base, "
              f"adapters off: no second copy of the weights)"]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dpo_step", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--pairs", type=int, default=2, help="pairs a step (two rows each)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens a row")
    p.add_argument("--steps", type=int, default=3, help=f"timed steps, after {UNTIMED} untimed")
    p.add_argument("--out", default="dpo_step.json")
    p.add_argument("--one", choices=("dpo", "sft", "trl"), help=argparse.SUPPRESS)  # a child's run
    p.add_argument("--data", help=argparse.SUPPRESS)  # the child's data file
    args = p.parse_args(argv)
    for flag, value in (("--pairs", args.pairs), ("--seq-len", args.seq_len), ("--steps", args.steps)):
        if value < 1:
            p.error(f"{flag} must be at least 1, not {value}")
    if args.one == "trl":
        print(json.dumps(trl_row(args.checkpoint, args.data, args.pairs, args.seq_len, args.steps)))
        return
    if args.one is not None:
        print(json.dumps(jaxformer_row(args.checkpoint, args.data, args.one, args.pairs, args.seq_len, args.steps)))
        return
    print(f"{hardware()}\n{args.pairs} pairs x 2 rows x {args.seq_len} tokens; LoRA r={RANK} alpha {ALPHA:g} on all "
          f"seven projections, beta {BETA}, float32, AdamW with clipping", flush=True)
    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-dpo-") as tmp:
        pairs = pairs_file(tmp, args.checkpoint, args.pairs, args.seq_len)
        rows = [in_a_process(args, "dpo", pairs), in_a_process(args, "trl", pairs),
                in_a_process(args, "sft", data_file(tmp, args.seq_len))]
    figures = ratios(*rows)
    for line in report(rows, figures):
        print(line, flush=True)
    with open(args.out, "w") as f:
        settings = {k: v for k, v in vars(args).items() if k not in ("one", "data")}
        json.dump({"hardware": hardware(), "settings": settings, "jaxformer": rows[0], "trl": rows[1], "sft": rows[2],
                   "ratios": figures}, f, indent=1)


if __name__ == "__main__":
    main()
