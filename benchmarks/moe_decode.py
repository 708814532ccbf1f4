"""Greedy decoding of a mixture of experts, jaxformer against transformers, each in a fresh
process, and against a dense model of the same active size.

    python -m benchmarks.moe_decode DIR [--batch 1 8] [--prompt 32] [--new 32] [--no-peer] [--out moe_decode.json]

DIR is a checkpoint folder of experts (`python -m benchmarks.olmoe_7b DIR` writes an
OLMoE-1B-7B-shaped one), decoded in bfloat16. For each batch size:

- jaxformer's `generate` (the whole loop one jitted program, its first call timed apart) and
  transformers' `generate` on torch, greedy, the same prompt ids: new tokens/s over the whole
  call (prefill included) and their ratio, and whether the tokens agree;
- each side's peak resident memory (Linux's VmHWM of its own process) against the weights' bytes;
- jaxformer's tokens/s against the same model made dense, in a process of its own: every layer
  of experts replaced by one gated MLP of `k * width` (the active size; random weights,
  nothing read from DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
import time

import numpy as np

from benchmarks.decode_1b import seconds


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def prompts(batch: int, length: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 400, (batch, length))


def jaxformer_side(folder: str, batches: list[int], prompt_len: int, new: int, reps: int, dense: bool = False
                   ) -> dict:
    """jaxformer's rows; with `dense`, of the same model made dense at its active size: each layer of
    experts one gated MLP `k * width` wide (random weights, nothing read from the folder)."""
    import jax
    import jax.numpy as jnp

    from jaxformer import Decoder, generate
    from jaxformer.convert import load_hf, load_hf_config
    from jaxformer.experts import ExpertsSpec
    from jaxformer.feedforward import GatedMLPSpec

    if dense:
        config = load_hf_config(folder, max_seq_len=prompt_len + new, dtype=jnp.bfloat16)
        config = config.replace(layers=tuple(
            dataclasses.replace(spec, ffn=GatedMLPSpec(spec.ffn.top_k * spec.ffn.width)) if isinstance(
                spec.ffn, ExpertsSpec) else spec for spec in config.layers))
        params = jax.jit(Decoder(config).init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    else:
        config, params = load_hf(folder, max_seq_len=prompt_len + new, dtype=jnp.bfloat16)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    model = Decoder(config)
    rows = []
    for batch in batches:
        prompt = jnp.asarray(prompts(batch, prompt_len), jnp.int32)

        def run(prompt=prompt):
            return generate(model, params, prompt, max_new_tokens=new).block_until_ready()

        start = time.perf_counter()
        out = run()
        first = time.perf_counter() - start
        took = seconds(run, reps)
        rows.append({"batch": batch, "tokens_per_s": batch * new / took, "first_call_s": first,
                     "tokens": np.asarray(out[:, prompt_len:]).tolist()})
    return {"rows": rows, "peak_rss": peak_rss(), "weights_bytes": weights}


def transformers_side(folder: str, batches: list[int], prompt_len: int, new: int, reps: int,
                      dtype: str = "bfloat16") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for batch in batches:
        prompt = torch.as_tensor(prompts(batch, prompt_len))

        def run(prompt=prompt):
            with torch.no_grad():
                return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False)

        took = seconds(run, reps)
        rows.append({"batch": batch, "tokens_per_s": batch * new / took, "tokens": run()[:, prompt_len:].tolist()})
    return {"rows": rows, "peak_rss": peak_rss(), "weights_bytes": weights}


SIDES = {"jaxformer": jaxformer_side, "dense": functools.partial(jaxformer_side, dense=True),
         "transformers": transformers_side}


def in_process_of_its_own(side: str, args) -> dict:
    """`side`'s measurements from a fresh Python process (its peak memory its own)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.moe_decode", args.checkpoint, "--side", side,
                           "--batch", *map(str, args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
                           "--reps", str(args.reps)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{side}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="jaxformer alone (no transformers rows)")
    p.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)  # one side, in this process
    p.add_argument("--out", default="moe_decode.json")
    args = p.parse_args(argv)
    if args.side:
        print(json.dumps(SIDES[args.side](args.checkpoint, args.batch, args.prompt, args.new, args.reps)))
        return
    sides = {side: in_process_of_its_own(side, args) for side in SIDES if side != "transformers" or not args.no_peer}
    ours = sides["jaxformer"]
    for i, row in enumerate(ours["rows"]):
        row["dense_tokens_per_s"] = sides["dense"]["rows"][i]["tokens_per_s"]
        row["vs_dense"] = row["tokens_per_s"] / row["dense_tokens_per_s"]
        line = (f"batch {row['batch']}: jaxformer {row['tokens_per_s']:6.2f} tokens/s, {row['vs_dense']:.2f}x the "
                f"dense model of its active size ({row['dense_tokens_per_s']:.2f})")
        if "transformers" in sides:
            theirs = sides["transformers"]["rows"][i]
            row["vs_transformers"] = row["tokens_per_s"] / theirs["tokens_per_s"]
            row["same_tokens"] = row["tokens"] == theirs["tokens"]
            line += (f"; transformers {theirs['tokens_per_s']:6.2f} tokens/s: {row['vs_transformers']:.2f}x, "
                     f"same tokens: {row['same_tokens']}")
        print(line)
    for side, got in sides.items():
        if side == "dense":
            continue
        got["peak_vs_weights"] = got["peak_rss"] / got["weights_bytes"]
        print(f"{side}: peak memory {got['peak_rss'] / 1e9:.2f} GB, {got['peak_vs_weights']:.2f}x its weights "
              f"({got['weights_bytes'] / 1e9:.2f} GB)")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "sides": sides}, f, indent=1)


if __name__ == "__main__":
    main()
