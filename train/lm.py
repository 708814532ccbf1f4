"""`python -m train.lm`: train the decoder-only Transformer, then decode with the KV cache.

  --task copy (default)  [BOS] p_1..p_32 [SEP] p_1..p_32 over 48 symbols, a fresh random
                         pattern every time, only the second copy scored: it can only
                         be solved by attention reading back across SEP. Evaluated by
                         KV-cached greedy decoding on unseen patterns.
  --task text --data F   a character-level LM on any UTF-8 file: train and validation
                         loss, then a sampled continuation (--prompt, --temperature,
                         --top-k, --top-p).

AdamW (0.9, 0.95) with weight decay on matrices only, warm-up then cosine to 10 %,
gradient clipping at 1.0, as one optax chain.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import Decoder, DecoderConfig, generate, label_smoothed_cross_entropy, warmup_cosine_schedule
from jaxformer.decoding.sampling import check_temperature, check_top_k, check_top_p
from train import cli
from train.tasks import COPY_LEN, COPY_SYMBOLS, COPY_VOCAB, IGNORE, CharText, copy_batch, copy_prompts

PROG = "python -m train.lm"
TASKS = ("copy", "text")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The decoder-only demo's recipe; the defaults are the command line's.

    Attributes:
      task: "copy" (the synthetic copy task) or "text" (a character-level LM on `data`).
      data: the UTF-8 text file of the text task.
      steps: training steps (updates); the cosine decays over all of them.
      batch_size: sequences per update.
      lr: peak learning rate.
      warmup: linear warm-up steps, at most `steps`.
      weight_decay: AdamW's decay of the matrices.
      clip: the gradients' global norm is clipped to this.
      n_layer, n_head, n_kv_head, d_model: the model's size.
      seq_len: characters per training window of the text task.
      seed: seeds init, data and evaluation.
      eval_size: unseen patterns decoded by the copy task's evaluation.
      prompt: the start of the text task's sampled continuation.
      sample_tokens: characters sampled after the prompt.
      temperature, top_k, top_p: the sampling's knobs (`jaxformer.generate`).
      dtype: compute dtype, "float32" or "bfloat16".

    Raises:
      ValueError: naming the flag of a value out of range.
    """

    task: str = "copy"
    data: str | None = None
    steps: int = 800
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    d_model: int = 128
    seq_len: int = 256
    seed: int = 1337
    eval_size: int = 1000
    prompt: str = ""
    sample_tokens: int = 400
    temperature: float = 0.8
    top_k: int = 40
    top_p: float | None = None
    dtype: str = "float32"

    # What --resume must match besides the model; steps too, since the cosine's length
    # depends on it.
    RESUME_FIELDS: ClassVar[tuple[str, ...]] = ("task", "data", "seed", "steps", "batch_size", "lr", "warmup",
                                                "weight_decay", "clip")

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {TASKS} (got {self.task!r})")
        cli.check_shared_settings(self)
        cli.require_positive(self, "warmup", "eval_size", "seq_len", "sample_tokens")
        if self.warmup > self.steps:
            raise ValueError(f"--warmup ({self.warmup}) must not exceed --steps ({self.steps})")
        cli.require_finite(self, "lr", above=0)
        cli.require_finite(self, "clip", above=0)
        cli.require_finite(self, "weight_decay", at_least=0)
        # The sampling knobs by generate's own rules, checked now rather than after training.
        check_temperature(self.temperature, name="--temperature")
        check_top_k(self.top_k, None, name="--top-k")  # the vocabulary is known once the data is read
        if self.top_p is not None:
            check_top_p(self.top_p, name="--top-p")
        if self.task == "text" and self.data is None:
            raise ValueError("--task text needs --data FILE (a UTF-8 text file)")

    @property
    def run_name(self) -> str:
        """A new run directory is runs/<run_name>-<time>."""
        return f"lm-{self.task}"


