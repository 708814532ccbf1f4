"""The fault matrix, non-finite values: parameters or records holding NaN or inf.

The rule: a NaN or an inf never passes for a number. A row whose logits hold one stops at
that step (`NO_TOKEN` inside the loop, `pad_id` in what is returned) and the caller is
told: `generate` and `stream` raise `NonFiniteLogitsError`, naming the rows and steps, with
the tokens made before; the other rows of the batch decode exactly as in a clean run. The
generation command reports such a row (`finish_reason: "error"`, or one stderr line and
exit status 1); the report page draws NaN and inf as gaps and as a grey cell.

Sections:
  Decoding: every strategy (greedy, sampled, beams, ragged, stream, prompt lookup, a
    draft) over both models, with every parameter NaN, an inf in the head, and one
    token's embedding NaN (so only the rows that read it fail: in the prompt, or emitted
    mid-run).
  The command: a saved checkpoint with that embedding, through `main`.
  The report page: a run whose metrics, evaluation and snapshots hold NaN and inf, and
    `jaxformer-report` snapshotting a diverged checkpoint.

Every case is cheap: one tiny untied decoder and one tiny untied encoder-decoder (vocab
32, d_model 16, one layer), built once; a run with bad parameters reuses the programs a
clean run compiled (the parameters are traced), so the file compiles each strategy once.
"""

import dataclasses
import functools
import io
import json
import math
import re
from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import count_compiles
from report_page import check_report, decode_png

from jaxformer import Decoder, DecoderConfig, VanillaConfig, VanillaTransformer, generate, stream
from jaxformer.commands import generate as cli
from jaxformer.convert import save_hf
from jaxformer.decoding import NO_TOKEN, Draft, NonFiniteLogitsError, PromptLookup
from jaxformer.text import save_tokenizer, train_bpe
from jaxformer.training import Checkpointer, TrainState
from jaxformer.training.report_page import (
    attention_group,
    colormap,
    read_snapshots,
    record_session,
    record_snapshot,
    write_report,
)

# Untied heads: a NaN row of the token embedding then reaches only the rows that read that token.
TINY = DecoderConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=16,
                     tie_embeddings=False)
TINY_VANILLA = VanillaConfig(src_vocab_size=32, tgt_vocab_size=32, n_layer=1, d_model=16, d_ff=32, n_head=2,
                             max_seq_len=16, tie_embeddings=False)
PROMPT = np.array([[3, 13, 14, 2], [5, 6, 7, 8]], np.int32)  # [2, 4]; token 13 is only in row 0
BAD = 13  # the token whose embedding is made NaN (row 1 never reads it, in any strategy)
# Prompts after which row 0 emits, by step 1 to 4, a token that row 1 never reads (greedy, sampled, encoder-decoder).
MID_RUN_PROMPT = np.array([[25, 13, 27, 26], [4, 1, 4, 12]], np.int32)
NEW = 6
PAD = 0


