"""`python -m train.reverse`: train the 2017 Transformer to reverse sequences, and look inside.

1. a shape trace of one forward pass (ids, masks, embeddings, heads, memory,
   cross-attention weights, logits);
2. training with the paper's recipe: Adam (0.9, 0.98, 1e-9), the Noam schedule,
   label smoothing 0.1, dropout 0.1, the last parameters averaged; 50 updates per compiled
   call, checkpoints, `--resume`;
3. evaluation by KV-cached greedy decoding on fresh sequences: exact match overall and
   per length, and on longer sequences than any seen in training (a probe of
   generalisation, reported whatever it shows);
4. the cross-attention map of the last decoder layer: decoder step k should read
   source position L - 1 - k, an anti-diagonal.

The defaults (a 2-layer, d_model 64 model; 1250 steps of 128 sequences of 5 to 10
symbols) train on a CPU and reverse nearly every fresh sequence; docs/training.md says
how far the result moves with the seed and the float path, the README gives the time
and figures of one run and the machine it ran on.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from pathlib import Path
from typing import ClassVar

import jax
import numpy as np
import optax

from jaxformer import VanillaConfig, VanillaTransformer, generate
from jaxformer.command_line import exit_process, run_command
from jaxformer.decoding import compile_generate
from jaxformer.losses import label_smoothed_cross_entropy
from jaxformer.runtime import is_primary
from jaxformer.schedules import noam_schedule
from jaxformer.training import average_last, averaged, flags, run_start, runs
from jaxformer.training.report_page import attention_group, result_label
from jaxformer.validation import as_float, as_int
from train.attention_maps import ascii_attention, save_attention_grid
from train.tasks import BOS, EOS, PAD, REVERSE_VOCAB, reverse_batch

PROG = "python -m train.reverse"
MODEL_CONFIG = VanillaConfig
MIN_LEN, MAX_LEN = 5, 10
PROBE_LENGTHS = (11, 12, 13, 14, 15, 16)  # never seen in training
MAP_LENGTH = 8
EXAMPLES = 4  # decoded examples of each evaluation set kept in eval.json
# Updates per compiled call (a `lax.scan`): one dispatch for many small steps, which
# XLA:CPU also runs faster in the loop than one by one. It divides the default log and
# checkpoint intervals.
STEPS_PER_CALL = 50
# The paper's checkpoint averaging: the model evaluated is the mean of the parameters after
# the last AVERAGED updates AVERAGE_EVERY apart (closer together in a run too short for that).
AVERAGED, AVERAGE_EVERY = 5, 50
# How the report page shows eval.json's results, in its order.
RESULT_LABELS = {
    "exact_match": result_label("exact match, trained lengths", "rate"),
    "probe_exact_match": result_label("exact match, unseen longer lengths (probe)", "rate"),
    "per_length": result_label("Exact match per length: trained lengths", "per_length"),
    "probe_per_length": result_label("Exact match per length: unseen longer lengths (probe)", "per_length"),
    "examples": result_label("Decoded examples", "examples"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The reversal demo's recipe; the defaults are the command line's.

    Attributes:
      steps: training steps (updates).
      batch_size: sequences per update.
      seed: seeds init, data, dropout and evaluation.
      n_layer: encoder layers (and as many decoder layers).
      d_model: model width.
      d_ff: feed-forward hidden width.
      n_head: attention heads.
      dropout: dropout rate.
      norm_first: pre-norm instead of the paper's post-norm.
      warmup: Noam warmup steps.
      label_smoothing: in [0, 1).
      eval_size: fresh sequences decoded for each evaluation set.
      dtype: compute dtype, "float32" or "bfloat16".

    Raises:
      ValueError: naming the flag of a value out of range.
    """

    steps: int = 1250
    batch_size: int = 128
    seed: int = 0
    n_layer: int = 2
    d_model: int = 64
    d_ff: int = 128
    n_head: int = 4
    dropout: float = 0.1
    norm_first: bool = False
    warmup: int = 400
    label_smoothing: float = 0.1
    eval_size: int = 1000
    dtype: str = "float32"

    # What --resume must match besides the model; not steps: a finished run may be extended.
    RESUME_FIELDS: ClassVar[tuple[str, ...]] = ("seed", "batch_size", "warmup", "label_smoothing")
    INPUT_FIELDS: ClassVar[tuple[str, ...]] = ()  # it reads no file: its data is drawn

    def __post_init__(self):
        flags.check_shared_settings(self)
        flags.check(self, as_int, "warmup", "eval_size", minimum=1)
        flags.check(self, as_float, "label_smoothing", at_least=0, below=1)

    @property
    def run_name(self) -> str:
        """A new run directory is runs/<run_name>-<time>."""
        return "reverse"


