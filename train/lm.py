"""`python -m train.lm`: train the decoder-only Transformer, then decode with the KV cache.

  --task copy (default)  [BOS] p_1..p_32 [SEP] p_1..p_32 over 48 symbols, a fresh random
                         pattern every time, only the second copy scored: it can only
                         be solved by attention reading back across SEP. Evaluated by
                         KV-cached greedy decoding on unseen patterns.
  --task text --data F   a character-level LM on any UTF-8 file: train and validation
                         loss, then a sampled continuation (--prompt, --temperature,
                         --top-k, --top-p).

AdamW (0.9, 0.95) with weight decay on matrices only, warm-up then cosine to 10 %,
gradient clipping at 1.0: the reference demo's recipe, as one optax chain.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import Decoder, DecoderConfig, generate, label_smoothed_cross_entropy, warmup_cosine_schedule
from train import common
from train.common import (OneLineParser, TrainState, add_mesh_flags, enable_compilation_cache,
                          initialize_distributed, make_train_step, shard_training, start_run, train_loop)
from train.tasks import COPY_LEN, COPY_SYMBOLS, COPY_VOCAB, IGNORE, CharText, copy_batch, copy_prompts


PROG = "python -m train.lm"


def fail(message: str) -> None:
    common.fail(PROG, message)


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", choices=["copy", "text"], default="copy")
    p.add_argument("--data", type=Path, help="UTF-8 text file for --task text")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping (global norm)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256, help="--task text: characters per training window")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-size", type=int, default=1000, help="--task copy: unseen patterns decoded")
    p.add_argument("--prompt", default="", help="--task text: the continuation's start")
    p.add_argument("--sample-tokens", type=int, default=400, help="--task text: characters sampled")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where config, metrics and checkpoints go (default: runs/lm-<task>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir from its last checkpoint")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype; parameters and optimizer state stay float32")
    add_mesh_flags(p)
    p.add_argument("--checkpoint-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "warmup", "eval_size", "checkpoint_every", "log_every", "seq_len",
                 "sample_tokens", "top_k"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.warmup > args.steps:
        fail(f"--warmup ({args.warmup}) must not exceed --steps ({args.steps})")
    if not args.lr > 0 or not args.weight_decay >= 0 or not args.clip > 0 or not args.temperature >= 0:
        fail("--lr and --clip must be > 0, --weight-decay and --temperature >= 0")
    if args.task == "text" and args.data is None:
        fail("--task text needs --data FILE (a UTF-8 text file)")
    if args.resume and args.run_dir is None:
        fail("--resume needs --run-dir: the run to continue")
    if args.run_dir is None:
        args.run_dir = Path("runs") / f"lm-{args.task}-{datetime.now():%Y%m%d-%H%M%S}"
    return args


def training_length(args, corpus: CharText | None) -> int:
    """Tokens per training sequence: the copy task's [BOS] p [SEP] p less one, or the text window."""
    return args.seq_len if corpus else 2 * COPY_LEN + 1


def model_config(args, corpus: CharText | None) -> DecoderConfig:
    seq_len = training_length(args, corpus)
    max_seq_len = seq_len + 8 if corpus is None else max(seq_len, len(args.prompt) + args.sample_tokens) + 8
    return DecoderConfig(vocab_size=corpus.vocab_size if corpus else COPY_VOCAB, n_layer=args.n_layer,
                         n_head=args.n_head, n_kv_head=args.n_kv_head, d_model=args.d_model, max_seq_len=max_seq_len,
                         dtype=args.dtype)


def recipe(args, model: Decoder, corpus: CharText | None):
    """The reference's training recipe: `(schedule, optimizer, loss_fn, make_batch)`."""
    schedule = warmup_cosine_schedule(args.lr, args.warmup, args.steps)
    optimizer = optax.chain(
        optax.clip_by_global_norm(args.clip),
        # Decay the matrices (embedding included), not the norms' weight vectors.
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=args.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )

    def loss_fn(params, batch, dropout_key):  # (the decoder-only model has no dropout)
        logits, _ = model.apply({"params": params}, batch["tokens"])
        ignore = IGNORE if corpus is None else None
        return label_smoothed_cross_entropy(logits, batch["targets"], 0.0, ignore_id=ignore), {}

    make_batch = (functools.partial(copy_batch, batch_size=args.batch_size) if corpus is None
                  else functools.partial(corpus.batch, batch_size=args.batch_size))
    return schedule, optimizer, loss_fn, make_batch


