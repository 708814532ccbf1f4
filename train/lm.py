"""`python -m train.lm`: train the decoder-only Transformer, then decode with the KV cache.

  --task copy (default)  [BOS] p_1..p_32 [SEP] p_1..p_32 over 48 symbols, a fresh random
                         pattern every time, only the second copy scored: it can only
                         be solved by attention reading back across SEP. Evaluated by
                         KV-cached greedy decoding on unseen patterns.
  --task text --data F   a language model on any UTF-8 file, its tokens characters
                         (--tokenizer char) or byte-level BPE learned from the file
                         (--tokenizer bpe): train and validation loss, then a sampled
                         continuation (--prompt, --temperature, --top-k, --top-p).

--export DIR writes the trained model and its tokenizer as a Hugging Face folder.

AdamW (0.9, 0.95) with weight decay on matrices only, warm-up then cosine to 10 %,
gradient clipping at 1.0, as one optax chain.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import shlex
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxformer import Decoder, DecoderConfig, chunked_cross_entropy, generate, warmup_cosine_schedule
from jaxformer.command_line import FAILED, exit_process, fail, run_command
from jaxformer.convert import save_hf
from jaxformer.decoder import sown_attention_weights
from jaxformer.decoding.sampling import check_temperature, check_top_k, check_top_p
from jaxformer.text import Tokenizer, save_tokenizer
from jaxformer.text.streaming import REPLACEMENT
from jaxformer.training import exports, flags, run_start, runs
from jaxformer.training.report_page import attention_group, result_label, token_labels
from jaxformer.validation import as_float, as_int, one_of, require
from train.tasks import (
    BPE_MIN_VOCAB,
    COPY_LEN,
    COPY_SYMBOLS,
    IGNORE,
    TEXT_TOKENIZERS,
    TextCorpus,
    copy_batch,
    copy_prompts,
    copy_tokenizer,
    encode_prompt,
)

PROG = "python -m train.lm"
MODEL_CONFIG = DecoderConfig
TASKS = ("copy", "text")
DEFAULT_TOKENIZER = "char"  # of the text task
DEFAULT_BPE_VOCAB = 512
EXAMPLE_PROMPT_TOKENS = 8  # of the text: the export's example prompt when there is no --prompt
EXAMPLES = 4  # decoded copy-task examples kept in eval.json
SNAPSHOT_PROMPTS = 2  # copy-task patterns decoded at each checkpoint, for the report page
MAP_TOKENS = 48  # of the validation text: the text task's attention example
# How the report page shows eval.json's results (those of the run's task), in its order.
RESULT_LABELS = {
    "token_accuracy": result_label("token accuracy", "rate"),
    "exact_match": result_label("exact match", "rate"),
    "validation_loss": result_label("validation loss"),
    "examples": result_label("Decoded examples", "examples"),
    "sample": result_label("Sampled continuation", "text"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The decoder-only demo's recipe; the defaults are the command line's.

    Attributes:
      task: "copy" (the synthetic copy task) or "text" (a language model of `data`).
      data: the UTF-8 text file of the text task.
      tokenizer: the text task's, "char" or "bpe" (`train.tasks.TextCorpus`); None (the
        text task's default, "char") is filled in; the copy task has its own.
      vocab_size: the BPE vocabulary's size, at least 257; None (bpe's default, 512) is
        filled in; only for "bpe".
      steps: training steps (updates); the cosine decays over all of them.
      batch_size: sequences per update.
      lr: peak learning rate.
      warmup: linear warm-up steps, at most `steps`.
      weight_decay: AdamW's decay of the matrices.
      clip: the gradients' global norm is clipped to this.
      n_layer, n_head, n_kv_head, d_model: the model's size.
      seq_len: tokens per training window of the text task.
      seed: seeds init, data and evaluation.
      eval_size: unseen patterns decoded by the copy task's evaluation.
      prompt: the start of the text task's sampled continuation.
      sample_tokens: tokens sampled after the prompt.
      temperature, top_k, top_p: the sampling's knobs (`jaxformer.generate`).
      dtype: compute dtype, "float32" or "bfloat16".

    Raises:
      ValueError: naming the flag of a value out of range.
    """

    task: str = "copy"
    data: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
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
    RESUME_FIELDS: ClassVar[tuple[str, ...]] = ("task", "data", "tokenizer", "vocab_size", "seed", "steps",
                                                "batch_size", "lr", "warmup", "weight_decay", "clip")
    INPUT_FIELDS: ClassVar[tuple[str, ...]] = ("data",)  # what no output may be, hold or lie inside

    def __post_init__(self):
        flags.check(self, one_of, "task", choices=TASKS)
        flags.check_shared_settings(self)
        flags.check(self, as_int, "eval_size", "seq_len", "sample_tokens", minimum=1)
        flags.check(self, as_int, "warmup", minimum=1, maximum=self.steps, maximum_name="--steps")
        flags.check(self, as_float, "lr", "clip", above=0)
        flags.check(self, as_float, "weight_decay", at_least=0)
        # The sampling knobs by generate's own rules, checked now rather than after training.
        check_temperature(self.temperature, name="--temperature")
        check_top_k(self.top_k, None, name="--top-k")  # the vocabulary is known once the data is read
        if self.top_p is not None:
            check_top_p(self.top_p, name="--top-p")
        require(self.task != "text" or self.data is not None, "--data", "a UTF-8 text file with --task text",
                self.data)
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        """`tokenizer` and `vocab_size` for the task, their defaults filled in, so that a
        run's record holds what it used however the flags spelled it."""
        flags.check(self, one_of, "tokenizer", choices=TEXT_TOKENIZERS, optional=True)
        require(self.task == "text" or self.tokenizer is None, "--tokenizer",
                f"left out with --task {self.task}, whose vocabulary is its own ({COPY_SYMBOLS} symbols, BOS and SEP)",
                self.tokenizer)
        if self.task == "text" and self.tokenizer is None:
            object.__setattr__(self, "tokenizer", DEFAULT_TOKENIZER)
        given = f"--task {self.task}" + (f" --tokenizer {self.tokenizer}" if self.tokenizer else "")
        require(self.tokenizer == "bpe" or self.vocab_size is None, "--vocab-size",
                f"left out unless --task text --tokenizer bpe, not with {given}", self.vocab_size)
        if self.tokenizer == "bpe":
            if self.vocab_size is None:
                object.__setattr__(self, "vocab_size", DEFAULT_BPE_VOCAB)
            # The 256 bytes and <|endoftext|>, at least.
            flags.check(self, as_int, "vocab_size", minimum=BPE_MIN_VOCAB)

    @property
    def run_name(self) -> str:
        """A new run directory is runs/<run_name>-<time>."""
        return f"lm-{self.task}"


