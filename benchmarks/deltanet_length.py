"""Gated DeltaNet's chunked form against the length: time and memory linear in T?

    python -m benchmarks.deltanet_length [--lengths 2048 8192 32768] [--time-heads 8] [--out F.json]

A Qwen3-Next-shaped linear-attention layer: 16 key heads and 32 value heads of 128 channels,
d_model 2048, one row (batch 1). For each length T, from compiling alone, XLA's account of each
program (`compiled.memory_analysis()`; `temp`: what it allocates beyond its inputs and outputs):

- the chunked rule (`jaxformer.deltanet.chunked_delta_rule`, chunks of 64), its forward and its
  forward and backward (the gradient of a scalar of its output and final state w.r.t. all six inputs);
- the whole layer (`GatedDeltaNet`, its projections of d_model 2048 included), forward and forward and
  backward (w.r.t. the input and the parameters).

The rule's two programs also run once each, after compiling, at `--time-heads` value heads (half as
many key heads; by default 8, a quarter of Qwen3-Next's: heads are independent, so the ratios between
lengths are those of 32, and the run stays within a minute or two on 2 CPU cores, where the full
32k forward and backward alone takes a minute and allocates 13 GiB). Their wall time and their CPU
time (the process's user and system seconds, every thread's: on a machine others share, the steadier
of the two) are printed. The layer's time is its projections' (linear by construction) and the rule's.

Each figure's ratio to the shortest length's is printed beside it: linear in T is 4x at 8k and 16x
at 32k.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from jaxformer import DecoderConfig
from jaxformer.attention import Part
from jaxformer.deltanet import GatedDeltaNet, GatedDeltaNetSpec, chunked_delta_rule, l2_normalize

SPEC = GatedDeltaNetSpec(n_key_head=16, n_value_head=32, key_dim=128, value_dim=128, conv_kernel=4, chunk=64)
D_MODEL = 2048
LENGTHS = (2048, 8192, 32768)


def rule_inputs(batch: int, T: int, s: GatedDeltaNetSpec = SPEC) -> tuple[jax.Array, ...]:
    """`(q, k, v, g, beta, state)` as the layer makes them: unit q and k, decays in (-1, 0], writes in (0, 1)."""
    keys = jax.random.split(jax.random.key(0), 6)
    return (l2_normalize(jax.random.normal(keys[0], (batch, T, s.n_key_head, s.key_dim))),
            l2_normalize(jax.random.normal(keys[1], (batch, T, s.n_key_head, s.key_dim))),
            jax.random.normal(keys[2], (batch, T, s.n_value_head, s.value_dim)),
            -jax.random.uniform(keys[3], (batch, T, s.n_value_head)),
            jax.random.uniform(keys[4], (batch, T, s.n_value_head)),
            jnp.zeros((batch, s.n_value_head, s.key_dim, s.value_dim)))


def rule_forward(*args):
    return chunked_delta_rule(*args, chunk=SPEC.chunk)


def rule_backward(*args):
    def scalar(*args):
        o, state = rule_forward(*args)
        return jnp.sum(o) + jnp.sum(state)
    return jax.grad(scalar, argnums=tuple(range(6)))(*args)


def layer_programs(batch: int, T: int):
    """`(forward, backward, params, x)`: the whole layer's two programs and their inputs' shapes."""
    config = DecoderConfig(vocab_size=256, n_layer=1, n_head=16, n_kv_head=2, d_model=D_MODEL, max_seq_len=T)
    part = (Part(batch, T, None, None, {}, None),)
    layer = GatedDeltaNet(config, SPEC)
    x = jax.ShapeDtypeStruct((batch, T, D_MODEL), jnp.float32)
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.zeros(x.shape), part))

    def forward(params, x):
        return layer.apply(params, x, part)[0]

    def backward(params, x):
        return jax.grad(lambda p, x: jnp.sum(forward(p, x)), argnums=(0, 1))(params, x)

    return forward, backward, params, x


def memory(compiled) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    temp = analysis.temp_size_in_bytes
    return {"temp": temp, "total": temp + analysis.argument_size_in_bytes + analysis.output_size_in_bytes}


def measure(batch: int, T: int, time_heads: int) -> dict:
    shapes = jax.eval_shape(lambda: rule_inputs(batch, T))
    timed = rule_inputs(batch, T, dataclasses.replace(SPEC, n_key_head=time_heads // 2, n_value_head=time_heads))
    out = {"T": T}
    for name, fn in (("rule_forward", rule_forward), ("rule_backward", rule_backward)):
        compiled = jax.jit(fn).lower(*timed).compile()
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*timed))
        out[name] = {"seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
                     **memory(jax.jit(fn).lower(*shapes).compile())}
    forward, backward, params, x = layer_programs(batch, T)
    for name, fn in (("layer_forward", forward), ("layer_backward", backward)):
        out[name] = memory(jax.jit(fn).lower(params, x).compile())
    return out


def table(rows: list[dict]) -> str:
    first = rows[0]

    def cell(row, program, figure):
        value, base = row[program][figure], first[program][figure]
        shown = f"{value:.2f} s" if figure.endswith("seconds") else f"{value / 2 ** 20:,.0f} MiB"
        return f"{shown} ({value / base:.1f}x)"

    columns = [(program, figure) for program in ("rule_forward", "rule_backward")
               for figure in ("seconds", "cpu_seconds", "temp")] + [("layer_forward", "temp"),
                                                                    ("layer_backward", "temp")]
    lines = ["T (x of first) | " + " | ".join(f"{program} {figure}" for program, figure in columns)]
    for row in rows:
        lines.append(f"{row['T']} ({row['T'] / first['T']:.0f}x) | " + " | ".join(cell(row, *c) for c in columns))
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--time-heads", type=int, default=8, help="value heads of the timed runs (even)")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    rows = []
    for T in args.lengths:
        rows.append(measure(args.batch, T, args.time_heads))
        print(f"T={T}: {json.dumps(rows[-1])}", flush=True)
    print(f"{jax.devices()[0].device_kind}, {jax.device_count()} device(s); Qwen3-Next's linear layer "
          f"({SPEC.n_key_head} key / {SPEC.n_value_head} value heads of {SPEC.key_dim}, d_model {D_MODEL}), "
          f"batch {args.batch}, chunks of {SPEC.chunk}; memory: XLA's temp bytes (beyond inputs and outputs) "
          f"at that shape; times: one run at {args.time_heads} value heads, {args.time_heads // 2} key heads")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
