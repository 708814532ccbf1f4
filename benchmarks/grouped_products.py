"""The grouped product of a mixture of experts on this machine: each of `jaxformer.grouped`'s
ways against one dense product of the same rows, in one run.

    python -m benchmarks.grouped_products [--d-model 2048] [--width 1024] [--experts 64] [--top-k 8]
                                          [--tokens 1 8 512] [--dtype bfloat16] [--out grouped.json]

For each number of tokens N (a decoding step's batch, a prefill's length): the `N * k` pairs
of a uniform random routing through `grouped.grouped_product`, "in_blocks" (a scan over
blocks of one expert each: the CPU's way), "unrolled" (that scan unrolled, as a decoding step
runs it, up to `grouped.UNROLLED_BLOCKS` blocks) and "ragged" (`jax.lax.ragged_dot`), against the
same `N * k` rows times ONE `[d_model, width]` matrix (the work without the routing; at
small N the weights' bytes: one matrix, where the experts' product reads up to k of them per
token). The median of `--reps` calls after one untimed one.

Each row also gives the rate at which the experts' product reads its weights: the bytes of the
experts the routing chose (each read once) over "in_blocks"'s time; and, beside it, that of the
dense product of the active size (one row times ONE `[d_model, top_k * width]` matrix, the
bytes of k experts, through `jaxformer.products.product` as a dense decoder's layers multiply):
at one token, what bounds a decoding step's weights.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.decode_1b import seconds
from jaxformer.config import DTYPES
from jaxformer.grouped import KERNEL_PRODUCTS, PRODUCTS, block_size, grouped_product
from jaxformer.products import product

ON_A_CPU = sorted(set(PRODUCTS) - set(KERNEL_PRODUCTS))  # (the Pallas kernels' are a GPU's and a TPU's)
dense_row = jax.jit(lambda x, w: product("nd,df->nf", x, w))  # (one row, as a dense decoder's layer multiplies it)


def rows(args, tokens: int) -> dict:
    dtype = DTYPES[args.dtype]
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (tokens, args.d_model), dtype)
    w = jax.random.normal(keys[1], (args.experts, args.d_model, args.width), dtype) * 0.02
    ids = jax.random.randint(keys[2], (tokens, args.top_k), 0, args.experts)
    block = block_size(tokens * args.top_k, args.experts)
    times = {}
    for how in ON_A_CPU:
        run = jax.jit(lambda x, w, ids, how=how: grouped_product(x, w, ids, block=block, how=how))
        times[how] = seconds(lambda run=run: run(x, w, ids).block_until_ready(), args.reps)
    dense = jax.jit(lambda x, w: jnp.einsum("nd,df->nf", jnp.repeat(x, args.top_k, axis=0), w[0],
                                            preferred_element_type=jnp.float32).astype(x.dtype))
    times["dense"] = seconds(lambda: dense(x, w).block_until_ready(), args.reps)
    active = jax.random.normal(keys[1], (args.d_model, args.top_k * args.width), dtype) * 0.02
    times["dense_active_row"] = seconds(lambda: dense_row(x[:1], active).block_until_ready(), args.reps)
    matrix_bytes = args.d_model * args.width * jnp.dtype(dtype).itemsize
    chosen = len(np.unique(np.asarray(ids)))  # the experts whose matrices the product reads
    return {"tokens": tokens, "block": block, "seconds": times,
            "vs_dense": {how: times[how] / times["dense"] for how in ON_A_CPU},
            "read_gb_per_s": {"in_blocks": chosen * matrix_bytes / times["in_blocks"] / 1e9,
                              "dense_active_row": args.top_k * matrix_bytes / times["dense_active_row"] / 1e9}}



def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grouped_products", description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 512])
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default="grouped.json")
    args = p.parse_args(argv)
    results = [rows(args, n) for n in args.tokens]
    for r in results:
        ms = {how: f"{1e3 * s:.2f} ms" for how, s in r["seconds"].items()}
        print(f"N={r['tokens']} (block {r['block']}): " + ", ".join(f"{how} {t}" for how, t in ms.items())
              + "; vs one dense product: " + ", ".join(f"{how} {v:.2f}x" for how, v in r["vs_dense"].items())
              + "; weights read at: " + ", ".join(f"{how} {v:.1f} GB/s" for how, v in r["read_gb_per_s"].items()))
    with open(args.out, "w") as f:
        json.dump({"settings": vars(args), "backend": jax.default_backend(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
