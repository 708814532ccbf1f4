"""Wall time of `python -m train.reverse` against PyTorch on the reference demo's workload.

    python -m benchmarks.train_reverse [--reference PATH/vanilla_demo.py] [--out FILE.json]

The baseline, run in the same session: the reference demo's workload in PyTorch's own
`torch.nn.Transformer` (`TORCH_DEMO`: the same model, 3000 steps of batch 64, the Noam
schedule, label smoothing, then greedy decoding of 1000 fresh sequences). Against it,
`python -m train.reverse` with its defaults, first with an empty compilation cache, then
reusing it (as a user's second run would), and on the baseline's own steps
(`REFERENCE_RUN`). Each run is a fresh process, timed from start to exit (imports,
compilation, the training, the evaluation on 1000 + 1000 sequences and the plots
included). With `--reference`, the reference
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


# The reference demo's workload in PyTorch's own Transformer layers, for a baseline in the
# same session: the model (2 + 2 post-norm layers, d_model 64, 4 heads, d_ff 128, dropout
# 0.1, one embedding shared by source, target and output), Adam (0.9, 0.98, 1e-9) on the
# Noam schedule (warmup 400), label smoothing 0.1, Glorot's initialisation, 3000 steps of
# batch 64, then greedy
# decoding of 1000 fresh sequences, exact when every symbol and then EOS come out.
TORCH_DEMO = """
import math, torch, torch.nn as nn
torch.manual_seed(0)
V, PAD, BOS, EOS, D, WIDTH = 19, 0, 1, 2, 64, 10
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(V, D, padding_idx=PAD)
        self.core = nn.Transformer(D, 4, 2, 2, 128, 0.1, batch_first=True)
        pos, i = torch.arange(32)[:, None], torch.arange(0, D, 2)
        angle = pos * torch.exp(i * (-math.log(10000.0) / D))
        self.register_buffer("pe", torch.stack([torch.sin(angle), torch.cos(angle)], -1).reshape(32, D))
        self.dropout = nn.Dropout(0.1)
    def embed(self, x):
        return self.dropout(self.embedding(x) * math.sqrt(D) + self.pe[:x.shape[1]])
    def forward(self, src, tgt):
        causal = self.core.generate_square_subsequent_mask(tgt.shape[1])
        h = self.core(self.embed(src), self.embed(tgt), tgt_mask=causal, tgt_is_causal=True,
                      src_key_padding_mask=src == PAD, memory_key_padding_mask=src == PAD)
        return h @ self.embedding.weight.T
def batch(n):
    length, pos = torch.randint(5, WIDTH + 1, (n,)), torch.arange(WIDTH)[None]
    src = torch.where(pos < length[:, None], torch.randint(3, V, (n, WIDTH)), PAD)
    back = src.gather(1, (length[:, None] - 1 - pos).clamp(0, WIDTH - 1))
    reversed_ = torch.where(pos < length[:, None], back, PAD)
    tgt_out = torch.cat([reversed_, torch.full((n, 1), PAD)], 1)
    tgt_out[torch.arange(n), length] = EOS
    return src, torch.cat([torch.full((n, 1), BOS), reversed_], 1), tgt_out
model = Model()
for p in model.parameters():  # Glorot's uniform draw for every matrix, the embedding included
    if p.dim() > 1:
        nn.init.xavier_uniform_(p)
opt = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
noam = lambda s: D ** -0.5 * min((s + 1) ** -0.5, (s + 1) * 400 ** -1.5)
sched = torch.optim.lr_scheduler.LambdaLR(opt, noam)
loss_fn = nn.CrossEntropyLoss(ignore_index=PAD, label_smoothing=0.1)
model.train()
for step in range(3000):
    src, tgt_in, tgt_out = batch(64)
    loss = loss_fn(model(src, tgt_in).reshape(-1, V), tgt_out.reshape(-1))
    opt.zero_grad(set_to_none=True); loss.backward(); opt.step(); sched.step()
model.eval()
src, _, tgt_out = batch(1000)
out = torch.full((1000, 1), BOS)
with torch.no_grad():
    for _ in range(WIDTH + 1):
        out = torch.cat([out, model(src, out)[:, -1].argmax(-1, keepdim=True)], 1)
exact = ((out[:, 1:] == tgt_out) | (tgt_out == PAD)).all(1).float().mean().item()
print(f"loss {loss.item():.4f} exact {exact:.4f}")
"""


def run_torch() -> dict:
    seconds, out = timed([sys.executable, "-c", TORCH_DEMO])
    match = re.search(r"loss ([0-9.]+) exact ([0-9.]+)", out)
    return {"variant": "PyTorch nn.Transformer, 3000 x 64", "wall_s": seconds, "train_s": None,
            "exact_match": float(match.group(2)), "probe_exact_match": None, "final_loss": float(match.group(1)),
            "map_printed": False}


def run_jaxformer(workdir: Path, label: str, cache_dir: Path, flags: list[str]) -> dict:
    run_dir = workdir / label
    env = dict(os.environ, JAXFORMER_CACHE_DIR=str(cache_dir))
    seconds, out = timed([sys.executable, "-m", "train.reverse", "--run-dir", str(run_dir), *flags], env=env)
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

    rows = [run_torch()]
    with tempfile.TemporaryDirectory() as tmp:
        workdir, cache = Path(tmp), Path(tmp) / "xla-cache"
        rows.append(run_jaxformer(workdir, "defaults, cold compilation cache", cache, []))
        rows.append(run_jaxformer(workdir, "defaults, warm compilation cache", cache, []))
        rows.append(run_jaxformer(workdir, "3000 x 64, warm cache", cache, REFERENCE_RUN))
    if args.reference:
        rows.append(run_reference(args.reference.resolve()))
        rows[-1]["exact_match_1000_with_eos"] = reference_exact_1000(args.reference.resolve())
    baseline = rows[0]["wall_s"]

    print(f"{'variant':<44} {'wall s':>8} {'vs torch':>8} {'train s':>8} {'exact':>8} {'probe':>7} {'loss':>7}")
    for r in rows:
        ratio = f"{r['wall_s'] / baseline:.2f}x"
        train_s = f"{r['train_s']:.1f}" if r["train_s"] is not None else "-"
        exact = f"{r['exact_match']:.2%}" if r["exact_match"] is not None else "-"
        probe = f"{r['probe_exact_match']:.1%}" if r["probe_exact_match"] is not None else "-"
        print(f"{r['variant']:<44} {r['wall_s']:>8.1f} {ratio:>8} {train_s:>8} {exact:>8} {probe:>7} "
              f"{r['final_loss']:>7.4f}")
    if args.reference:
        print(f"reference model on 1000 fresh sequences, every symbol then EOS: "
              f"{rows[-1]['exact_match_1000_with_eos']:.2%}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
