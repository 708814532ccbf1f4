"""Greedy decoding of the 1B shape, jaxformer against transformers in one run.

    python -m benchmarks.decode_1b DIR [--batch 1 8] [--prompt 32] [--new 32] [--no-peer] [--out decode_1b.json]

DIR is a checkpoint folder (`python -m benchmarks.llama_1b DIR` writes a Llama-3.2-1B-shaped
one). For each dtype (float32, bfloat16) and batch size: jaxformer's `generate` (the whole
loop one jitted program; its compile is timed apart) and transformers' `generate` on torch
(the peers extra), greedy, the same prompt ids, `--new` tokens after a `--prompt`-token
prompt. Reported: new tokens/s over the whole call (prefill included), the ratio to
transformers' in the same dtype and batch, and "% of floor": the weights' bytes read once
per step at the bandwidth of a jitted sum over them, over the measured step time.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import Decoder, generate
from jaxformer.config import DTYPES
from jaxformer.convert import load_hf


def seconds(run, reps: int) -> float:
    """The median wall time of `run()` over `reps` calls (after one untimed call)."""
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def jaxformer_rows(folder: str, dtype: str, batches: list[int], prompt_len: int, new: int, reps: int) -> list[dict]:
    config, params = load_hf(folder, max_seq_len=prompt_len + new, dtype=DTYPES[dtype])
    model = Decoder(config)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    read = jax.jit(lambda p: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(p)))
    bandwidth = nbytes / seconds(lambda: read(params).block_until_ready(), 3)
    rows = []
    for batch in batches:
        prompt = jnp.asarray(np.random.default_rng(0).integers(0, 400, (batch, prompt_len)), jnp.int32)
        start = time.perf_counter()
        out = generate(model, params, prompt, max_new_tokens=new).block_until_ready()
        compile_s = time.perf_counter() - start
        took = seconds(lambda prompt=prompt: generate(model, params, prompt, max_new_tokens=new).block_until_ready(),
                       reps)
        rows.append({"impl": "jaxformer", "dtype": dtype, "batch": batch, "tokens_per_s": batch * new / took,
                     "first_call_s": compile_s, "floor_pct": 100 * (nbytes / bandwidth) / (took / new),
                     "tokens": np.asarray(out[:, prompt_len:]).tolist()})
    return rows


def transformers_rows(folder: str, dtype: str, batches: list[int], prompt_len: int, new: int, reps: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    rows = []
    for batch in batches:
        prompt = torch.as_tensor(np.random.default_rng(0).integers(0, 400, (batch, prompt_len)))

        def run(prompt=prompt):
            with torch.no_grad():
                return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False)
        took = seconds(run, reps)
        rows.append({"impl": "transformers", "dtype": dtype, "batch": batch, "tokens_per_s": batch * new / took,
                     "tokens": run()[:, prompt_len:].tolist()})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_1b", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--no-peer", action="store_true", help="jaxformer alone (no transformers rows): an accelerator run")
    p.add_argument("--out", default="decode_1b.json")
    args = p.parse_args(argv)
    rows = []
    for dtype in args.dtypes:
        for make in (jaxformer_rows,) if args.no_peer else (jaxformer_rows, transformers_rows):
            rows += make(args.checkpoint, dtype, args.batch, args.prompt, args.new, args.reps)
    peer = {(r["dtype"], r["batch"]): r for r in rows if r["impl"] == "transformers"}
    float32 = {r["batch"]: r for r in rows if r["impl"] == "jaxformer" and r["dtype"] == "float32"}
    for r in rows:
        line = f"{r['impl']:12s} {r['dtype']:8s} batch {r['batch']}: {r['tokens_per_s']:6.2f} tokens/s"
        if r["batch"] in float32 and r["impl"] == "jaxformer":
            r["vs_float32"] = r["tokens_per_s"] / float32[r["batch"]]["tokens_per_s"]
            line += f"  {r['vs_float32']:.2f}x float32"
        if (r["dtype"], r["batch"]) in peer:
            hf = peer[r["dtype"], r["batch"]]
            r["vs_transformers"] = r["tokens_per_s"] / hf["tokens_per_s"]
            r["same_tokens"] = r["tokens"] == hf["tokens"]
            line += f"  {r['vs_transformers']:.2f}x transformers  same tokens: {r['same_tokens']}"
        if "floor_pct" in r:
            line += f"  {r['floor_pct']:.0f} % of floor"
        print(line)
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
