"""Causal attention alone, by path: dense, the `jnp` blocks and, on a GPU or TPU, the kernels.

    python -m benchmarks.attention_paths [--lengths 2048 8192] [--heads 8] [--head-dim 64]
                                         [--dtype float32] [--repeats 5] [--out F.json]

For each length T, one sequence of T queries over its own T keys (`attention.attend` with
kind "dense", and `blockwise.blockwise_attention`, the `jnp` blocks, and `attention.in_blocks`,
which lowers to the platform's kernel), the median time of `--repeats` calls after the one
that compiles: the forward alone, and the forward with the gradient of q, k and v. Every path is
timed in the same run; the ratios are against dense. On a CPU `in_blocks` is the `jnp` blocks.
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxformer.attention import FULL_WINDOW, Visibility, attend, in_blocks
from jaxformer.blockwise import blockwise_attention


def paths():
    """`{name: f(q, k, v, positions)}`, each a causal attention of `[1, T, heads, head_dim]`."""
    return {
        "dense": lambda q, k, v, pos: attend(q, k, v, Visibility(pos, pos, jnp.int32(FULL_WINDOW)), kind="dense")[0],
        "jnp blocks": lambda q, k, v, pos: blockwise_attention(q, k, v, pos[None], pos[None], jnp.int32(FULL_WINDOW)),
        "in_blocks": lambda q, k, v, pos: in_blocks(q, k, v, pos[None], pos[None], jnp.int32(FULL_WINDOW)),
    }


def seconds(fn, args, repeats: int) -> float:
    """The median time of `repeats` calls of the jitted `fn`, after the one that compiles."""
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, {args.dtype}")
    print(f"{'T':>7} {'path':>11} {'fwd ms':>9} {'vs dense':>9} {'fwd+bwd ms':>11} {'vs dense':>9}")
    rows = []
    for T in args.lengths:
        q, k, v = (jax.random.normal(key, (1, T, args.heads, args.head_dim), args.dtype)
                   for key in jax.random.split(jax.random.key(T), 3))
        pos, cotangent = jnp.arange(T, dtype=jnp.int32), jnp.ones_like(q)
        dense = None
        for name, f in paths().items():
            forward = jax.jit(f)
            backward = jax.jit(jax.grad(lambda q, k, v, pos, f=f, cotangent=cotangent: jnp.sum(
                f(q, k, v, pos) * cotangent).astype(jnp.float32), argnums=(0, 1, 2)))
            row = {"T": T, "path": name, "forward_seconds": seconds(forward, (q, k, v, pos), args.repeats),
                   "gradient_seconds": seconds(backward, (q, k, v, pos), args.repeats)}
            dense = dense or row
            rows.append(row)
            print(f"{T:>7} {name:>11} {row['forward_seconds'] * 1e3:>9.2f} "
                  f"{row['forward_seconds'] / dense['forward_seconds']:>8.2f}x {row['gradient_seconds'] * 1e3:>11.2f} "
                  f"{row['gradient_seconds'] / dense['gradient_seconds']:>8.2f}x", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device.device_kind, "backend": jax.default_backend(), "dtype": args.dtype,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
