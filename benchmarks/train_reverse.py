"""Wall time of `python -m train.reverse` on the PyTorch reference's workload, against it.

    python -m benchmarks.train_reverse [--reference PATH/vanilla_demo.py] [--out FILE.json]

Both train the same model for the reference's 3000 steps of batch 64 (`REFERENCE_RUN`;
the demo's own default trains 2500 steps of batch 128). Each run is a fresh process,
timed from start to exit (imports, compilation, the training, the evaluation on
1000 + 1000 sequences and the plots included). The first jaxformer run starts with an
empty compilation cache (`--cold`, the default) and the second reuses it, as a user's
second run would. With `--reference`, the reference
implementation's `vanilla_demo.py` (PyTorch, same model, same steps) runs in the same
session on the same machine, and the table reports the ratio. The reference checks only
64 sequences, so its model is also trained once more, through its own modules, and
decoded on 1000 fresh sequences with jaxformer's criterion (every symbol, then EOS).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str], cwd=None, env=None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds, done.stdout


# What vanilla_demo.py trains: the same recipe, 3000 steps of batch 64.
REFERENCE_RUN = ["--steps", "3000", "--batch-size", "64"]


def run_jaxformer(workdir: Path, label: str, cache_dir: Path) -> dict:
    run_dir = workdir / label
    env = dict(os.environ, JAXFORMER_CACHE_DIR=str(cache_dir))
    seconds, out = timed([sys.executable, "-m", "train.reverse", "--run-dir", str(run_dir), *REFERENCE_RUN], env=env)
    results = json.loads((run_dir / "eval.json").read_text())
    anti_diagonal = "<- source (encoder)" in out
    return {"variant": f"jaxformer ({label})", "wall_s": seconds, "train_s": results["train_seconds"],
            "exact_match": results["exact_match"], "probe_exact_match": results["probe_exact_match"],
            "final_loss": results["final_loss"], "map_printed": anti_diagonal}


def run_reference(script: Path) -> dict:
    seconds, out = timed([sys.executable, script.name], cwd=script.parent)
    match = re.search(r"greedy decode: (\d+)/(\d+)", out)
    losses = re.findall(r"loss ([0-9.]+)", out)
    return {"variant": "PyTorch reference (vanilla_demo.py)", "wall_s": seconds, "train_s": None,
            "exact_match": int(match.group(1)) / int(match.group(2)) if match else None,
            "probe_exact_match": None, "final_loss": float(losses[-1]) if losses else None,
            "map_printed": "<- source (encoder)" in out}


# Run in the reference's folder: trains exactly as its vanilla_demo.main() does, then
# decodes 1000 fresh sequences with its own greedy_decode.
REFERENCE_EVAL = """
import torch
from vanilla import VanillaTransformer, loss_fn, make_optimizer
from vanilla_demo import make_batch, MAX_LEN, BOS, PAD, VOCAB
torch.manual_seed(0)
model = VanillaTransformer(VOCAB, VOCAB, n=2, d_model=64, d_ff=128, h=4, dropout=0.1, pad_idx=PAD)
opt, sched = make_optimizer(model, d_model=64, warmup=400)
model.train()
for step in range(1, 3001):
    src, tgt_in, tgt_out, _ = make_batch(64, "cpu")
    loss = loss_fn(model(src, tgt_in), tgt_out, PAD)
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step(); sched.step()
src, _, tgt_out, lens = make_batch(1000, "cpu")
out = model.greedy_decode(src, MAX_LEN + 2, BOS)
exact = sum(out[b, 1:l + 2].tolist() == tgt_out[b, :l + 1].tolist() for b, l in enumerate(lens.tolist()))
print(f"exact {exact / 1000}")
"""


def reference_exact_1000(script: Path) -> float:
    _, out = timed([sys.executable, "-c", REFERENCE_EVAL], cwd=script.parent)
    return float(re.search(r"exact ([0-9.]+)", out).group(1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, help="path to the reference's vanilla_demo.py (needs torch)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir, cache = Path(tmp), Path(tmp) / "xla-cache"
        rows.append(run_jaxformer(workdir, "cold compilation cache", cache))
        rows.append(run_jaxformer(workdir, "warm compilation cache", cache))
    if args.reference:
        rows.append(run_reference(args.reference.resolve()))
        rows[-1]["exact_match_1000_with_eos"] = reference_exact_1000(args.reference.resolve())
    baseline = rows[-1]["wall_s"] if args.reference else None

    print(f"{'variant':<40} {'wall s':>8} {'vs ref':>7} {'train s':>8} {'exact':>8} {'probe':>7} {'loss':>7}")
    for r in rows:
        ratio = f"{r['wall_s'] / baseline:.2f}x" if baseline else "-"
        train_s = f"{r['train_s']:.1f}" if r["train_s"] is not None else "-"
        exact = f"{r['exact_match']:.2%}" if r["exact_match"] is not None else "-"
        probe = f"{r['probe_exact_match']:.1%}" if r["probe_exact_match"] is not None else "-"
        print(f"{r['variant']:<40} {r['wall_s']:>8.1f} {ratio:>7} {train_s:>8} {exact:>8} {probe:>7} "
              f"{r['final_loss']:>7.4f}")
    if args.reference:
        print(f"reference model on 1000 fresh sequences, every symbol then EOS: "
              f"{rows[-1]['exact_match_1000_with_eos']:.2%}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
