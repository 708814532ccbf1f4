"""`python -m train.reverse`: train the 2017 Transformer to reverse sequences, and look inside.

1. a shape trace of one forward pass (ids, masks, embeddings, heads, memory,
   cross-attention weights, logits);
2. training with the paper's recipe: Adam (0.9, 0.98, 1e-9), the Noam schedule,
   label smoothing 0.1, dropout 0.1; one jitted step, checkpoints, `--resume`;
3. evaluation by KV-cached greedy decoding on fresh sequences: exact match overall and
   per length, and on longer sequences than any seen in training (a probe of
   generalisation, reported whatever it shows);
4. the cross-attention map of the last decoder layer: decoder step k should read
   source position L - 1 - k, an anti-diagonal.

Defaults reproduce the reference demo (REFERENCE.md, "The reversal demo").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from datetime import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import VanillaConfig, VanillaTransformer, generate
from jaxformer.losses import label_smoothed_cross_entropy
from jaxformer.schedules import noam_schedule
from jaxformer.viz import ascii_attention, save_attention_grid
from train import common
from train.common import (OneLineParser, TrainState, add_mesh_flags, enable_compilation_cache,
                          initialize_distributed, make_train_step, shard_training, start_run, train_loop)
from train.tasks import BOS, EOS, PAD, REVERSE_VOCAB, reverse_batch

MIN_LEN, MAX_LEN = 5, 10
PROBE_LENGTHS = (11, 12, 13, 14, 15, 16)  # never seen in training
MAP_LENGTH = 8


PROG = "python -m train.reverse"


def fail(message: str) -> None:
    common.fail(PROG, message)


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=3000, help="training steps (updates)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seeds init, data, dropout and evaluation")
    p.add_argument("--n-layer", type=int, default=2, help="encoder layers (and as many decoder layers)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--norm-first", action="store_true", help="pre-norm instead of the paper's post-norm")
    p.add_argument("--warmup", type=int, default=400, help="Noam warmup steps")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--eval-size", type=int, default=1000, help="fresh sequences decoded for the evaluation")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where config, metrics, checkpoints and plots go (default: runs/reverse-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype; parameters and optimizer state stay float32")
    add_mesh_flags(p)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=100)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "warmup", "eval_size", "checkpoint_every", "log_every"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if not 0 <= args.label_smoothing < 1:
        fail(f"--label-smoothing must be in [0, 1) (got {args.label_smoothing})")
    if args.resume and args.run_dir is None:
        fail("--resume needs --run-dir: the run to continue")
    if args.run_dir is None:
        args.run_dir = Path("runs") / f"reverse-{datetime.now():%Y%m%d-%H%M%S}"
    return args


def model_config(args) -> VanillaConfig:
    try:
        return VanillaConfig(src_vocab_size=REVERSE_VOCAB, tgt_vocab_size=REVERSE_VOCAB, n_layer=args.n_layer,
                             d_model=args.d_model, d_ff=args.d_ff, n_head=args.n_head, dropout=args.dropout,
                             pad_id=PAD, max_seq_len=max(PROBE_LENGTHS) + 2, norm_first=args.norm_first,
                             dtype=args.dtype)
    except ValueError as e:
        fail(str(e))


def run_config(args, config: VanillaConfig) -> dict:
    """What must match for `--resume` to continue the same run (not: steps, eval, logging)."""
    model = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("dtype", "param_dtype", "cache_dtype")}
    return {"model": model, "seed": args.seed, "batch_size": args.batch_size, "warmup": args.warmup,
            "label_smoothing": args.label_smoothing}


def shape_trace(model: VanillaTransformer, params) -> None:
    """One forward pass on two full-length examples, printing what each stage produces.

    Shapes only: `jax.eval_shape` traces the model abstractly, nothing is computed.
    """
    c = model.config
    batch = reverse_batch(jax.random.key(0), 2, MAX_LEN, MAX_LEN)
    src, tgt_in = batch["src"], batch["tgt_in"]
    variables = {"params": params}
    B, S, T, h = src.shape[0], src.shape[1], tgt_in.shape[1], c.n_head

    def shape_of(*args, **kwargs):
        return jax.eval_shape(functools.partial(model.apply, **kwargs), variables, *args)

    src_embed = shape_of(method=lambda m: m.src_embed)
    x = shape_of(src_embed, src, 0, method="embed")
    memory = shape_of(src, method="encode")
    logits, inter = shape_of(src, tgt_in, mutable=["intermediates"])
    inter = inter["intermediates"]
    self_w = inter["encoder_layers_0"]["self_attn"]["attention_weights"][0]
    cross_w = inter[f"decoder_layers_{c.n_layer - 1}"]["cross_attn"]["attention_weights"][0]
    rows = [
        ("src token ids", src.shape, ""),
        ("src mask (True = may read)", shape_of(src, method="source_mask").shape,
         f"-> broadcasts to (B, {h}, S, S)"),
        ("tgt mask (causal AND not pad)", (B, T, T), ""),
        ("embed * sqrt(d) + positional encoding", x.shape, ""),
        ("Q/K/V after split into heads", (B, S, h, c.head_dim), f"d_k = d/h = {c.head_dim}"),
        ("encoder self-attention weights", self_w.shape, "<- rows sum to 1"),
        ("encoder output ('memory')", memory.shape, ""),
        ("cross-attn: Q from decoder, K/V from memory", (B, T, c.d_model), f"vs memory {tuple(memory.shape)}"),
        ("cross-attention weights", cross_w.shape, "<- NOT square (T x S)"),
        ("logits", logits.shape, ""),
    ]
    print("shape trace (B=batch, S=src len, T=tgt len, d=d_model, h=heads)\n")
    for name, shape, note in rows:
        print(f"  {name:<44} {str(tuple(shape)):<18} {note}")


def evaluate(model, params, key, n: int, lengths: tuple[int, ...], width: int) -> dict:
    """Exact-match rate of cached greedy decoding on `n` fresh sequences per call.

    A row counts only if every decoded token is right: the reversed symbols, then EOS
    (then padding).
    """
    batch = reverse_batch(key, n, min(lengths), max(lengths), width=width)
    out = generate(model, params, batch["src"], max_new_tokens=width + 1, bos_id=BOS, eos_id=EOS)
    exact = np.asarray(jnp.all(out[:, 1:] == batch["tgt_out"], axis=1))  # [n]
    length = np.asarray(batch["length"])
    per_length = {int(L): (float(exact[length == L].mean()), int((length == L).sum())) for L in np.unique(length)}
    return {"exact_match": float(exact.mean()), "n": n, "per_length": per_length,
            "example": (np.asarray(batch["src"][0, :length[0]]).tolist(), np.asarray(out[0, 1:length[0] + 1]).tolist())}


def cross_attention_map(model, params, run_dir: Path) -> str:
    """Teacher-forced cross-attention of one length-8 example: ASCII (last layer, heads
    averaged) and a PNG of every layer and head."""
    c = model.config
    batch = reverse_batch(jax.random.key(1), 1, MAP_LENGTH, MAP_LENGTH, width=MAX_LEN)
    forward = jax.jit(functools.partial(model.apply, mutable=["intermediates"]))
    _, inter = forward({"params": params}, batch["src"], batch["tgt_in"])
    weights = np.stack([np.asarray(inter["intermediates"][f"decoder_layers_{i}"]["cross_attn"]["attention_weights"][0][0])
                        for i in range(c.n_layer)])  # [n_layer, n_head, T, S]
    weights = weights[:, :, :MAP_LENGTH + 1, :MAP_LENGTH]  # rows BOS + 8 steps, the 8 real source positions
    rows = ["BOS"] + [str(i) for i in range(1, MAP_LENGTH + 1)]
    cols = [str(i) for i in range(1, MAP_LENGTH + 1)]
    save_attention_grid(weights, run_dir / "cross_attention.png", rows, cols,
                        title="cross-attention, every layer and head")
    return ascii_attention(weights[-1].mean(0), rows, cols)


def main(argv=None) -> int:
    args = parse_args(argv)
    initialize_distributed()
    enable_compilation_cache()
    # Dropout draws about a million random numbers a step. The classic threefry layout
    # gets two 32-bit numbers out of each hash block where the partitionable one (JAX's
    # default, made for sharded arrays) gets one: on a CPU this halves their cost.
    with jax.threefry_partitionable(False):
        return run(args)


def init_params(args, model: VanillaTransformer):
    init_batch = reverse_batch(jax.random.key(args.seed), 1)
    return jax.jit(model.init)(jax.random.key(args.seed), init_batch["src"], init_batch["tgt_in"])["params"]


def recipe(args, model: VanillaTransformer):
    """The paper's training recipe: `(schedule, optimizer, loss_fn, make_batch)`."""
    schedule = noam_schedule(model.config.d_model, args.warmup)
    # The paper's Adam: beta2 0.98 and eps 1e-9. The schedule *is* the learning rate.
    optimizer = optax.adam(learning_rate=schedule, b1=0.9, b2=0.98, eps=1e-9)

    def loss_fn(params, batch, dropout_key):
        logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=False,
                             rngs={"dropout": dropout_key})
        return label_smoothed_cross_entropy(logits, batch["tgt_out"], args.label_smoothing, ignore_id=PAD), {}

    make_batch = functools.partial(reverse_batch, batch_size=args.batch_size, min_len=MIN_LEN, max_len=MAX_LEN)
    return schedule, optimizer, loss_fn, make_batch


