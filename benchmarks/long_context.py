"""A training step's memory against its length, dense attention against attention in blocks.

    python -m benchmarks.long_context [--lengths 1024 2048 ... 32768] [--time-up-to 4096] [--out F.json]

For each length T, one AdamW update of a 1-layer, 8-head decoder (d_model 512, batch 1, the
library's `make_train_step` and `chunked_cross_entropy`, as `train.lm` builds them) is
lowered and compiled for the default device from shapes alone, and XLA's temporary bytes
(`compiled.memory_analysis().temp_size_in_bytes`: what the step allocates beyond its inputs
and outputs) are read, with `attention_impl="dense"` (every score `[8, T, T]` at once) and
`"blocks"` (the online softmax over key blocks). Nothing is allocated to compile, so the dense
step's bytes are reported at lengths where it could never run. Up to `--time-up-to`, both
steps also run (3 updates after the compiling one; the median), and the table gives the
time of blocks over dense in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from jaxformer import Decoder, DecoderConfig, chunked_cross_entropy
from jaxformer.training import TrainState, make_train_step

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


def config(attention_impl: str, T: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=256, n_layer=1, n_head=8, n_kv_head=8, d_model=512, max_seq_len=T,
                         attention_impl=attention_impl)


def train_step(attention_impl: str, T: int):
    """`(step, state, batch)`: the jitted update and its inputs' shapes."""
    model = Decoder(config(attention_impl, T))

    def loss_fn(params, batch, dropout_key):
        hidden, _ = model.apply({"params": params}, batch["inputs"], hidden=True)
        return chunked_cross_entropy(hidden, batch["targets"], model.output_head(params)), {}

    optimizer = optax.adamw(1e-3)
    state = jax.eval_shape(lambda: TrainState.create(model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))[
        "params"], optimizer))
    tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
    return make_train_step(loss_fn, optimizer), state, {"inputs": tokens, "targets": tokens}


def temp_bytes(attention_impl: str, T: int) -> int:
    step, state, batch = train_step(attention_impl, T)
    compiled = step.lower(state, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def step_seconds(attention_impl: str, T: int, repeats: int = 3) -> float:
    """The median time of `repeats` updates, after the one that compiles."""
    step, state_shape, batch_shape = train_step(attention_impl, T)
    model = Decoder(config(attention_impl, T))
    state = TrainState.create(model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"],
                              optax.adamw(1e-3))
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, 256)
    batch = {"inputs": tokens, "targets": tokens}
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch, jax.random.key(i))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--time-up-to", type=int, default=4096, help="run and time the steps up to this length")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"{'T':>7} {'dense MiB':>11} {'blocks MiB':>11} {'dense/blocks':>13} {'time blocks/dense':>18}")
    rows = []
    for T in args.lengths:
        dense, blocks = temp_bytes("dense", T), temp_bytes("blocks", T)
        row = {"T": T, "dense_temp_bytes": dense, "blocks_temp_bytes": blocks}
        ratio = ""
        if T <= args.time_up_to:
            row["dense_seconds"], row["blocks_seconds"] = step_seconds("dense", T), step_seconds("blocks", T)
            ratio = f"{row['blocks_seconds'] / row['dense_seconds']:.2f}x"
        rows.append(row)
        print(f"{T:>7} {dense / 2**20:>11,.0f} {blocks / 2**20:>11,.0f} {dense / blocks:>12.1f}x {ratio:>18}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device.device_kind, "backend": jax.default_backend(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