def main(argv=None) -> int:
    args = parse_args(argv)
    initialize_distributed()
    enable_compilation_cache()
    try:
        corpus = CharText(args.data, args.seq_len) if args.task == "text" else None
        config = model_config(args, corpus)
        prompt_ids = corpus.encode(args.prompt) if corpus else None
    except ValueError as e:
        fail(str(e))

    model = Decoder(config)
    params = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, 1), jnp.int32))["params"]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    vocab, seq_len = config.vocab_size, training_length(args, corpus)
    print(f"task {args.task}: vocab {vocab}, sequences of {seq_len}")
    print(f"model: {config.n_layer} layers x {config.d_model}, {config.n_head} query / {config.n_kv_head} kv heads, "
          f"{n_params:,} params ({n_params - params['embed'].size:,} non-embedding)")
    chance = math.log(COPY_SYMBOLS if corpus is None else vocab)
    print(f"chance loss (uniform) = {chance:.4f}\n")

    # What --resume must match; --steps too, since the cosine's length depends on it.
    model_fields = {k: v for k, v in vars(config).items() if k not in ("dtype", "param_dtype", "cache_dtype")}
    run = {"task": args.task, "data": str(args.data), "config": model_fields,
           **{k: getattr(args, k) for k in ("seed", "steps", "batch_size", "lr", "warmup", "weight_decay", "clip")}}
    schedule, optimizer, loss_fn, make_batch = recipe(args, model, corpus)
    try:  # a mesh that does not fit is refused before the run directory is touched
        state, make_batch, state_sharding = shard_training(TrainState.create(params, optimizer), make_batch, args,
                                                           config, args.batch_size)
        start_run(args.run_dir, run, args.resume)
    except ValueError as e:
        fail(str(e))
    start = time.perf_counter()
    state = train_loop(state, make_train_step(loss_fn, optimizer, state_sharding), make_batch,
                       seed=args.seed, num_steps=args.steps, run_dir=args.run_dir,
                       checkpoint_every=args.checkpoint_every, log_every=args.log_every, lr_schedule=schedule,
                       resume=args.resume)
    train_seconds = time.perf_counter() - start
    params = jax.device_get(state.params)  # gathered from the mesh, if any: the evaluation runs on one device
    last = json.loads((args.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"\ntrained to step {int(state.step)} in {train_seconds:.1f} s (compile included): "
          f"final loss {last['loss']:.4f}")

    eval_key = jax.random.fold_in(jax.random.key(args.seed), 0x5EED)
    results = {"steps": int(state.step), "final_loss": last["loss"], "train_seconds": train_seconds}
    if corpus is None:
        prompts, patterns = copy_prompts(eval_key, args.eval_size)
        out = generate(model, params, prompts, max_new_tokens=COPY_LEN)[:, COPY_LEN + 2:]
        token_acc = float(jnp.mean(out == patterns))
        exact = float(jnp.mean(jnp.all(out == patterns, axis=1)))
        print(f"\nKV-cached greedy decoding on {args.eval_size} unseen patterns:")
        print(f"  token accuracy {token_acc:.2%}   exact match {exact:.2%}   (chance {1 / COPY_SYMBOLS:.1%} a token)")
        print(f"  target  {np.asarray(patterns[0, :12]).tolist()} ...\n  decoded {np.asarray(out[0, :12]).tolist()} ...")
        results.update(token_accuracy=token_acc, exact_match=exact)
    else:
        val = jnp.mean(jnp.stack([loss_fn(params, corpus.batch(k, args.batch_size, "val"), None)[0]
                                  for k in jax.random.split(eval_key, 20)]))
        print(f"\ntrain loss {last['loss']:.4f}   validation loss {float(val):.4f} (ppl {math.exp(float(val)):.2f})")
        prompt = jnp.asarray([prompt_ids or [0]], jnp.int32)
        sample = generate(model, params, prompt, max_new_tokens=args.sample_tokens, key=jax.random.key(args.seed),
                          temperature=args.temperature, top_k=min(args.top_k, vocab), top_p=args.top_p)
        text = corpus.decode(np.asarray(sample[0, 0 if prompt_ids else 1:]))
        print("-" * 60 + "\n" + text + "\n" + "-" * 60)
        results.update(validation_loss=float(val), sample=text)
    (args.run_dir / "eval.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