def run(args) -> int:
    config = model_config(args)
    model = VanillaTransformer(config)
    params = init_params(args, model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print(f"params: {n_params:,}   (the paper's base model: 65M)\n")
    shape_trace(model, params)

    schedule, optimizer, loss_fn, make_batch = recipe(args, model)
    try:  # a mesh that does not fit is refused before the run directory is touched
        state, make_batch, state_sharding = shard_training(TrainState.create(params, optimizer), make_batch, args,
                                                           config, args.batch_size)
        start_run(args.run_dir, run_config(args, config), args.resume)
    except ValueError as e:
        fail(str(e))
    print(f"\n{'=' * 72}\ntraining on 'reverse the sequence': {args.steps} steps, batch {args.batch_size}, "
          f"run dir {args.run_dir}\n")
    start = time.perf_counter()
    state = train_loop(state, make_train_step(loss_fn, optimizer, state_sharding),
                       make_batch, seed=args.seed, num_steps=args.steps, run_dir=args.run_dir,
                       checkpoint_every=args.checkpoint_every, log_every=args.log_every,
                       lr_schedule=schedule, resume=args.resume)
    train_seconds = time.perf_counter() - start
    params = jax.device_get(state.params)  # gathered from the mesh, if any: the evaluation runs on one device
    last = json.loads((args.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"\ntrained to step {int(state.step)} in {train_seconds:.1f} s (compile included): "
          f"final loss {last['loss']:.4f}, lr {last['lr']:.2e}")

    eval_key, probe_key = jax.random.split(jax.random.fold_in(jax.random.key(args.seed), 0x5EED))
    start = time.perf_counter()
    seen = evaluate(model, params, eval_key, args.eval_size, tuple(range(MIN_LEN, MAX_LEN + 1)), MAX_LEN)
    probe = evaluate(model, params, probe_key, args.eval_size, PROBE_LENGTHS, max(PROBE_LENGTHS))
    eval_seconds = time.perf_counter() - start
    print(f"\ncached greedy decoding, {args.eval_size} fresh sequences of lengths {MIN_LEN}-{MAX_LEN} "
          f"(exact = every reversed symbol, then EOS):")
    print(f"  exact match {seen['exact_match']:.2%}")
    print("  per length  " + "  ".join(f"{L}: {r:.1%} (n={n})" for L, (r, n) in seen["per_length"].items()))
    src, decoded = seen["example"]
    print(f"  src     {src}\n  decoded {decoded}")
    print(f"\ngeneralisation probe, {args.eval_size} sequences of unseen lengths "
          f"{PROBE_LENGTHS[0]}-{PROBE_LENGTHS[-1]}:")
    print(f"  exact match {probe['exact_match']:.2%}")
    print("  per length  " + "  ".join(f"{L}: {r:.1%}" for L, (r, _) in probe["per_length"].items()))
    print(f"  (decoding took {eval_seconds:.1f} s for both sets, compile included)")

    print(f"\ncross-attention, last decoder layer (heads averaged), one length-{MAP_LENGTH} example, teacher-forced")
    print(cross_attention_map(model, params, args.run_dir))
    print(f"\n  decoder step k should be reading source position {MAP_LENGTH + 1}-k -> anti-diagonal")
    print(f"  every layer and head: {args.run_dir / 'cross_attention.png'}")

    results = {"steps": int(state.step), "final_loss": last["loss"], "train_seconds": train_seconds,
               "exact_match": seen["exact_match"], "per_length": seen["per_length"],
               "probe_exact_match": probe["exact_match"], "probe_per_length": probe["per_length"]}
    (args.run_dir / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