def parse_args(argv=None) -> tuple[Settings, flags.RunOptions]:
    defaults = Settings()
    p = flags.make_parser(PROG, __doc__, defaults)
    p.add_argument("--n-layer", type=int, default=defaults.n_layer, help="encoder layers (and as many decoder layers)")
    p.add_argument("--d-model", type=int, default=defaults.d_model, help="model width")
    p.add_argument("--d-ff", type=int, default=defaults.d_ff, help="feed-forward hidden width")
    p.add_argument("--n-head", type=int, default=defaults.n_head, help="attention heads")
    p.add_argument("--dropout", type=float, default=defaults.dropout, help="dropout rate")
    p.add_argument("--norm-first", action="store_true", help="pre-norm instead of the paper's post-norm")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="Noam warmup steps")
    p.add_argument("--label-smoothing", type=float, default=defaults.label_smoothing, help="in [0, 1)")
    p.add_argument("--eval-size", type=int, default=defaults.eval_size,
                   help="fresh sequences decoded for each evaluation set")
    flags.add_run_flags(p, "reverse", checkpoint_every=500, log_every=100)
    return flags.parse(p, argv, Settings)


def model_config(settings: Settings) -> VanillaConfig:
    """The 2017 model at the settings' size, long enough for the generalisation probe."""
    return VanillaConfig(src_vocab_size=REVERSE_VOCAB, tgt_vocab_size=REVERSE_VOCAB, n_layer=settings.n_layer,
                         d_model=settings.d_model, d_ff=settings.d_ff, n_head=settings.n_head,
                         dropout=settings.dropout, pad_id=PAD, max_seq_len=max(PROBE_LENGTHS) + 2,
                         norm_first=settings.norm_first, dtype=settings.dtype)


