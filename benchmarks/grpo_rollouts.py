"""GRPO's rollouts: the serving engine sampling a step's completions all at once against one at a
time, and the share of a whole GRPO step that sampling takes.

    python -m benchmarks.grpo_rollouts DIR [--prompts 4] [--num-generations 8] [--max-new 64]
        [--repeats 3] [--out grpo_rollouts.json]

DIR is a checkpoint folder with its tokenizer (`python -m benchmarks.llama_1b DIR` writes a
Llama-3.2-1B-shaped one). The run is built as `jaxformer-finetune --method grpo` builds it:
`jaxformer.commands.finetune.build(Settings(method="grpo", ...))` on a prompt file written here
(short text prompts, `--prompts` of them to train on), `--reward regex` (a builtin: no module of
the user's), LoRA of rank 8, alpha 16 on all seven projections, float32, `--num-generations`
completions of each prompt of at most `--max-new` tokens at temperature 1, the window
`PROMPT_ROOM + --max-new` tokens. Its `grpo.Objective` holds the engine (`jaxformer.serving.engine.
Engine`, `max_batch` = prompts x generations, the window its capacity), warmed up first
(`Engine.warmup`: every program at every shape, so no timed call compiles).

Sampling: the first step's prompts, each repeated `--num-generations` times with its keys, as
`Objective.rollouts` expands them (completion `j` of prompt `i` from `fold_in(keys[i], j)`), under
the checkpoint's weights (`B = 0`), by `Objective.sample`:

  all at once     `Objective.sample` of the whole list: `Engine.submit_all` queues every request,
                  the engine decodes them together; the median of `--repeats` calls after one
                  untimed one
  one at a time   `Objective.sample` of one request at a time on the same engine, each finished
                  before the next is submitted (the engine's one-row programs), every request
                  once, after one untimed

Each figure is completions (and completion tokens) per second; a request's draws depend on its
key alone, so both ways sample the same completions (the run says whether they did).

The step: `Objective.make_step`'s step (the one `jaxformer-finetune` runs: the rollouts sampled
and scored, then an update on them), on update `s`'s batch (`setup.make_batch(data_key)`,
`(data_key, dropout_key) = step_keys(seed, s)`), timed until its metrics are on the host; and
before it, on the same batch and the same weights, `Objective.rollouts` alone (sampling, the
rewards, the rows), which samples the same completions as the step then does. Medians of
`--repeats` steps after one untimed one (which compiles the update); the share is the rollouts'
median over the step's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.finetune import ALPHA, RANK
from jaxformer.text.dataset import HELD_OUT

PROMPT_ROOM = 32  # the window's ids before the completion's: the prompts are about 10
REWARD_PATTERN = "[a-z ]+"  # `--reward regex`: a completion of lowercase words earns 1
UNTIMED = 1  # calls before the timed ones
SEED = 0


def prompts_file(folder: str, prompts: int) -> str:
    """A prompt file with `prompts` prompts to train on (and the held-out ones after them)."""
    n = prompts + 1
    while n - max(1, round(HELD_OUT * n)) < prompts:  # `PromptData`'s split: its last tenth (at least one) held out
        n += 1
    path = os.path.join(folder, "prompts.jsonl")
    Path(path).write_text("".join(json.dumps({"prompt": f"Question {i}: name a colour."}) + "\n" for i in range(n)))
    return path


def machine() -> str:
    """The CPU's model name and core count, JAX's version and the device it computes on."""
    import jax

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "CPU")
    return f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on {jax.devices()[0].device_kind}"


def sampling(setup, repeats: int) -> dict:
    """The first step's completions sampled all at once and one at a time: each way's times and tokens."""
    import jax

    from jaxformer.training import step_keys

    objective, group = setup.objective, setup.objective.recipe.group
    batch = setup.make_batch(step_keys(SEED, 0)[0])
    # [N]: each prompt's group together, completion j of prompt i from fold_in(keys[i], j), as `rollouts` has them
    prompts = [objective.data.train[int(i)] for i in np.asarray(batch["prompt"]) for _ in range(group)]
    keys = [jax.random.fold_in(key, j) for key in batch["sample"] for j in range(group)]
    params = setup.params
    objective.sample(params, prompts, keys)  # (untimed)
    together = []
    for _ in range(repeats):
        start = time.perf_counter()
        batched = objective.sample(params, prompts, keys)
        together.append(time.perf_counter() - start)
    objective.sample(params, prompts[:1], keys[:1])  # (untimed)
    alone, single = [], []
    for prompt, key in zip(prompts, keys):
        start = time.perf_counter()
        single += objective.sample(params, [prompt], [key])
        alone.append(time.perf_counter() - start)
    return {"completions": len(prompts), "all_at_once_s": together, "all_at_once_median_s": statistics.median(together),
            "all_at_once_tokens": sum(map(len, batched)), "one_at_a_time_s": alone,
            "one_at_a_time_total_s": sum(alone), "one_at_a_time_tokens": sum(map(len, single)),
            "same_completions": sum(a == b for a, b in zip(batched, single))}


def steps(setup, repeats: int) -> dict:
    """`repeats` GRPO steps after `UNTIMED`, each after its rollouts alone: their times, and the
    mean completion length each logged (the same completions: the same lengths)."""
    import jax

    from jaxformer.training import TrainState, step_keys

    objective = setup.objective
    state = TrainState.create(setup.params, setup.optimizer)
    step = setup.make_step(setup.optimizer)  # (`runs.train`'s: `make_step(optimizer, state_sharding)`)
    rollouts, whole, lengths = [], [], []
    for s in range(UNTIMED + repeats):
        data_key, dropout_key = step_keys(SEED, s)
        batch = setup.make_batch(data_key)
        if s >= UNTIMED:  # the step's own rollouts: its prompts, keys and weights
            prompts = [objective.data.train[int(i)] for i in np.asarray(batch["prompt"])]
            start = time.perf_counter()
            _, found = jax.block_until_ready(objective.rollouts(state.params, prompts, batch["sample"]))
            rollouts.append(time.perf_counter() - start)
        start = time.perf_counter()
        state, metrics = step(state, batch, dropout_key)
        metrics = jax.device_get(metrics)  # (waits for the step)
        if s >= UNTIMED:
            whole.append(time.perf_counter() - start)
            lengths.append((float(found["completion_length"]), float(metrics["completion_length"])))
    return {"rollouts_s": rollouts, "rollouts_median_s": statistics.median(rollouts), "step_s": whole,
            "step_median_s": statistics.median(whole), "completion_lengths": lengths}


def run(args) -> dict:
    from jaxformer.commands import finetune

    with tempfile.TemporaryDirectory(prefix="jaxformer-bench-grpo-") as tmp:
        settings = finetune.Settings(checkpoint=args.checkpoint, data=prompts_file(tmp, args.prompts), method="grpo",
                                     num_generations=args.num_generations, max_completion_length=args.max_new,
                                     reward="regex", reward_pattern=REWARD_PATTERN, lora_rank=RANK, lora_alpha=ALPHA,
                                     batch_size=args.prompts, seq_len=PROMPT_ROOM + args.max_new, dtype="float32",
                                     base_dtype="float32", seed=SEED)
        setup = finetune.build(settings)
    setup.objective.engine.warmup()
    sampled = sampling(setup, args.repeats)
    timed = steps(setup, args.repeats)
    setup.objective.engine.close()
    n = sampled["completions"]
    figures = {"all_at_once_completions_per_s": n / sampled["all_at_once_median_s"],
               "one_at_a_time_completions_per_s": n / sampled["one_at_a_time_total_s"],
               "rollouts_share_of_step": timed["rollouts_median_s"] / timed["step_median_s"]}
    figures["all_at_once_over_one_at_a_time"] = (figures["all_at_once_completions_per_s"]
                                                 / figures["one_at_a_time_completions_per_s"])
    return {"machine": machine(), "settings": vars(args), "sampling": sampled, "steps": timed, "ratios": figures}


def report(results: dict) -> list[str]:
    """The printed lines: each way's completions per second, their ratio, and the step's share."""
    s, t, r, a = results["sampling"], results["steps"], results["ratios"], results["settings"]
    n = s["completions"]
    return [f"{results['machine']}",
            f"{a['prompts']} prompts x {a['num_generations']} completions of at most {a['max_new']} tokens, "
            f"temperature 1; LoRA r={RANK} alpha {ALPHA:g} on all seven projections, float32",
            f"all at once (Engine.submit_all): {s['all_at_once_median_s']:.3f} s for {n} (median of "
            f"{len(s['all_at_once_s'])}): {r['all_at_once_completions_per_s']:.2f} completions/s, "
            f"{s['all_at_once_tokens'] / s['all_at_once_median_s']:.1f} tokens/s",
            f"one at a time (the same engine, each request finished before the next): "
            f"{s['one_at_a_time_total_s']:.3f} s for {n}: {r['one_at_a_time_completions_per_s']:.2f} completions/s, "
            f"{s['one_at_a_time_tokens'] / s['one_at_a_time_total_s']:.1f} tokens/s",
            f"all at once / one at a time: {r['all_at_once_over_one_at_a_time']:.2f}x the completions per second; "
            f"the same completions: {s['same_completions']} of {n}",
            f"GRPO step: {t['step_median_s']:.3f} s (median of {len(t['step_s'])}), its rollouts alone "
            f"{t['rollouts_median_s']:.3f} s: sampling and scoring take {r['rollouts_share_of_step']:.0%} of the step"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpo_rollouts", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompts", type=int, default=4, help="prompts a step")
    p.add_argument("--num-generations", type=int, default=8, help="completions of each prompt")
    p.add_argument("--max-new", type=int, default=64, help="the most tokens of a completion")
    p.add_argument("--repeats", type=int, default=3, help=f"timed calls of each median, after {UNTIMED} untimed")
    p.add_argument("--out", default="grpo_rollouts.json")
    args = p.parse_args(argv)
    for flag, value, least in (("--prompts", args.prompts, 1), ("--num-generations", args.num_generations, 2),
                               ("--max-new", args.max_new, 1), ("--repeats", args.repeats, 1)):
        if value < least:
            p.error(f"{flag} must be at least {least}, not {value}")
    results = run(args)
    for line in report(results):
        print(line, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