def parse_args(argv=None) -> tuple[Settings, flags.RunOptions]:
    defaults = Settings()
    p = flags.make_parser(PROG, __doc__, defaults)
    p.add_argument("--task", choices=TASKS, default=defaults.task,
                   help="copy: the synthetic copy task; text: a language model of --data")
    p.add_argument("--data", metavar="FILE", help="UTF-8 text file, needed by --task text")
    p.add_argument("--tokenizer", choices=TEXT_TOKENIZERS, default=defaults.tokenizer,
                   help="--task text: char (every distinct character of --data a token) or bpe (byte-level BPE "
                        f"learned from the training 90 %% of --data) (default: {DEFAULT_TOKENIZER})")
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size,
                   help=f"--tokenizer bpe: the most ids the vocabulary holds, >= {BPE_MIN_VOCAB} "
                        f"(default: {DEFAULT_BPE_VOCAB})")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW decay of the matrices")
    p.add_argument("--clip", type=float, default=defaults.clip, help="gradient clipping (global norm)")
    p.add_argument("--n-layer", type=int, default=defaults.n_layer, help="decoder blocks")
    p.add_argument("--n-head", type=int, default=defaults.n_head, help="query heads")
    p.add_argument("--n-kv-head", type=int, default=defaults.n_kv_head, help="key/value heads (GQA)")
    p.add_argument("--d-model", type=int, default=defaults.d_model, help="model width")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len, help="--task text: tokens per training window")
    p.add_argument("--eval-size", type=int, default=defaults.eval_size, help="--task copy: unseen patterns decoded")
    p.add_argument("--prompt", default=defaults.prompt,
                   help="--task text: the continuation's start (default: empty, sampling starts from the BOS "
                        "token, or id 0 of a char vocabulary, which has none)")
    p.add_argument("--sample-tokens", type=int, default=defaults.sample_tokens,
                   help="--task text: tokens sampled")
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="--task text: sampling temperature")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="--task text: sample among the k likeliest")
    p.add_argument("--top-p", type=float, default=defaults.top_p,
                   help="--task text: nucleus sampling, in (0, 1] (default: off, every token of the top k)")
    flags.add_run_flags(p, "lm-<task>", checkpoint_every=200, log_every=50)
    flags.add_export_flag(p)
    return flags.parse(p, argv, Settings)