def _large(params, seed: int):
    """Every matrix redrawn large (so greedy continuations vary, rather than repeat one
    token), the vectors (norm weights, biases) as initialised; numpy arrays, so that
    making them, or NaN versions of them, compiles nothing."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: np.asarray(x) if x.ndim == 1 else 0.3 * rng.standard_normal(x.shape, np.float32),
                        params)


@functools.cache
def _decoder():
    model = Decoder(TINY)
    return model, _large(jax.jit(model.init)(jax.random.key(0), *model.init_inputs())["params"], seed=0)


@functools.cache
def _vanilla():
    model = VanillaTransformer(TINY_VANILLA)
    return model, _large(jax.jit(model.init)(jax.random.key(0), *model.init_inputs())["params"], seed=1)


def _embedding(build) -> str:
    """The table a token's id reads: the decoder's embedding, the encoder-decoder's
    target embedding (its source embedding is `src_embed`)."""
    return "embed" if build is _decoder else "tgt_embed"


def _with(params, table: str, index, value: float = math.nan):
    """`params` (numpy) with `params[table][index]` set to `value`."""
    changed = np.array(params[table])
    changed[index] = value
    return {**params, table: changed}


def _all_nan(params):
    return jax.tree.map(lambda x: np.full_like(x, np.nan), params)


def _inf_in_head(build, params):
    """One weight of the output head +inf: the logits of one token become +-inf (not NaN),
    which argmax would pick."""
    return _with(params, "lm_head" if build is _decoder else "out_proj", (0, 5), math.inf)


# The strategies: (build, generate's options). Beam search and the encoder-decoder
# decode through the same rule.
STRATEGIES = {
    "greedy": (_decoder, {}),
    "sampled": (_decoder, dict(temperature=1.0, top_k=20, top_p=0.9, key=jax.random.key(1))),
    "beams": (_decoder, dict(num_beams=3, eos_id=4)),
    "ragged": (_decoder, dict(prompt_lengths=[4, 2])),
    "lookup": (_decoder, dict(speculative=PromptLookup(k=3, n=2))),
    "draft": (_decoder, "draft"),
    "nan-draft": (_decoder, "nan-draft"),
    "vanilla-greedy": (_vanilla, dict(bos_id=1)),
    "vanilla-sampled": (_vanilla, dict(bos_id=1, temperature=1.0, key=jax.random.key(1))),
    "vanilla-beams": (_vanilla, dict(bos_id=1, num_beams=3, eos_id=4)),
}
STREAMED = ["greedy", "sampled", "ragged", "lookup", "draft", "nan-draft", "vanilla-greedy"]


def _options(name: str) -> tuple:
    build, options = STRATEGIES[name]
    if options == "draft":  # a draft of the model itself: clean, so its proposals are the model's own
        options = dict(speculative=Draft(*_decoder(), k=3))
    if options == "nan-draft":  # a NaN draft: it proposes token 0 always, the id argmax names in NaN logits
        options = dict(speculative=Draft(_decoder()[0], _all_nan(_decoder()[1]), k=3))
    return build, {"max_new_tokens": NEW, **options}


def _prompt(name: str) -> np.ndarray:
    """The batch a strategy decodes; "ragged": row 1 holds 2 real tokens, its filler (ignored) the bad one."""
    return np.array([PROMPT[0], [5, 6, BAD, BAD]], np.int32) if name == "ragged" else PROMPT


def _failure(call) -> NonFiniteLogitsError:
    with pytest.raises(NonFiniteLogitsError) as error:
        call()
    return error.value


def _streamed(build, params, prompt, options) -> np.ndarray:
    return np.stack(list(stream(build()[0], params, prompt, **options)), axis=1)  # [batch, steps]


def _clean(name: str, streamed: bool = False, prompt=None) -> np.ndarray:
    """A strategy's tokens over the clean parameters (generate's output, or stream's
    steps), from `prompt` (default: the strategy's `_prompt`)."""
    build, options = _options(name)
    model, params = build()
    prompt = _prompt(name) if prompt is None else prompt
    if streamed:
        return _streamed(build, params, prompt, options)
    return np.asarray(generate(model, params, prompt, **options))


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", STRATEGIES)
def test_nan_parameters_stop_every_row_at_its_first_token(name):
    """Every parameter NaN (a diverged checkpoint): no row gets a token, where argmax
    would have given token 0 to every row, silently."""
    build, options = _options(name)
    model, params = build()
    error = _failure(lambda: generate(model, _all_nan(params), _prompt(name), **options))
    assert isinstance(error, ValueError) and (error.rows, error.steps) == ([0, 1], [0, 0])
    new = error.tokens[:, -NEW:]
    np.testing.assert_array_equal(new, PAD)  # nothing made; NO_TOKEN is never handed out
    np.testing.assert_array_equal(error.tokens[:, :-NEW], _clean(name)[:, :-NEW])  # the (decoder's) prompt as given
    assert "row 0 at new token 0, row 1 at new token 0: the logits held NaN or inf" in str(error)
    assert "diverged or damaged checkpoint" in str(error) and "out of range" in str(error)


@pytest.mark.parametrize("name", ["greedy", "beams", "lookup", "vanilla-greedy"])
def test_an_inf_in_the_head_stops_too(name):
    """+inf logits are refused as NaN ones are (argmax would pick the infinite one)."""
    build, options = _options(name)
    model, params = build()
    error = _failure(lambda: generate(model, _inf_in_head(build, params), _prompt(name), **options))
    assert error.steps == [0] * len(error.rows) and error.rows


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_bad_row_stops_alone_and_the_others_are_exact(name):
    """Only row 0 reads the NaN embedding (the bad token is in its prompt, or its source):
    it stops at its first token; row 1 is what the clean run gives it, bit for bit."""
    build, options = _options(name)
    model, params = build()
    table = "src_embed" if build is _vanilla else "embed"
    error = _failure(lambda: generate(model, _with(params, table, BAD), _prompt(name), **options))
    assert (error.rows, error.steps) == ([0], [0])
    clean = _clean(name)
    np.testing.assert_array_equal(error.tokens[1], clean[1])
    np.testing.assert_array_equal(error.tokens[0, -NEW:], PAD)


@pytest.mark.parametrize("name", STREAMED)
def test_stream_raises_at_the_bad_step_with_the_steps_before(name):
    build, options = _options(name)
    _, params = build()
    table = "src_embed" if build is _vanilla else "embed"
    error = _failure(lambda: _streamed(build, _with(params, table, BAD), _prompt(name), options))
    assert (error.rows, error.steps) == ([0], [0])
    assert error.tokens.shape == (2, 1)  # the step it stopped at, the other row's token included
    np.testing.assert_array_equal(error.tokens[:, 0], [PAD, _clean(name, streamed=True)[1, 0]])


def _emitted_mid_run(clean_new: np.ndarray, prompt: np.ndarray) -> tuple[int, int]:
    """A token row 0 emits first at step j (with j + 1 < NEW) that neither row's decoder
    prompt holds and row 1 never emits: `(token, j)`. Made NaN, it stops row 0 at step
    j + 1 and leaves row 1 alone."""
    for j, token in enumerate(clean_new[0, :NEW - 1].tolist()):
        unseen = token not in prompt[0] and token not in clean_new[0, :j]
        if j >= 1 and unseen and token not in prompt[1] and token not in clean_new[1]:
            return token, j
    raise AssertionError(f"no token to poison in {clean_new.tolist()}")


@pytest.mark.parametrize("name", ["greedy", "sampled", "lookup", "draft", "nan-draft", "vanilla-greedy"])
@pytest.mark.parametrize("streamed", [False, True], ids=["generate", "stream"])
def test_a_row_stops_the_step_after_it_emits_the_bad_token(name, streamed):
    """Mid-run: row 0's logits turn NaN the step after it emits the poisoned token (for
    speculative decoding: inside a round, where the verification picks; the NaN draft's
    proposals, 0, are what argmax names in NaN logits, and must not be accepted). The
    tokens before are the clean run's, as are all of row 1's.

    A draft may propose the token before row 0 emits it: the round's pass then reads it,
    and its NaN keys and values reach every position of the round's window (a masked
    weight of 0 times NaN is NaN), so the row stops at that round's first token."""
    build, options = _options(name)
    model, params = build()
    clean_new = _clean(name, streamed, MID_RUN_PROMPT)[:, -NEW:]
    token, j = _emitted_mid_run(clean_new, _clean(name, prompt=MID_RUN_PROMPT)[:, :-NEW])  # (encoder-decoder: BOS)
    bad = _with(params, _embedding(build), token)
    if streamed:
        error = _failure(lambda: _streamed(build, bad, MID_RUN_PROMPT, options))
    else:
        error = _failure(lambda: generate(model, bad, MID_RUN_PROMPT, **options))
    (step,) = error.steps
    assert error.rows == [0] and (1 <= step <= j + 1 if name == "draft" else step == j + 1)
    made = error.tokens[:, -NEW:] if not streamed else error.tokens
    assert made.shape[1] == (NEW if not streamed else step + 1)  # stream: up to the step it stopped at
    np.testing.assert_array_equal(made[0, :step], clean_new[0, :step])
    np.testing.assert_array_equal(made[0, step:], PAD)
    np.testing.assert_array_equal(made[1], clean_new[1, :made.shape[1]])


def test_a_nan_draft_only_costs_its_proposals():
    """A draft whose parameters are NaN proposes nonsense, which the model rejects: the
    tokens stay plain greedy decoding's, and nothing is raised (the model's logits are fine)."""
    np.testing.assert_array_equal(_clean("nan-draft"), _clean("greedy"))
    np.testing.assert_array_equal(_clean("nan-draft", streamed=True), _clean("greedy")[:, -NEW:])


def test_a_bad_run_reuses_the_clean_runs_programs():
    """The check is part of each compiled loop: a NaN run compiles nothing new."""
    model, params = _decoder()
    _clean("greedy"), _clean("beams"), _clean("lookup"), _clean("greedy", streamed=True)
    bad = _all_nan(params)
    with count_compiles() as compiles:
        for name in ("greedy", "sampled", "beams", "lookup"):
            _failure(lambda name=name: generate(model, bad, PROMPT, **_options(name)[1]))
        _failure(lambda: _streamed(_decoder, bad, PROMPT, {"max_new_tokens": NEW}))
    assert compiles == []


# ---------------------------------------------------------------------------------------
# The generation command
# ---------------------------------------------------------------------------------------

CORPUS = "\n".join(["the cat sat on the mat, and the dog sat on the log."] * 20)
PROMPTS = ["the cat sat", "the dog sat"]  # the second holds " dog", which nothing else holds


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """`(clean, poisoned)` checkpoint folders of one model: in the second, the embedding of
    the token " dog" is NaN, so only prompts holding it fail."""
    bpe = train_bpe([CORPUS], 280)
    config = DecoderConfig(vocab_size=bpe.vocab_size, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=32,
                           tie_embeddings=False)
    shapes = jax.eval_shape(Decoder(config).init, jax.random.key(0), *Decoder(config).init_inputs())["params"]
    params = _large(jax.tree.map(lambda x: np.ones(x.shape, np.float32), shapes), seed=4)  # norm weights 1
    ids = [bpe.encode(p) for p in PROMPTS]
    (dog,) = set(ids[1]) - set(ids[0])
    paths = []
    for name, weights in (("clean", params), ("poisoned", _with(params, "embed", dog))):
        path = str(tmp_path_factory.mktemp(name))
        save_hf(config, weights, path, bos_id=bpe.bos_id, eos_id=bpe.eos_id, pad_id=bpe.pad_id)
        save_tokenizer(bpe, path)
        paths.append(path)
    return paths


def _run(argv) -> tuple[int, str, list[str]]:
    """`(exit status, stdout, stderr lines)` of the command run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stderr", err)
        try:
            status = cli.main(argv, stdin=io.StringIO(""), stdout=out)
        except SystemExit as e:
            status = e.code
    return status, out.getvalue(), err.getvalue().splitlines()


def _argv(folder, *flags):
    return ["--checkpoint", folder, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-new-tokens", "8", *flags]


def test_cli_json_marks_the_failed_row_and_keeps_the_other(folders):
    clean, poisoned = folders
    status, out, _ = _run(_argv(clean, "--json"))
    assert status == 0
    want = [json.loads(line) for line in out.splitlines()]
    status, out, err = _run(_argv(poisoned, "--json"))
    assert status == 1, err  # every row printed; the status says one failed
    good, bad = (json.loads(line) for line in out.splitlines())
    assert good == want[0]  # the other row as before
    assert bad["finish_reason"] == "error" and (bad["completion"], bad["token_ids"]) == ("", [])
    assert re.match(r"new token 0: the logits held NaN or inf, .*diverged or damaged checkpoint", bad["error"])
    assert want[1]["finish_reason"] == "length" and "error" not in want[1]  # a clean row has no error field


@pytest.mark.parametrize("flags", [[], ["--stream"]], ids=["plain", "stream"])
def test_cli_plain_output_stops_at_the_failed_prompt_with_one_line(folders, flags):
    """Plain and --stream: the completions before the failed prompt stay printed, then one
    stderr line naming it, exit status 1, no traceback."""
    clean, poisoned = folders
    _, want, _ = _run(_argv(clean))
    status, out, err = _run(_argv(poisoned, *flags))
    assert status == 1 and out == want.splitlines(keepends=True)[0] + "\n"  # prompt 1 whole; prompt 2 had nothing
    assert len(err) == 1, err
    assert err[0].startswith(f"{cli.PROG}: error: prompt 2 ('the dog sat'): new token 0: the logits held NaN or inf")


def test_completion_cuts_a_row_at_no_token():
    """What the command makes of a row marked mid-run: the tokens before, their text, the error."""
    bpe = train_bpe([CORPUS], 280)
    prompt_ids = bpe.encode(PROMPTS[0])
    row = bpe.encode(" on the", add_special_tokens=False)
    c = cli.completion(bpe, PROMPTS[0], prompt_ids, [*row, NO_TOKEN, PAD, PAD])
    assert (c.ids, c.text, c.finish_reason) == (row, " on the", "error")
    assert c.as_json()["error"].startswith(f"new token {len(row)}: the logits held NaN or inf")


# ---------------------------------------------------------------------------------------
# The report page
# ---------------------------------------------------------------------------------------

GREY = [190, 190, 190]


def _nonfinite_run(run_dir, settings=None):
    """A run's files holding NaN and inf: the loss NaN at step 4 and inf at step 8, the
    rate inf at 8; the evaluation's loss NaN, a rate NaN; a snapshot with NaN and inf weights."""
    run_dir.mkdir()
    program = "python -m train.reverse" if settings else "python -m train.demo"
    (run_dir / "config.json").write_text(json.dumps({"model": {"n_layer": 1}, "seed": 0}))
    record_session(run_dir, program, settings or {"steps": 10}, 123, [], 0, "cpu")
    losses = [(2, 3.0), (4, math.nan), (6, 2.0), (8, math.inf), (10, 1.5)]
    with open(run_dir / "metrics.jsonl", "w") as f:  # as MetricsLog writes them: json's NaN, Infinity
        for step, loss in losses:
            rate = math.inf if step == 8 else 100.0
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-3, "steps_per_sec": rate}) + "\n")
    heads = np.full((1, 2, 2), 0.5)
    heads[0, 0, 1], heads[0, 1, 0] = math.nan, math.inf
    record_snapshot(run_dir, 0, [attention_group("self-attention", 0, heads, ["a", "b"], ["a", "b"])])
    (run_dir / "eval.json").write_text(json.dumps({"steps": 10, "final_loss": math.nan, "exact_match": 0.5,
                                                   "per_length": {"5": [math.nan, 0], "6": [1.0, 4]}}))
    return run_dir


