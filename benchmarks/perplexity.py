"""Sliding-window perplexity, jaxformer's `perplexity` against transformers' documented recipe, in one run.

    python -m benchmarks.perplexity DIR [--tokens 2048] [--window 512] [--stride 256]
                                        [--dtypes float32 bfloat16] [--out perplexity.json]

DIR is a checkpoint folder (`python -m benchmarks.llama_1b DIR` writes a Llama-3.2-1B-shaped
one). The text is `--tokens` random ids (seeded), the same for both. For each dtype:
jaxformer's `jaxformer.text.perplexity.perplexity` (one jitted program for every window; its
first call, which compiles, is timed apart) and transformers' recipe for a fixed-length model
(`transformers_nll`: a forward with `labels` per window, under `torch.no_grad`, as many threads
as cores). Reported: ids scored per second (the text's ids over the call's time), the ratio to
transformers in the same dtype, and both NLLs (they must agree: float32 within rtol 1e-4, a
direct check that the two measured the same thing).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from benchmarks.decode_1b import seconds
from jaxformer import Decoder
from jaxformer.config import DTYPES
from jaxformer.convert import load_hf, load_hf_config
from jaxformer.text.perplexity import perplexity


def transformers_nll(model, ids, window: int, stride: int, torch) -> float:
    """transformers' documented recipe for the perplexity of a fixed-length model, as written there."""
    input_ids = torch.tensor([ids])
    seq_len = input_ids.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + window, seq_len)
        trg_len = end_loc - prev_end_loc
        window_ids = input_ids[:, begin_loc:end_loc]
        target_ids = window_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(window_ids, labels=target_ids).loss
        num_loss_tokens = (target_ids != -100).sum().item() - target_ids.size(0)
        nll_sum += loss.item() * num_loss_tokens
        n_tokens += num_loss_tokens
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum / n_tokens


def jaxformer_row(folder: str, dtype: str, ids: np.ndarray, window: int, stride: int, reps: int) -> dict:
    config, params = load_hf(folder, max_seq_len=window, dtype=DTYPES[dtype])
    model = Decoder(config)
    start = time.perf_counter()
    result = perplexity(model, params, ids, window, stride)
    first_call_s = time.perf_counter() - start
    took = seconds(lambda: perplexity(model, params, ids, window, stride), reps)
    return {"impl": "jaxformer", "dtype": dtype, "nll": result.nll, "ids_per_s": len(ids) / took,
            "first_call_s": first_call_s}


def transformers_row(folder: str, dtype: str, ids: np.ndarray, window: int, stride: int, reps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids = ids.tolist()
    took = seconds(lambda: transformers_nll(model, ids, window, stride, torch), reps)
    return {"impl": "transformers", "dtype": dtype, "nll": transformers_nll(model, ids, window, stride, torch),
            "ids_per_s": len(ids) / took}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.perplexity", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--out", default="perplexity.json")
    args = p.parse_args(argv)
    vocab = load_hf_config(args.checkpoint).vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, args.tokens)
    rows = []
    for dtype in args.dtypes:
        ours = jaxformer_row(args.checkpoint, dtype, ids, args.window, args.stride, args.reps)
        theirs = transformers_row(args.checkpoint, dtype, ids, args.window, args.stride, args.reps)
        ours["vs_transformers"] = ours["ids_per_s"] / theirs["ids_per_s"]
        if dtype == "float32" and not np.isclose(ours["nll"], theirs["nll"], rtol=1e-4):
            raise RuntimeError(f"the float32 NLLs differ: {ours['nll']} against {theirs['nll']}")
        rows += [ours, theirs]
        for r in (ours, theirs):
            ratio = f"  {r['vs_transformers']:.2f}x transformers" if "vs_transformers" in r else ""
            print(f"{r['impl']:12s} {dtype:8s}: {r['ids_per_s']:7.1f} ids/s  nll {r['nll']:.6f}{ratio}")
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
