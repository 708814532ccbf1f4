"""Wall time of `python -m train.lm` (the copy task) with its defaults, against the PyTorch reference.

    python -m benchmarks.train_lm [--reference PATH/train.py] [--out FILE.json]

Each run is a fresh process timed from start to exit: imports, compilation, 800 training
steps and the evaluation (jaxformer: 1000 unseen patterns; the reference: 32). The first
jaxformer run starts with an empty compilation cache, the second reuses it. With
`--reference`, the reference's `train.py` (PyTorch, the same model and recipe) runs in the
same session on the same machine, and the table reports the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from benchmarks.train_reverse import timed


def run_jaxformer(workdir: Path, label: str, cache_dir: Path) -> dict:
    run_dir = workdir / label
    env = dict(os.environ, JAXFORMER_CACHE_DIR=str(cache_dir))
    seconds, _ = timed([sys.executable, "-m", "train.lm", "--run-dir", str(run_dir)], env=env)
    results = json.loads((run_dir / "eval.json").read_text())
    return {"variant": f"jaxformer ({label})", "wall_s": seconds, "train_s": results["train_seconds"],
            "exact_match": results["exact_match"], "final_loss": results["final_loss"]}


def run_reference(script: Path) -> dict:
    seconds, out = timed([sys.executable, script.name], cwd=script.parent)
    exact = re.search(r"sequence accuracy\s+([0-9.]+)%", out)
    losses = re.findall(r"loss\s+([0-9.]+)", out)
    return {"variant": "PyTorch reference (train.py)", "wall_s": seconds, "train_s": None,
            "exact_match": float(exact.group(1)) / 100 if exact else None,
            "final_loss": float(losses[-1]) if losses else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, help="path to the reference's train.py (needs torch)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_jaxformer(Path(tmp), label, Path(tmp) / "xla-cache")
                for label in ("cold compilation cache", "warm compilation cache")]
    if args.reference:
        rows.append(run_reference(args.reference.resolve()))
    baseline = rows[-1]["wall_s"] if args.reference else None
    print(f"{'variant':<40} {'wall s':>8} {'vs ref':>7} {'train s':>8} {'exact':>8} {'loss':>8}")
    for r in rows:
        ratio = f"{r['wall_s'] / baseline:.2f}x" if baseline else "-"
        train_s = f"{r['train_s']:.1f}" if r["train_s"] is not None else "-"
        exact = f"{r['exact_match']:.2%}" if r["exact_match"] is not None else "-"
        loss = f"{r['final_loss']:.4f}" if r["final_loss"] is not None else "-"
        print(f"{r['variant']:<40} {r['wall_s']:>8.1f} {ratio:>7} {train_s:>8} {exact:>8} {loss:>8}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