def build(settings: Settings = Settings()) -> runs.Setup:
    """The reversal demo ready to train, with the paper's recipe.

    Adam (0.9, 0.98, 1e-9) on the Noam schedule, label smoothing, dropout, and the mean of
    the parameters after the last 5 updates 50 apart evaluated (`average_last`); batches of
    `settings.batch_size` sequences of 5 to 10 symbols.

    Args:
      settings: the recipe; `Settings()` is the command line's default.

    Returns:
      The model, its initial parameters, optimizer, schedule, loss and batches.

    Raises:
      ValueError: a model config that does not hold together (e.g. `d_model` not
        divisible by `n_head`).
    """
    model = VanillaTransformer(model_config(settings))
    params = runs.init_params(model, settings.seed)
    schedule = noam_schedule(settings.d_model, settings.warmup)
    # The paper's Adam: beta2 0.98 and eps 1e-9. The schedule *is* the learning rate.
    adam = optax.adam(learning_rate=schedule, b1=0.9, b2=0.98, eps=1e-9)
    last = min(AVERAGED, settings.steps)
    every = max(1, min(AVERAGE_EVERY, (settings.steps - 1) // max(1, last - 1)))
    optimizer = average_last(adam, last, every, settings.steps)

    def loss_fn(params, batch, dropout_key):
        logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=False,
                             rngs={"dropout": dropout_key})
        return label_smoothed_cross_entropy(logits, batch["tgt_out"], settings.label_smoothing, ignore_id=PAD), {}

    make_batch = functools.partial(reverse_batch, batch_size=settings.batch_size, min_len=MIN_LEN, max_len=MAX_LEN)
    # Every target row is MAX_LEN + 1 wide: the reversed symbols, EOS, then padding. The
    # batches are drawn on the device, so STEPS_PER_CALL updates run as one compiled scan.
    return runs.Setup(model=model, params=params, optimizer=optimizer, schedule=schedule, loss_fn=loss_fn,
                      make_batch=make_batch, tokens_per_step=settings.batch_size * (MAX_LEN + 1),
                      steps_per_call=STEPS_PER_CALL, evaluated=lambda state: averaged(state.opt_state, state.params))


def describe(setup: runs.Setup, trace) -> None:
    """The device, the parameter count, and the shape trace (`shape_trace`'s rows)."""
    run_start.print_device()
    print(f"params: {run_start.count_params(setup.params):,}   (the paper's base model: 65M)\n")
    print("shape trace (B=batch, S=src len, T=tgt len, d=d_model, h=heads)\n")
    for name, shape, note in trace:
        print(f"  {name:<44} {str(shape):<18} {note}")


def shape_trace(model: VanillaTransformer, params) -> list[tuple[str, tuple, str]]:
    """What each stage of one forward pass on two full-length examples produces.

    Shapes only: `jax.eval_shape` traces the model abstractly, nothing is computed.

    Returns:
      `(stage, shape, note)` rows.
    """
    c = model.config
    batch = jax.eval_shape(functools.partial(reverse_batch, batch_size=2, min_len=MAX_LEN, max_len=MAX_LEN),
                           jax.random.key(0))  # (shapes too: drawn, it would compile a program of its own)
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
    return [(name, tuple(shape), note) for name, shape, note in rows]


def evaluation_sets(settings: Settings) -> dict[str, dict]:
    """The fresh sequences the run is evaluated on, drawn on the host: `"seen"`, of the trained
    lengths, and `"probe"`, of the longer ones; `settings.eval_size` each, from the run's
    evaluation key (`runs.evaluation_key`), whatever the training drew.

    Returns:
      `{"seen": batch, "probe": batch}`, each `reverse_batch`'s numpy arrays, padded to the
      set's longest length.
    """
    # (On the host: sliced on the device, every example's row would compile a slice of its own.)
    eval_key, probe_key = jax.random.split(runs.evaluation_key(settings.seed))
    return {name: jax.device_get(reverse_batch(key, settings.eval_size, min(lengths), max(lengths), width=max(lengths)))
            for name, key, lengths in (("seen", eval_key, range(MIN_LEN, MAX_LEN + 1)),
                                       ("probe", probe_key, PROBE_LENGTHS))}


def decoding_options(batch: dict) -> dict:
    """`generate`'s options for a batch of `evaluation_sets`: greedy, from BOS to EOS, room for
    the reversed symbols and EOS."""
    return {"max_new_tokens": batch["src"].shape[1] + 1, "bos_id": BOS, "eos_id": EOS}


def prepare_evaluation(setup: runs.Setup, settings: Settings) -> dict[str, dict]:
    """`evaluation_sets(settings)`, and the decoding program of each compiled, not run.

    Called on a thread of its own when training begins: the compiles then take the core that
    the training's own compile (one thread) leaves idle, instead of the wall time after it.
    Only the parameters' shapes count; they are the initial ones, on the host as the trained
    ones will be (`runs.Trained.params`), so that `generate` finds its program compiled.
    """
    sets = evaluation_sets(settings)
    params = jax.device_get(setup.params)
    for batch in sets.values():
        compile_generate(setup.model, params, batch["src"], **decoding_options(batch))
    return sets


def decoding_exact_match(model, params, batch: dict) -> dict:
    """Exact-match rate of cached greedy decoding on a batch of `evaluation_sets`.

    A row counts only if every decoded token is right: the reversed symbols, then EOS
    (then padding).

    Args:
      model, params: the trained model.
      batch: the sequences, `reverse_batch`'s arrays on the host.

    Returns:
      `{"exact_match", "n", "per_length": {length: (rate, count)}, "examples"}`, the
      examples the first `EXAMPLES` rows as `{"input", "target", "output"}` tokens
      (`token_text`), target and output up to the target's EOS.
    """
    out = np.asarray(generate(model, params, batch["src"], **decoding_options(batch)))
    exact = np.all(out[:, 1:] == batch["tgt_out"], axis=1)  # [n]
    length = batch["length"]
    n = len(length)
    per_length = {int(L): (float(exact[length == L].mean()), int((length == L).sum())) for L in np.unique(length)}

    def tokens(row):
        return [token_text(t) for t in row]

    examples = [{"input": tokens(batch["src"][i, :length[i]]), "target": tokens(batch["tgt_out"][i, :length[i] + 1]),
                 "output": tokens(out[i, 1:length[i] + 2])} for i in range(min(n, EXAMPLES))]
    return {"exact_match": float(exact.mean()), "n": n, "per_length": per_length, "examples": examples}


def token_text(token: int) -> str:
    """A token of the reversal task as the page and the maps label it."""
    return {PAD: "PAD", BOS: "BOS", EOS: "EOS"}.get(int(token), str(int(token)))


def snapshotter(setup: runs.Setup, settings: Settings):
    """`snapshot(params)`: every attention map of one length-8 example, teacher-forced
    (encoder self, decoder self and cross-attention, every layer and head), for the
    report page. One compiled forward serves every call; the example is the same
    whatever the settings."""
    c = setup.model.config
    batch = reverse_batch(jax.random.key(1), 1, MAP_LENGTH, MAP_LENGTH, width=MAX_LEN)
    forward = jax.jit(functools.partial(setup.model.apply, mutable=["intermediates"]))
    src = [token_text(t) for t in np.asarray(batch["src"])[0, :MAP_LENGTH]]
    tgt = [token_text(t) for t in np.asarray(batch["tgt_in"])[0, :MAP_LENGTH + 1]]  # BOS + the 8 reversed

    def snapshot(params) -> dict:
        inter = forward({"params": params}, batch["src"], batch["tgt_in"])[1]["intermediates"]

        def weights(stack, layer, kind, rows, cols):  # [n_head, rows, cols] of the example
            return np.asarray(inter[f"{stack}_layers_{layer}"][kind]["attention_weights"][0])[0, :, :rows, :cols]

        groups = []
        for layer in range(c.n_layer):
            groups += [
                attention_group("encoder self-attention", layer, weights("encoder", layer, "self_attn", MAP_LENGTH,
                                                                          MAP_LENGTH), src, src),
                attention_group("decoder self-attention", layer, weights("decoder", layer, "self_attn",
                                                                          MAP_LENGTH + 1, MAP_LENGTH + 1), tgt, tgt),
                attention_group("cross-attention (rows: decoder, columns: source)", layer,
                                weights("decoder", layer, "cross_attn", MAP_LENGTH + 1, MAP_LENGTH), tgt, src,
                                note=f"To reverse, decoder step k reads source position {MAP_LENGTH} - 1 - k: an "
                                     "anti-diagonal forms as the model learns (a head may read one position over, "
                                     "where the symbol it was just given came from).")]
        return {"attention": groups}

    return snapshot


def cross_attention_map(snapshot: dict, run_dir: Path | None) -> str:
    """The cross-attention of a snapshot: ASCII (last layer, heads averaged) and, unless
    `run_dir` is None, a PNG of every layer and head in it."""
    cross = [g for g in snapshot["attention"] if g["name"].startswith("cross")]
    weights = np.array([g["heads"] for g in cross])  # [n_layer, n_head, T, S]
    rows, cols = cross[0]["rows"], cross[0]["cols"]
    if run_dir is not None and is_primary():  # the run's files are process 0's
        save_attention_grid(weights, run_dir / "cross_attention.png", rows, cols,
                            title="cross-attention, every layer and head")
    return ascii_attention(weights[-1].mean(0), rows, cols)


def evaluate(setup: runs.Setup, trained: runs.Trained, run_dir: Path, snapshot,
             prepared: concurrent.futures.Future) -> dict:
    """Decodes fresh sequences of the trained lengths and of the probe's longer ones,
    and draws the cross-attention map of `snapshot` (`snapshotter`'s) of the trained
    parameters (its PNG into `run_dir`, unless the run had finished before: then the one
    there is kept).

    Args:
      prepared: `prepare_evaluation`'s, running or done.

    Returns:
      The results: exact match overall and per length for both sets, an example, the
      decoding time (a compile the preparation had not finished included) and the map as ASCII.
    """
    model, params = setup.model, trained.params
    start = time.perf_counter()
    sets = prepared.result()
    seen = decoding_exact_match(model, params, sets["seen"])
    probe = decoding_exact_match(model, params, sets["probe"])
    return {"seen": seen, "probe": probe, "decode_seconds": time.perf_counter() - start,
            "map": cross_attention_map(snapshot(params), None if trained.finished_before else run_dir)}


def report(settings: Settings, trained: runs.Trained, evaluation: dict, run_dir: Path) -> None:
    """Prints the evaluation and writes the run's results to `run_dir/eval.json`."""
    seen, probe = evaluation["seen"], evaluation["probe"]
    print(f"\ncached greedy decoding, {settings.eval_size} fresh sequences of lengths {MIN_LEN}-{MAX_LEN} "
          f"(exact = every reversed symbol, then EOS):")
    print(f"  exact match {seen['exact_match']:.2%}")
    print("  per length  " + "  ".join(f"{L}: {r:.1%} (n={n})" for L, (r, n) in seen["per_length"].items()))
    example = seen["examples"][0]
    print(f"  src     {' '.join(example['input'])}\n  decoded {' '.join(example['output'])}")
    print(f"\ngeneralisation probe, {settings.eval_size} sequences of unseen lengths "
          f"{PROBE_LENGTHS[0]}-{PROBE_LENGTHS[-1]}:")
    print(f"  exact match {probe['exact_match']:.2%}")
    print("  per length  " + "  ".join(f"{L}: {r:.1%}" for L, (r, _) in probe["per_length"].items()))
    print(f"  (decoding took {evaluation['decode_seconds']:.1f} s for both sets, compile included)")

    print(f"\ncross-attention, last decoder layer (heads averaged), one length-{MAP_LENGTH} example, teacher-forced")
    print(evaluation["map"])
    print(f"\n  decoder step k should be reading source position {MAP_LENGTH + 1}-k -> anti-diagonal")
    print(f"  every layer and head: {run_dir / 'cross_attention.png'}")

    runs.write_results(run_dir, trained, {
        "exact_match": seen["exact_match"], "per_length": seen["per_length"],
        "probe_exact_match": probe["exact_match"], "probe_per_length": probe["per_length"],
        "examples": [{"label": label, **example} for label, results in (("trained length", seen), ("probe", probe))
                     for example in results["examples"]]}, RESULT_LABELS)


def main(argv=None) -> int:
    return run_command(PROG, lambda: _main(argv))


def _main(argv) -> int:
    settings, run = parse_args(argv)
    runs.start_process(PROG)
    setup = runs.build_or_fail(PROG, build, settings)
    trace = shape_trace(setup.model, setup.params)
    with run_start.start(PROG, setup, settings, run, trace) as begun:
        describe(setup, trace)
        print(f"\n{'=' * 72}\ntraining on 'reverse the sequence' to step {settings.steps}, "
              f"batch {settings.batch_size}, run dir {run.run_dir}\n")
        snapshot = snapshotter(setup, settings)
        with concurrent.futures.ThreadPoolExecutor(1) as ahead:
            prepared = ahead.submit(prepare_evaluation, setup, settings)
            trained = runs.train(setup, settings, run, begun, snapshot)
            evaluation = evaluate(setup, trained, run.run_dir, snapshot, prepared)
        report(settings, trained, evaluation, run.run_dir)
    return 0


if __name__ == "__main__":
    exit_process(main())