def training_length(settings: Settings) -> int:
    """Tokens per training sequence: the copy task's [BOS] p [SEP] p less one, or the text window."""
    return settings.seq_len if settings.task == "text" else 2 * COPY_LEN + 1


def sample_start(settings: Settings, tokenizer: Tokenizer) -> list[int]:
    """The ids the text task's sample continues: the prompt's, or without one the BOS
    token alone (id 0 for a char vocabulary, which has none).

    Raises:
      ValueError: a prompt with characters a char vocabulary lacks.
    """
    return encode_prompt(tokenizer, settings.prompt) or [0 if tokenizer.bos_id is None else tokenizer.bos_id]


def model_config(settings: Settings, tokenizer: Tokenizer) -> DecoderConfig:
    """The decoder at the settings' size over the tokenizer's ids, long enough for
    training and for the text task's sample.

    Raises:
      ValueError: see `sample_start`; a config that does not hold together.
    """
    length = training_length(settings)
    if settings.task == "text":
        length = max(length, len(sample_start(settings, tokenizer)) + settings.sample_tokens)
    return DecoderConfig(vocab_size=tokenizer.vocab_size, n_layer=settings.n_layer, n_head=settings.n_head,
                         n_kv_head=settings.n_kv_head, d_model=settings.d_model, max_seq_len=length + 8,
                         dtype=settings.dtype)


def build(settings: Settings = Settings()) -> runs.Setup:
    """The decoder-only demo ready to train.

    AdamW (0.9, 0.95) with weight decay on the matrices only, warm-up then cosine to
    10 %, gradient clipping; batches of the copy task, or of windows of the text file.

    Args:
      settings: the recipe; `Settings()` is the command line's default (the copy task).

    Returns:
      The model, its initial parameters, optimizer, schedule, loss and batches, and the
      tokenizer of its ids; for the text task also the corpus.

    Raises:
      ValueError: an unreadable or too short text file, a prompt with characters the
        text does not have, or a model config that does not hold together.
    """
    corpus = (TextCorpus(settings.data, settings.seq_len, settings.tokenizer, settings.vocab_size)
              if settings.task == "text" else None)
    tokenizer = copy_tokenizer() if corpus is None else corpus.tokenizer
    # A prompt the vocabulary cannot spell is refused here, before training.
    model = Decoder(model_config(settings, tokenizer))
    params = runs.init_params(model, settings.seed)
    schedule = warmup_cosine_schedule(settings.lr, settings.warmup, settings.steps)
    optimizer = optax.chain(
        optax.clip_by_global_norm(settings.clip),
        # Decay the matrices (embedding included), not the norms' weight vectors.
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=settings.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )
    ignore = IGNORE if corpus is None else None  # the copy task scores only the second copy

    def loss_fn(params, batch, dropout_key):  # (the decoder-only model has no dropout)
        # From the final hidden states, a chunk of positions' logits at a time: never [batch, T, vocab] whole.
        hidden, _ = model.apply({"params": params}, batch["tokens"], hidden=True)
        return chunked_cross_entropy(hidden, batch["targets"], model.output_head(params), 0.0, ignore_id=ignore), {}

    make_batch = (functools.partial(copy_batch, batch_size=settings.batch_size) if corpus is None
                  else functools.partial(corpus.batch, batch_size=settings.batch_size))
    return runs.Setup(model=model, params=params, optimizer=optimizer, schedule=schedule, loss_fn=loss_fn,
                     make_batch=make_batch, tokens_per_step=settings.batch_size * training_length(settings),
                     corpus=corpus, tokenizer=tokenizer)


