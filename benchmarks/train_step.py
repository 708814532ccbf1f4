"""Training-step throughput of both demos, against the PyTorch reference's own step.

    python -m benchmarks.train_step [--steps 100] [--reference PATH/00-foundations/code] [--out F.json]

Each demo is set up exactly as its CLI sets it up (`train.reverse`: the 2017 model,
Noam-scheduled Adam, label smoothing, dropout, at the reference's batch of 64;
`train.lm`: the copy task, AdamW with warmup-cosine and clipping), then `--steps` updates
are timed one at a time, after the first (which compiles). Batches are made before the
clock starts, so this is the update itself: forward, backward and optimizer. Tokens/s
counts the decoder positions trained per second (reverse: 64 x 11 target tokens per step;
copy: 64 x 65).

GFLOP/s is the step's floating-point operations over its median time, and "% peak" that
rate over this machine's float32 matmul peak, measured in the same run: the best of
several 2048 x 2048 @ 2048 x 2048 products, in jnp and (with `--reference`) in torch;
the peak is the faster of the two. The operations are counted two ways. jaxformer's are
XLA's cost analysis of the compiled update (`.lower(...).compile().cost_analysis()`):
every operation of the forward and backward passes and the optimizer, matrix products
as 2 per multiply-add, element-wise ones as about 1 per element. The reference's are
`torch.utils.flop_counter.FlopCounterMode` over one update: only the matrix products
(`mm`, `addmm`, `bmm`) of the forward and backward passes. The two counts of the same
update differ by what XLA adds for the rest: 19.0 against 19.3 GFLOP for the copy task,
0.70 against 0.77 for the reversal, whose small matrices leave a larger share to the
softmaxes, dropout and Adam.

With `--reference`, the reference's PyTorch modules (`vanilla.py`, `model.py`,
`train.py` in that folder) build the same models and optimizers in this process and
their updates are timed the same way, so the ratio compares like with like. Without it,
the table shows, for orientation, the PyTorch reference demos' whole-run wall times
measured on a 2-core CPU, divided by their step counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.training import TrainState, make_train_step
from train import lm, reverse

# The PyTorch reference demos' whole-run wall times on a 2-core CPU: (seconds, steps).
REFERENCE_WALL = {"reverse": (100.0, 3000), "copy": (160.0, 800)}
PEAK_SIZE = 2048  # the matmul-peak GEMM is [PEAK_SIZE, PEAK_SIZE] @ [PEAK_SIZE, PEAK_SIZE], float32
PEAK_REPEATS = 5  # timed products; the fastest counts


def time_steps(step, n_steps: int) -> tuple[float, list[float]]:
    """`step(i)` returns something to wait on; the first call's time, then each later one's."""
    start = time.perf_counter()
    jax.block_until_ready(step(0))
    first = time.perf_counter() - start
    times = []
    for i in range(1, n_steps + 1):
        start = time.perf_counter()
        jax.block_until_ready(step(i))
        times.append(time.perf_counter() - start)
    return first, times


def matmul_peak(with_torch: bool) -> dict:
    """GFLOP/s of the fastest of `PEAK_REPEATS` float32 2048-square GEMMs, in jnp and in torch."""
    flop = 2 * PEAK_SIZE**3
    a = jax.random.normal(jax.random.key(0), (PEAK_SIZE, PEAK_SIZE), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    _, times = time_steps(lambda _: matmul(a, a), PEAK_REPEATS)
    peak = {"jax_gflops": flop / min(times) / 1e9}
    if with_torch:
        import torch
        t = torch.from_numpy(np.array(a))
        _, times = time_steps(lambda _: torch.mm(t, t), PEAK_REPEATS)
        peak["torch_gflops"] = flop / min(times) / 1e9
    return peak


def jaxformer_reverse(n_steps: int) -> dict:
    # The reference's batch of 64, not the demo's default of 128: the same work a step.
    return time_setup(reverse.build(reverse.Settings(batch_size=64)), n_steps)


def jaxformer_copy(n_steps: int) -> dict:
    return time_setup(lm.build(lm.Settings()), n_steps)


def time_setup(setup, n_steps: int) -> dict:
    """Times `n_steps` updates of a demo's `Setup` after the first."""
    train_step = make_train_step(setup.loss_fn, setup.optimizer)
    keys = jax.random.split(jax.random.key(0), n_steps + 1)
    batches = [setup.make_batch(k) for k in keys]
    state = TrainState.create(setup.params, setup.optimizer)

    def step(i):
        nonlocal state
        state, metrics = train_step(state, batches[i], keys[i])
        return metrics["loss"]

    first, times = time_steps(step, n_steps)
    # XLA's count of the same program, compiled again ahead of time (the live final state
    # gives the shapes; nothing runs).
    cost = train_step.lower(state, batches[0], keys[0]).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict in older JAX
    return timing_row(first, times, setup.tokens_per_step, cost["flops"])


def import_reference(code: Path, file: str, name: str):
    """The reference's `code/file` as module `name` (its own folder on the path while it
    imports its siblings; `name` differs from `file` where that would shadow ours)."""
    spec = importlib.util.spec_from_file_location(name, code / file)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(code))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(code))
    return module


