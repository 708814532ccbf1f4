"""Compile time against depth: one block per layer (unrolled) against one scanned block.

    python -m benchmarks.compile_depth [--layers 4 8 16 32] [--pattern gemma2] [--out F.json] [--plot DIR]

For each depth and form, a fresh decoder (d_model 128, 4 heads, 2 kv heads, vocab 256)
runs `generate` on a 16-token prompt for 32 new tokens, greedy, batch 1 (the first call:
trace, lower, compile and run), then again (the program is cached: run only). The unrolled
program holds `n_layer` copies of the block, so its compile time grows with depth; the
scanned one holds one block in a loop. Each form also times one training step (forward,
backward and AdamW on a batch of 8 x 64 tokens): its first call and a later one.

Compile seconds are JAX's own: the sum of its trace, lower and XLA compile events
(`jax.monitoring`). Both forms decode the same weights and must give the same tokens.

`--pattern gemma2` gives the layers Gemma 2's parts and its pattern: sliding (window 8)
and full layers in turn, soft-capped scores and logits, post-sublayer norms, GeGLU, so
that the scanned body holds both kinds of layer and both kinds of cache (rings and full
slots); `gemma3` slides five layers of every six, with q/k norms and a local RoPE base.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import Decoder, DecoderConfig, generate
from jaxformer.convert import with_scan_layers
from jaxformer.training import TrainState, make_train_step

COMPILE_EVENTS = ("/jax/core/compile/tracing_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileClock:
    """Seconds JAX spends tracing, lowering and compiling while it is active."""

    def __init__(self):
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            self.seconds += duration

    def measure(self, fn):
        """`(compile seconds, wall seconds, result)` of `fn()`."""
        before, start = self.seconds, time.perf_counter()
        result = jax.block_until_ready(fn())
        return self.seconds - before, time.perf_counter() - start, result


def measure(config: DecoderConfig, params, clock: CompileClock, prompt: np.ndarray, new: int) -> dict:
    """First and second `generate` call and train step of one model."""
    model = Decoder(config)
    jax.clear_caches()  # nothing compiled before counts
    compile_s, first_s, tokens = clock.measure(lambda: generate(model, params, prompt, max_new_tokens=new))
    _, again_s, _ = clock.measure(lambda: generate(model, params, prompt, max_new_tokens=new))

    def loss_fn(p, batch, key):
        logits, _ = model.apply({"params": p}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean(), {}

    optimizer = optax.adamw(1e-3)
    step = make_train_step(loss_fn, optimizer)
    state = TrainState.create(params, optimizer)
    batch = jax.random.randint(jax.random.key(1), (8, 65), 0, config.vocab_size)
    key = jax.random.key(2)
    train_compile_s, train_first_s, (state, _) = clock.measure(lambda: step(state, batch, key))
    _, train_again_s, _ = clock.measure(lambda: step(state, batch, key))
    return {"generate_compile_s": compile_s, "generate_first_s": first_s, "generate_run_s": again_s,
            "train_compile_s": train_compile_s, "train_first_s": train_first_s, "train_step_s": train_again_s,
            "tokens": np.asarray(tokens)}


def plot(rows: list[dict], folder: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(folder, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "generate_compile_s", "generate (16-token prompt, 32 new)"),
                           (axes[1], "train_compile_s", "train step (8 x 64 tokens)")):
        for form, marker in (("unrolled", "o-"), ("scanned", "s-")):
            mine = [r for r in rows if r["form"] == form]
            ax.plot([r["n_layer"] for r in mine], [r[key] for r in mine], marker, label=form)
        ax.set_xlabel("layers")
        ax.set_ylabel("compile seconds (trace + lower + XLA)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["n_layer"] for r in rows}), [str(n) for n in sorted({r["n_layer"] for r in rows})])
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"compile time against depth, d_model 128, {os.cpu_count()} CPU cores")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "compile_depth.png"), dpi=120)


GEMMA = dict(norm_plus_one=True, mlp_activation="gelu_tanh", embed_scale=True, post_norms=True, sliding_window=8)
PATTERNS = {  # n_layer -> the DecoderConfig fields of each pattern
    "plain": lambda n_layer: {},
    "gemma2": lambda n_layer: dict(GEMMA, attn_logit_softcap=50.0, final_logit_softcap=30.0,
                                   layer_types=tuple("full" if i % 2 else "sliding" for i in range(n_layer))),
    "gemma3": lambda n_layer: dict(GEMMA, qk_norm=True, local_rope_theta=10000.0, rope_theta=1e6,
                                   layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding"
                                                     for i in range(n_layer))),
}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--new", type=int, default=32, help="new tokens per generate call")
    p.add_argument("--pattern", choices=sorted(PATTERNS), default="plain", help="the layers' parts and types")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--plot", metavar="DIR", help="write compile_depth.png there")
    args = p.parse_args(argv)

    clock = CompileClock()
    prompt = np.random.RandomState(0).randint(0, 256, (1, 16))
    rows = []
    header = (f"{'layers':>6s} {'form':9s} {'generate compile s':>18s} {'first call s':>12s} {'run ms':>8s} "
              f"{'train compile s':>15s} {'step ms':>8s}  same tokens")
    print(header)
    for n_layer in args.layers:
        config = DecoderConfig(vocab_size=256, n_layer=n_layer, n_head=4, n_kv_head=2, d_model=args.d_model,
                               max_seq_len=128, **PATTERNS[args.pattern](n_layer))
        params = Decoder(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
        forms = {"unrolled": (config, params), "scanned": with_scan_layers(config, params, True)}
        results = {form: measure(c, p_, clock, prompt, args.new) for form, (c, p_) in forms.items()}
        same = bool(np.array_equal(results["unrolled"]["tokens"], results["scanned"]["tokens"]))
        for form, r in results.items():
            r.pop("tokens")
            rows.append({"n_layer": n_layer, "form": form, **r, "same_tokens": same})
            print(f"{n_layer:6d} {form:9s} {r['generate_compile_s']:18.2f} {r['generate_first_s']:12.2f} "
                  f"{1e3 * r['generate_run_s']:8.1f} {r['train_compile_s']:15.2f} {1e3 * r['train_step_s']:8.1f}  "
                  f"{same}", flush=True)
    for form in ("unrolled", "scanned"):
        mine = {r["n_layer"]: r for r in rows if r["form"] == form}
        low, high = min(mine), max(mine)
        print(f"{form}: generate compile at {high} layers / at {low} layers = "
              f"{mine[high]['generate_compile_s'] / mine[low]['generate_compile_s']:.2f}x; train step compile "
              f"{mine[high]['train_compile_s'] / mine[low]['train_compile_s']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