def shape_trace(setup: runs.Setup, settings: Settings) -> list[tuple[str, tuple, str]]:
    """What each stage of one forward pass on two training rows produces, as `(stage,
    shape, note)` rows. Shapes only: `jax.eval_shape` traces the model abstractly."""
    c = setup.model.config
    B, T, H, K, D = 2, training_length(settings), c.n_head, c.n_kv_head, c.head_dim
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def forward(params, tokens):
        (logits, _), inter = setup.model.apply({"params": params}, tokens, mutable=["intermediates"])
        return logits, sown_attention_weights(inter, c)  # [B, T, V], [n_layer, B, H, T, T]

    logits, weights = jax.eval_shape(forward, setup.params, tokens)
    return [
        ("token ids", (B, T), ""),
        ("embeddings (the residual stream)", (B, T, c.d_model), ""),
        ("Q after split into heads, RoPE applied", (B, T, H, D), f"head_dim = d/h = {D}"),
        ("K and V (grouped-query)", (B, T, K, D), f"each kv head serves {H // K} query heads"),
        ("causal self-attention weights", weights.shape[1:], f"<- per layer; {c.n_layer} layers"),
        ("SwiGLU hidden", (B, T, c.ffn_dim), "gate * up, then down"),
        ("logits", logits.shape, ""),
    ]


def describe(setup: runs.Setup, settings: Settings) -> None:
    """The device, the task, the model's size, and the loss of a uniform guess."""
    config, params = setup.model.config, setup.params
    n_params = run_start.count_params(params)
    run_start.print_device()
    tokens = f" ({settings.tokenizer} tokens)" if settings.tokenizer else ""
    print(f"task {settings.task}: vocab {config.vocab_size}{tokens}, sequences of {training_length(settings)}")
    print(f"model: {config.n_layer} layers x {config.d_model}, {config.n_head} query / {config.n_kv_head} kv heads, "
          f"{n_params:,} params ({n_params - params['embed'].size:,} non-embedding)")
    chance = math.log(COPY_SYMBOLS if setup.corpus is None else config.vocab_size)
    print(f"chance loss (uniform) = {chance:.4f}\n")


def sample_text(setup: runs.Setup, settings: Settings, params) -> str:
    """The text task's continuation of its start (`sample_start`), sampled with the
    settings' knobs from `jax.random.key(settings.seed)`."""
    tokenizer = setup.tokenizer
    prompt = jnp.asarray([sample_start(settings, tokenizer)], jnp.int32)  # [1, prompt length]
    sample = generate(setup.model, params, prompt, max_new_tokens=settings.sample_tokens,
                      key=jax.random.key(settings.seed), temperature=settings.temperature,
                      top_k=min(settings.top_k, tokenizer.vocab_size), top_p=settings.top_p)
    # Without a prompt, the start token only began the sampling: it is not part of the text.
    return tokenizer.decode(np.asarray(sample)[0, 0 if settings.prompt else 1:])