def parse_args(argv=None) -> tuple[Settings, cli.RunOptions]:
    defaults = Settings()
    p = cli.make_parser(PROG, __doc__, defaults)
    p.add_argument("--task", choices=TASKS, default=defaults.task, help="copy: the synthetic copy task; text: a character-level LM on --data")
    p.add_argument("--data", metavar="FILE", help="UTF-8 text file, needed by --task text")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW decay of the matrices")
    p.add_argument("--clip", type=float, default=defaults.clip, help="gradient clipping (global norm)")
    p.add_argument("--n-layer", type=int, default=defaults.n_layer, help="decoder blocks")
    p.add_argument("--n-head", type=int, default=defaults.n_head, help="query heads")
    p.add_argument("--n-kv-head", type=int, default=defaults.n_kv_head, help="key/value heads (GQA)")
    p.add_argument("--d-model", type=int, default=defaults.d_model, help="model width")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="--task text: characters per training window")
    p.add_argument("--eval-size", type=int, default=defaults.eval_size, help="--task copy: unseen patterns decoded")
    p.add_argument("--prompt", default=defaults.prompt,
                   help="--task text: the continuation's start (default: empty, sampling starts from character 0)")
    p.add_argument("--sample-tokens", type=int, default=defaults.sample_tokens,
                   help="--task text: characters sampled")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="--task text: sampling temperature")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="--task text: sample among the k likeliest")
    p.add_argument("--top-p", type=float, default=defaults.top_p,
                   help="--task text: nucleus sampling, in (0, 1] (default: off, every token of the top k)")
    cli.add_run_flags(p, "lm-<task>", checkpoint_every=200, log_every=50)
    return cli.parse(p, argv, Settings)


def training_length(settings: Settings, corpus: CharText | None) -> int:
    """Tokens per training sequence: the copy task's [BOS] p [SEP] p less one, or the text window."""
    return settings.seq_len if corpus else 2 * COPY_LEN + 1


def model_config(settings: Settings, corpus: CharText | None) -> DecoderConfig:
    """The decoder at the settings' size, long enough for training and for the sample."""
    seq_len = training_length(settings, corpus)
    max_seq_len = (seq_len if corpus is None else max(seq_len, len(settings.prompt) + settings.sample_tokens)) + 8
    return DecoderConfig(vocab_size=corpus.vocab_size if corpus else COPY_VOCAB, n_layer=settings.n_layer,
                         n_head=settings.n_head, n_kv_head=settings.n_kv_head, d_model=settings.d_model,
                         max_seq_len=max_seq_len, dtype=settings.dtype)


def build(settings: Settings = Settings()) -> cli.Setup:
    """The decoder-only demo ready to train.

    AdamW (0.9, 0.95) with weight decay on the matrices only, warm-up then cosine to
    10 %, gradient clipping; batches of the copy task, or of windows of the text file.

    Args:
      settings: the recipe; `Settings()` is the command line's default (the copy task).

    Returns:
      The model, its initial parameters, optimizer, schedule, loss and batches; for the
      text task also the corpus.

    Raises:
      ValueError: an unreadable or too short text file, a prompt with characters the
        text does not have, or a model config that does not hold together.
    """
    corpus = CharText(settings.data, settings.seq_len) if settings.task == "text" else None
    if corpus is not None:
        corpus.encode(settings.prompt)  # a prompt the vocabulary cannot spell is refused before training
    model = Decoder(model_config(settings, corpus))
    params = cli.init_params(model, settings.seed)
    schedule = warmup_cosine_schedule(settings.lr, settings.warmup, settings.steps)
    optimizer = optax.chain(
        optax.clip_by_global_norm(settings.clip),
        # Decay the matrices (embedding included), not the norms' weight vectors.
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=settings.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )
    ignore = IGNORE if corpus is None else None  # the copy task scores only the second copy

    def loss_fn(params, batch, dropout_key):  # (the decoder-only model has no dropout)
        logits, _ = model.apply({"params": params}, batch["tokens"])
        return label_smoothed_cross_entropy(logits, batch["targets"], 0.0, ignore_id=ignore), {}

    make_batch = (functools.partial(copy_batch, batch_size=settings.batch_size) if corpus is None
                  else functools.partial(corpus.batch, batch_size=settings.batch_size))
    return cli.Setup(model=model, params=params, optimizer=optimizer, schedule=schedule, loss_fn=loss_fn,
                     make_batch=make_batch, tokens_per_step=settings.batch_size * training_length(settings, corpus),
                     corpus=corpus)