def reference_reverse(code: Path, n_steps: int) -> dict:
    import torch
    vanilla = import_reference(code, "vanilla.py", "vanilla")
    demo = import_reference(code, "vanilla_demo.py", "vanilla_demo")
    torch.manual_seed(0)
    model = vanilla.VanillaTransformer(demo.VOCAB, demo.VOCAB, n=2, d_model=64, d_ff=128, h=4, dropout=0.1,
                                       pad_idx=demo.PAD)
    opt, sched = vanilla.make_optimizer(model, d_model=64, warmup=400)
    model.train()
    batches = [demo.make_batch(64, "cpu")[:3] for _ in range(n_steps + 1)]

    def step(i):
        src, tgt_in, tgt_out = batches[i]
        loss = vanilla.loss_fn(model(src, tgt_in), tgt_out, demo.PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()

    first, times = time_steps(step, n_steps)
    return timing_row(first, times, 64 * 11, torch_flop(step))


def reference_copy(code: Path, n_steps: int) -> dict:
    import torch
    model_py = import_reference(code, "model.py", "model")
    train_py = import_reference(code, "train.py", "reference_train")  # not "train": that is ours
    torch.manual_seed(1337)
    task = train_py.CopyTask()
    cfg = model_py.Config(vocab_size=task.vocab_size, n_layer=4, n_head=4, n_kv_head=2, d_model=128,
                          max_seq_len=task.seq_len + 8)
    model = model_py.Transformer(cfg)
    opt = train_py.make_optimizer(model, 3e-3)
    model.train()
    batches = [task.batch(64, "cpu") for _ in range(n_steps + 1)]

    def step(i):
        for group in opt.param_groups:
            group["lr"] = train_py.lr_at(i, 800, 3e-3)
        _, loss = model(*batches[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    first, times = time_steps(step, n_steps)
    return timing_row(first, times, 64 * (task.seq_len - 1), torch_flop(step))


def torch_flop(step) -> float:
    """The matrix-product FLOPs of one more (untimed) reference update, on the first batch."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        step(0)
    return float(counter.get_total_flops())


def timing_row(first: float, times: list[float], tokens: int, flop: float) -> dict:
    median = statistics.median(times)
    return {"first_step_s": first, "step_ms": 1e3 * median, "spread": (max(times) - min(times)) / median,
            "tokens_per_s": tokens / median, "gflop": flop / 1e9, "gflops": flop / median / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="updates timed per demo (after the first)")
    p.add_argument("--reference", type=Path, help="the reference's code folder (vanilla.py, model.py, train.py)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)

    peak = matmul_peak(with_torch=args.reference is not None)
    best = max(peak.values())
    rows = []
    for demo, measure in (("reverse", jaxformer_reverse), ("copy", jaxformer_copy)):
        rows.append({"demo": demo, "variant": "jaxformer", **measure(args.steps)})
        if args.reference:
            reference = {"reverse": reference_reverse, "copy": reference_copy}[demo]
            rows.append({"demo": demo, "variant": "PyTorch reference", **reference(args.reference.resolve(),
                                                                                    args.steps)})
    for r in rows:
        r["peak_fraction"] = r["gflops"] / best
    print(f"float32 matmul peak ({PEAK_SIZE}^3 GEMM): jnp {peak['jax_gflops']:.1f} GFLOP/s"
          + (f", torch {peak['torch_gflops']:.1f} GFLOP/s" if "torch_gflops" in peak else ""))
    print(f"{'demo':8s} {'variant':18s} {'step ms':>8s} {'spread':>7s} {'tokens/s':>9s} {'vs ref':>7s} "
          f"{'GFLOP':>6s} {'GFLOP/s':>7s} {'% peak':>6s} {'1st step s':>10s}  "
          f"reference demo wall time / steps (PyTorch, 2-core CPU)")
    for r in rows:
        ref = next((x for x in rows if x["demo"] == r["demo"] and x["variant"] != "jaxformer"), None)
        ratio = f"{ref['step_ms'] / r['step_ms']:.2f}x" if ref else "-"
        wall, steps = REFERENCE_WALL[r["demo"]]
        print(f"{r['demo']:8s} {r['variant']:18s} {r['step_ms']:8.2f} {100 * r['spread']:6.0f}% "
              f"{r['tokens_per_s']:9.0f} {ratio:>7s} {r['gflop']:6.2f} {r['gflops']:7.1f} "
              f"{100 * r['peak_fraction']:5.0f}% {r['first_step_s']:10.2f}  {1e3 * wall / steps:.0f} ms")
    print("vs ref: the reference's step time over this row's (above 1 is faster than the reference)")
    print("GFLOP: jaxformer XLA's cost analysis (all operations), PyTorch FlopCounterMode (matrix products); "
          "% peak: GFLOP/s over the faster matmul peak")
    if args.out:
        args.out.write_text(json.dumps({"matmul_peak": {"size": PEAK_SIZE, **peak}, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