def snapshotter(setup: runs.Setup, settings: Settings):
    """`snapshot(params)` for the report page: the self-attention of every layer and head
    on one example (a copy-task sequence, or the start of the validation text, at most
    `MAP_TOKENS` and `seq_len` long), and samples: the copy task's greedy decoding of `SNAPSHOT_PROMPTS` unseen
    patterns, or the text task's sampled continuation."""
    model, tokenizer, corpus = setup.model, setup.tokenizer, setup.corpus
    key = jax.random.fold_in(runs.evaluation_key(settings.seed), 1)  # not the evaluation's patterns
    if corpus is None:
        # (On the host: sliced on the device, each slice would compile a program of its own.)
        prompts, patterns = jax.device_get(copy_prompts(key, SNAPSHOT_PROMPTS))  # [n, L + 2], [n, L]
        example = np.concatenate([prompts[:1], patterns[:1, :-1]], axis=1)  # [1, 2L + 1], a training row
    else:
        example = corpus.val[None, :min(MAP_TOKENS, settings.seq_len)]  # [1, T], at most a training window
    labels = token_labels(tokenizer, example[0])
    note = (f"To copy, a token of the second copy reads the first copy's token one after its own match, "
            f"{COPY_LEN} positions back: a stripe below the diagonal forms as the model learns (an induction head)."
            if corpus is None else "")
    forward = jax.jit(functools.partial(model.apply, mutable=["intermediates"]))

    def snapshot(params) -> dict:
        weights = np.asarray(sown_attention_weights(forward({"params": params}, example)[1], model.config))
        attention = [attention_group("self-attention (causal)", layer, weights[layer, 0], labels, labels, note)
                     for layer in range(model.config.n_layer)]
        if corpus is not None:
            return {"attention": attention, "samples": [{"label": "sampled continuation",
                                                         "output": sample_text(setup, settings, params)}]}
        out = np.asarray(generate(model, params, prompts, max_new_tokens=COPY_LEN))[:, COPY_LEN + 2:]  # [n, L]
        samples = [{"label": f"unseen pattern {i}, greedy", "output": token_labels(tokenizer, out[i]),
                    "target": token_labels(tokenizer, patterns[i])} for i in range(SNAPSHOT_PROMPTS)]
        return {"attention": attention, "samples": samples}

    return snapshot


def evaluate(setup: runs.Setup, settings: Settings, trained: runs.Trained) -> dict:
    """The copy task: token accuracy and exact match of KV-cached greedy decoding on
    unseen patterns. The text task: validation loss, and a sampled continuation.

    Returns:
      The results, and `prompt`: the text of a prompt for the exported model (the first
      pattern's for the copy task, with a target and its decoding; the text task's
      `--prompt`, or the start of the file, with the sample).
    """
    model, params, corpus, tokenizer = setup.model, trained.params, setup.corpus, setup.tokenizer
    eval_key = runs.evaluation_key(settings.seed)
    if corpus is None:
        prompts, patterns = jax.device_get(copy_prompts(eval_key, settings.eval_size))  # [n, L + 2], [n, L]
        out = np.asarray(generate(model, params, prompts, max_new_tokens=COPY_LEN))[:, COPY_LEN + 2:]  # [n, L]
        examples = [{"label": f"unseen pattern {i}", "input": token_labels(tokenizer, prompts[i]),
                     "target": token_labels(tokenizer, patterns[i]), "output": token_labels(tokenizer, out[i])}
                    for i in range(min(EXAMPLES, settings.eval_size))]
        return {"token_accuracy": float(np.mean(out == patterns)),
                "exact_match": float(np.mean(np.all(out == patterns, axis=1))),
                "target": patterns[0, :12].tolist(), "decoded": out[0, :12].tolist(),
                "examples": examples, "prompt": tokenizer.decode(np.asarray(prompts[0]), skip_special_tokens=False)}
    # One program for the 20 batches; the parameters an argument, not constants baked into it.
    batch_loss = jax.jit(lambda p, batch: setup.loss_fn(p, batch, None)[0])
    val = np.mean([batch_loss(params, corpus.batch(k, settings.batch_size, "val"))
                   for k in jax.random.split(eval_key, 20)])
    example = settings.prompt or example_prompt(tokenizer, corpus.train[:EXAMPLE_PROMPT_TOKENS])
    return {"validation_loss": float(val), "sample": sample_text(setup, settings, params), "prompt": example}