def describe(setup: cli.Setup, settings: Settings) -> None:
    """The device, the task, the model's size, and the loss of a uniform guess."""
    config, params = setup.model.config, setup.params
    n_params = cli.count_params(params)
    cli.print_device()
    print(f"task {settings.task}: vocab {config.vocab_size}, sequences of {training_length(settings, setup.corpus)}")
    print(f"model: {config.n_layer} layers x {config.d_model}, {config.n_head} query / {config.n_kv_head} kv heads, "
          f"{n_params:,} params ({n_params - params['embed'].size:,} non-embedding)")
    chance = math.log(COPY_SYMBOLS if setup.corpus is None else config.vocab_size)
    print(f"chance loss (uniform) = {chance:.4f}\n")


def evaluate(setup: cli.Setup, settings: Settings, trained: cli.Trained) -> dict:
    """The copy task: token accuracy and exact match of KV-cached greedy decoding on
    unseen patterns. The text task: validation loss, and a sampled continuation.

    Returns:
      The results; for the copy task also a target and its decoding, for the text task
      the sample.
    """
    model, params, corpus = setup.model, trained.params, setup.corpus
    eval_key = cli.evaluation_key(settings.seed)
    if corpus is None:
        prompts, patterns = copy_prompts(eval_key, settings.eval_size)  # [n, L + 2], [n, L]
        out = generate(model, params, prompts, max_new_tokens=COPY_LEN)[:, COPY_LEN + 2:]  # [n, L]
        return {"token_accuracy": float(jnp.mean(out == patterns)),
                "exact_match": float(jnp.mean(jnp.all(out == patterns, axis=1))),
                "target": np.asarray(patterns[0, :12]).tolist(), "decoded": np.asarray(out[0, :12]).tolist()}
    val = jnp.mean(jnp.stack([setup.loss_fn(params, corpus.batch(k, settings.batch_size, "val"), None)[0]
                              for k in jax.random.split(eval_key, 20)]))
    prompt_ids = corpus.encode(settings.prompt)
    prompt = jnp.asarray([prompt_ids or [0]], jnp.int32)  # [1, prompt length]
    sample = generate(model, params, prompt, max_new_tokens=settings.sample_tokens, key=jax.random.key(settings.seed),
                      temperature=settings.temperature, top_k=min(settings.top_k, corpus.vocab_size),
                      top_p=settings.top_p)
    # Without a prompt, character 0 only started the sampling: it is not part of the text.
    return {"validation_loss": float(val), "sample": corpus.decode(np.asarray(sample[0, 0 if prompt_ids else 1:]))}


def report(settings: Settings, trained: cli.Trained, evaluation: dict, run_dir) -> None:
    """Prints the evaluation and writes the run's results to `run_dir/eval.json`."""
    results = {"steps": trained.steps, "final_loss": trained.last["loss"], "train_seconds": trained.seconds}
    if settings.task == "copy":
        print(f"\nKV-cached greedy decoding on {settings.eval_size} unseen patterns:")
        print(f"  token accuracy {evaluation['token_accuracy']:.2%}   exact match {evaluation['exact_match']:.2%}   "
              f"(chance {1 / COPY_SYMBOLS:.1%} a token)")
        print(f"  target  {evaluation['target']} ...\n  decoded {evaluation['decoded']} ...")
        results.update(token_accuracy=evaluation["token_accuracy"], exact_match=evaluation["exact_match"])
    else:
        val = evaluation["validation_loss"]
        print(f"\ntrain loss {trained.last['loss']:.4f}   validation loss {val:.4f} (ppl {math.exp(val):.2f})")
        print("-" * 60 + "\n" + evaluation["sample"] + "\n" + "-" * 60)
        results.update(validation_loss=val, sample=evaluation["sample"])
    cli.write_results(run_dir, results)


def main(argv=None) -> int:
    settings, run = parse_args(argv)
    cli.start_process()
    setup = cli.build_or_fail(PROG, build, settings)
    begun = cli.start(PROG, setup, settings, run)
    describe(setup, settings)
    trained = cli.train(setup, settings, run, begun)
    evaluation = evaluate(setup, settings, trained)
    report(settings, trained, evaluation, run.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