class _Chart(HTMLParser):
    """The loss chart's polylines (point counts), gap marks and y tick labels."""

    def __init__(self, text):
        super().__init__()
        self.lines, self.gaps, self.ticks, self._tick, self._in_loss = [], [], [], False, False
        self.feed(text[text.index('aria-label="training loss'):text.index("</figure>")])

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "polyline":
            self.lines.append(len(attrs["points"].split()))
        if tag == "line" and attrs.get("class") == "nonfinite":
            self.gaps.append(float(attrs["x1"]))
        self._tick = tag == "text" and attrs.get("class") == "tick" and attrs.get("text-anchor") == "end"

    def handle_data(self, data):
        if self._tick:
            self.ticks.append(data)
            self._tick = False


def test_report_draws_nonfinite_values_as_gaps_and_grey(tmp_path):
    run_dir = _nonfinite_run(tmp_path / "run")
    text = write_report(run_dir).read_text()
    page = check_report(run_dir)  # every figure against its file: "nan" and "inf" where they are
    shown = dict(page.figures)
    assert shown["metrics/4/loss"] == "nan" and shown["metrics/8/loss"] == "inf" and shown["eval/final_loss"] == "nan"
    assert shown["eval/per_length/5/rate"] == "nan"  # a rate that is not a number has no "%"
    chart = _Chart(text)
    assert chart.lines == [1, 1, 1]  # the line broken at steps 4 and 8
    assert len(chart.gaps) == 2 and "dotted grey: a value that was NaN or inf" in text
    ticks = [float(t) for t in chart.ticks]
    assert all(map(math.isfinite, ticks)) and 1.5 <= ticks[0] and ticks[-1] <= 3.0  # the finite values span the axis
    pixels = decode_png(page.images[0])  # one pixel a cell: NaN and inf cells are grey, the others viridis
    np.testing.assert_array_equal(pixels[0, 1], GREY)
    np.testing.assert_array_equal(pixels[1, 0], GREY)
    np.testing.assert_array_equal(pixels[0, 0], colormap([[0.5]])[0, 0])
    assert "grey: NaN or inf" in text