def example_prompt(tokenizer: Tokenizer, ids) -> str:
    """The text of a few ids as one line, for the export's example command."""
    text = tokenizer.decode(np.asarray(ids)).rstrip(REPLACEMENT)  # less a character the last id cut short
    return " ".join(text.split())


def report(settings: Settings, trained: runs.Trained, evaluation: dict, run_dir) -> None:
    """Prints the evaluation and writes the run's results to `run_dir/eval.json`."""
    results = {}
    if settings.task == "copy":
        print(f"\nKV-cached greedy decoding on {settings.eval_size} unseen patterns:")
        print(f"  token accuracy {evaluation['token_accuracy']:.2%}   exact match {evaluation['exact_match']:.2%}   "
              f"(chance {1 / COPY_SYMBOLS:.1%} a token)")
        print(f"  target  {evaluation['target']} ...\n  decoded {evaluation['decoded']} ...")
        results.update(token_accuracy=evaluation["token_accuracy"], exact_match=evaluation["exact_match"],
                       examples=evaluation["examples"])
    else:
        val = evaluation["validation_loss"]
        print(f"\ntrain loss {trained.last['loss']:.4f}   validation loss {val:.4f} (ppl {math.exp(val):.2f})")
        print("-" * 60 + "\n" + evaluation["sample"] + "\n" + "-" * 60)
        results.update(validation_loss=val, sample=evaluation["sample"])
    runs.write_results(run_dir, trained, results, RESULT_LABELS)


def export(setup: runs.Setup, settings: Settings, trained: runs.Trained, evaluation: dict,
           run: flags.RunOptions) -> None:
    """Writes the trained model and its tokenizer to `run.export` as a Hugging Face
    folder, as one transaction (`exports.write_export`): a previous export there is
    replaced whole, or stays whole. Then prints a command that decodes it.

    Exits with one line (status 1) when the folder cannot be written; the run directory
    keeps the trained run, which `--resume --export` exports again without training.
    """
    tokenizer, path = setup.tokenizer, run.export

    def write(folder):
        save_hf(setup.model.config, trained.params, str(folder), bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                pad_id=tokenizer.pad_id)
        save_tokenizer(tokenizer, str(folder))

    try:
        exports.write_export(path, write)
    except OSError as e:
        fail(PROG, f"cannot write --export {path}: {e.strerror or e}; the trained run is kept in {run.run_dir}: "
                   f"export it with the same flags and --resume --run-dir {run.run_dir} --export {path}", FAILED)
    new_tokens = COPY_LEN if settings.task == "copy" else settings.sample_tokens
    print(f"\nexported to {path}: jaxformer-generate --checkpoint {shlex.quote(str(path))} "
          f"--prompt {shlex.quote(evaluation['prompt'])} --max-new-tokens {new_tokens}")


def main(argv=None) -> int:
    return run_command(PROG, lambda: _main(argv))


def _main(argv) -> int:
    settings, run = parse_args(argv)
    runs.start_process(PROG)
    setup = runs.build_or_fail(PROG, build, settings)
    with run_start.start(PROG, setup, settings, run, shape_trace(setup, settings)) as begun:
        describe(setup, settings)
        trained = runs.train(setup, settings, run, begun, snapshotter(setup, settings))
        evaluation = evaluate(setup, settings, trained)
        report(settings, trained, evaluation, run.run_dir)
        if run.export is not None:
            export(setup, settings, trained, evaluation, run)
    return 0


if __name__ == "__main__":
    exit_process(main())
