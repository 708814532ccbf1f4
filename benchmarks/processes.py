"""Time of a training step of `python -m train.lm` on 2 processes of 4 CPU devices each
(JAX's multi-controller runtime, joined over loopback), against 1 process of 8 devices, at
the same mesh and global batch, in one session.

    python -m benchmarks.processes [--steps 60] [--log-every 10] [--batch-size 64] [--out FILE.json]

Each layout runs the same command (`jaxformer.runtime.local_environments` names the
processes). A step's time is the median, over the metrics lines after the first (whose
interval includes compilation), of `1 / steps_per_sec`; the final losses are printed beside
it, as the two layouts train the same model on the same batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxformer.runtime import local_environments

LAYOUTS = ((1, 8), (2, 4))  # (processes, devices each)
MESHES = (("DP", ["--mesh", "data=8"]), ("FSDP x TP", ["--mesh", "data=4,model=2", "--fsdp"]))


def run_layout(processes: int, devices: int, args: list[str], run_dir: Path) -> dict:
    """One run of `train.lm` with `args` over `processes` x `devices`: its step time and last loss."""
    logs = [run_dir.with_name(f"{run_dir.name}-stderr-{i}.txt") for i in range(processes)]
    children = [subprocess.Popen([sys.executable, "-m", "train.lm", *args, "--run-dir", str(run_dir)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=log.open("w"))
                for env, log in zip(local_environments(processes, devices), logs)]
    for child, log in zip(children, logs):
        if child.wait(timeout=1800):
            raise SystemExit(f"train.lm over {processes} x {devices} failed ({child.returncode}): "
                             f"{log.read_text()[-2000:]}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = statistics.median(1 / line["steps_per_sec"] for line in lines[1:])
    return {"processes": processes, "devices_each": devices, "step_s": seconds, "final_loss": lines[-1]["loss"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="updates per run")
    p.add_argument("--log-every", type=int, default=10, help="updates per metrics line (a timed interval)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch rows")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.steps < 3 * args.log_every:
        p.error("--steps must be at least 3 x --log-every: two timed intervals after the one that compiles")
    common = ["--steps", str(args.steps), "--warmup", "2", "--batch-size", str(args.batch_size), "--log-every",
              str(args.log_every), "--checkpoint-every", str(args.steps), "--eval-size", "16"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mesh_name, mesh in MESHES:
            for i, (processes, devices) in enumerate(LAYOUTS):
                row = run_layout(processes, devices, [*common, *mesh], Path(tmp) / f"{mesh_name}-{i}")
                rows.append({"mesh": mesh_name, **row})
    print(f"{'mesh':<10} {'layout':<22} {'s / step':>9} {'vs 1 process':>13} {'final loss':>11}")
    for row in rows:
        baseline = next(r for r in rows if r["mesh"] == row["mesh"] and r["processes"] == 1)["step_s"]
        row["vs_one_process"] = row["step_s"] / baseline
        layout = f"{row['processes']} process{'es' if row['processes'] > 1 else ''} x {row['devices_each']} devices"
        print(f"{row['mesh']:<10} {layout:<22} {row['step_s']:>9.4f} {row['vs_one_process']:>12.2f}x "
              f"{row['final_loss']:>11.6f}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