def test_colormap_draws_nonfinite_weights_grey():
    got = colormap([[math.nan, math.inf, -math.inf, 0.0, 1.0]])[0]
    np.testing.assert_array_equal(got[:3], [GREY] * 3)
    np.testing.assert_array_equal(got[3:], [[68, 1, 84], [253, 231, 37]])


def test_train_report_rebuilds_a_run_that_diverged(tmp_path, capsys):
    """`jaxformer-report` on such a run, with a checkpoint whose parameters are all
    NaN and no snapshot: it snapshots it (every attention weight NaN) on the page."""
    from jaxformer.commands import report
    from train import reverse

    settings = reverse.Settings(steps=10, batch_size=4, n_layer=1, d_model=16, d_ff=16, n_head=2, eval_size=4)
    run_dir = _nonfinite_run(tmp_path / "run", dataclasses.asdict(settings))
    setup = reverse.build(settings)
    state = TrainState.create(_all_nan(setup.params), setup.optimizer)
    with Checkpointer(run_dir) as checkpoints:
        checkpoints.save(state.replace(step=jnp.int32(10)))
        checkpoints.wait()
    assert report.main([str(run_dir)]) == 0
    assert "snapshots of checkpoints 10 added to the page" in capsys.readouterr().out
    demo, recorded = report.demo_of(run_dir)
    computed = report.snapshot_checkpoints(run_dir, demo, recorded)
    assert [s["step"] for s in computed] == [10]
    page = check_report(run_dir, read_snapshots(run_dir) + computed)
    diverged = decode_png(page.images[-1])  # the checkpoint's last map: every cell grey
    np.testing.assert_array_equal(diverged.reshape(-1, 3), np.broadcast_to(GREY, (diverged.size // 3, 3)))
