"""`jaxformer-generate`: a Hugging Face checkpoint folder in, text out.

  jaxformer-generate --checkpoint DIR --prompt "The capital of France is"
  jaxformer-generate --checkpoint DIR --prompts-file prompts.txt --json
  echo "Tell me a story" | jaxformer-generate --checkpoint DIR --chat --stream

docs/text.md describes the flags, where prompts come from, how they are batched, and
what goes to stdout and stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import time
from typing import Iterator

import jax
import numpy as np

from jaxformer.command_line import (
    FAILED,
    OneLineParser,
    add_quantize_flags,
    check_quantization,
    exit_process,
    fail,
    loading_memory,
    quantization,
    quantized_formats,
    run_command,
)
from jaxformer.config import DTYPES
from jaxformer.convert import load_hf, load_hf_config, with_scan_layers
from jaxformer.convert.peft import load_peft
from jaxformer.decoder import Decoder
from jaxformer.decoding import (
    NO_TOKEN,
    Beam,
    DecodeOptions,
    DecodeRequest,
    NonFiniteLogitsError,
    PromptLookup,
    Speculative,
    finish,
    run,
    start,
    stream,
)
from jaxformer.decoding.front_door import choose
from jaxformer.decoding.request import FLAGS, check_prefill_memory
from jaxformer.lora import merge
from jaxformer.memory import format_bytes, free_bytes
from jaxformer.quantized import QArray, quantize_params
from jaxformer.runtime import enable_compilation_cache
from jaxformer.sharding import param_axes
from jaxformer.text.chat import render_chat
from jaxformer.text.streaming import TextStream, completion_text
from jaxformer.text.tokenizer import Tokenizer, check_fits_model, load_tokenizer
from jaxformer.validation import as_int, check_seed

PROG = "jaxformer-generate"
# The events in which JAX reports the time it spends tracing, lowering and compiling.
# The command's defaults where they differ from the library's (which has none for max_new_tokens).
CLI_DEFAULTS = {"max_new_tokens": 128}
FLAG_NAMES = {field.name: "--" + field.name.replace("_", "-") for field in FLAGS}  # top_k: --top-k
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def parse_args(argv=None):
    """The flags, each checked by the library's own rule; a bad one exits with one line."""
    p = OneLineParser(PROG, __doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a Hugging Face folder: config.json, model.safetensors (or shards), tokenizer.json")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt; repeat the flag for a batch")
    p.add_argument("--prompts-file", metavar="FILE", help="one prompt a line ('-': the lines of standard input)")
    for field in FLAGS:  # the decoding options, as `DecodeOptions` declares them
        default = CLI_DEFAULTS.get(field.name, field.default)
        p.add_argument(FLAG_NAMES[field.name], type=field.metadata["flag_type"], default=default,
                       help=field.metadata["help"])
    p.add_argument("--prompt-lookup", type=int, default=None, metavar="K",
                   help="speculative decoding: each pass of the model also checks K tokens proposed from the text "
                        "so far (prompt lookup); the same tokens as without, in fewer passes where the text repeats")
    p.add_argument("--prompt-lookup-ngram", type=int, default=None, metavar="N",
                   help=f"with --prompt-lookup: the longest n-gram looked up (default {PromptLookup.n})")
    p.add_argument("--adapter", metavar="DIR",
                   help="a peft LoRA adapter folder (adapter_config.json, adapter_model.safetensors), merged into "
                        "the checkpoint's weights before decoding")
    p.add_argument("--seed", type=int, default=0, help="the sampling's seed")
    p.add_argument("--dtype", default="float32", help=f"compute and weight dtype, one of {', '.join(DTYPES)}")
    add_quantize_flags(p)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="longest prompt + completion (default: the checkpoint's max_position_embeddings)")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the blocks as one scanned block: a deep model compiles in about the time of a "
                        "shallow one, while batch-1 decoding on a CPU is slower (docs/architecture.md)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message in the folder's chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object a prompt: prompt, completion, token ids and counts")
    args = p.parse_args(argv)
    try:
        _check(args)
        args.quantization = quantization(args)
    except ValueError as e:
        p.error(str(e))
    return args


def options(args) -> DecodeOptions:
    """The decoding options the flags give (the rest, from the tokenizer, added by `decode`)."""
    return DecodeOptions(**{field.name: getattr(args, field.name) for field in FLAGS})


def _check(args) -> None:
    options(args).check(names=FLAG_NAMES)  # top_k against the vocabulary once it is read (`load`)
    check_seed(args.seed, "--seed")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)} (got {args.dtype!r})")
    if args.max_seq_len is not None and args.max_seq_len < 1:
        raise ValueError(f"--max-seq-len must be >= 1 (got {args.max_seq_len})")
    if args.prompt_lookup is not None:
        as_int(args.prompt_lookup, "--prompt-lookup", minimum=1)
        if args.num_beams > 1:
            raise ValueError("--prompt-lookup proposes one continuation per row: it does not go with beam search "
                             "(--num-beams > 1)")
    if args.prompt_lookup_ngram is not None:
        if args.prompt_lookup is None:
            raise ValueError("--prompt-lookup-ngram needs --prompt-lookup")
        as_int(args.prompt_lookup_ngram, "--prompt-lookup-ngram", minimum=1)
    if args.stream and args.num_beams > 1:
        raise ValueError("--stream prints one token after another; beam search (--num-beams > 1) picks its "
                         "text at the end")
    if args.stream and args.json:
        raise ValueError("--stream and --json do not go together: --json prints each completion whole")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    if args.prompt is not None and args.prompts_file is not None:
        raise ValueError("give prompts by --prompt or by --prompts-file, not both")


def read_prompts(args, stdin=None) -> list[str]:
    """The prompts: every --prompt, the lines of --prompts-file, or all of standard input;
    `ValueError` for an empty prompt (naming which), an unreadable file, or none at all."""
    stdin = sys.stdin if stdin is None else stdin
    if args.prompt is not None:
        prompts, where = args.prompt, [f"--prompt {i + 1}" for i in range(len(args.prompt))]
    elif args.prompts_file is not None:
        prompts = _read_lines(args.prompts_file, stdin)
        where = [f"{args.prompts_file} line {i + 1}" for i in range(len(prompts))]
        if not prompts:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt")
    else:
        if stdin.isatty():
            raise ValueError("no prompt: give --prompt TEXT, --prompts-file FILE, or text on standard input")
        text = stdin.read()
        prompts, where = [text[:-1] if text.endswith("\n") else text], ["standard input"]
    for prompt, place in zip(prompts, where):
        if not prompt.strip():
            raise ValueError(f"{place} is an empty prompt")
    return prompts


def _read_lines(path: str, stdin) -> list[str]:
    if path == "-":
        return stdin.read().splitlines()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --prompts-file {path}: {e}") from None


def encode_prompts(tokenizer: Tokenizer, prompts: list[str], args) -> list[list[int]]:
    """Each prompt's ids: as the tokenizer frames a text (a BOS in front, for Llama's), or
    with --chat as a user message in the chat template (which writes its own BOS)."""
    if not args.chat:
        return [tokenizer.encode(prompt) for prompt in prompts]
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    try:
        texts = [render_chat(tokenizer, system + [{"role": "user", "content": p}]) for p in prompts]
    except ValueError as e:
        raise ValueError(f"--chat: {args.checkpoint}: {e}") from None
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def check_prompts(ids: list[list[int]], prompts: list[str], max_new_tokens: int, max_seq_len: int,
                  vocab_size: int) -> None:
    """Raises `ValueError`, naming the prompt and the limit, unless every prompt has ids the
    model knows and fits `max_seq_len` with its completion."""
    for n, (row, prompt) in enumerate(zip(ids, prompts), 1):
        name = prompt_name(n, prompt)
        if not row:
            raise ValueError(f"{name} encodes to no token")
        if max(row) >= vocab_size:
            raise ValueError(f"{name} holds token id {max(row)}, past the model's vocab_size {vocab_size}: "
                             "the tokenizer does not belong to this model")
        if len(row) + max_new_tokens > max_seq_len:
            raise ValueError(f"{name} is {len(row)} tokens: with --max-new-tokens {max_new_tokens} that passes "
                             f"max_seq_len {max_seq_len}")


def prompt_name(n: int, prompt: str) -> str:
    """Prompt `n` (from 1) as messages name it: its number and its first 30 characters."""
    return f"prompt {n} ({prompt[:30]!r}{'...' if len(prompt) > 30 else ''})"


@dataclasses.dataclass
class Clock:
    """Wall time split into compilation (as JAX reports it) and the rest."""

    compile: float = 0.0

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Counts the compilation JAX does in the block into `self.compile`."""
        def listener(event: str, duration: float, **_):
            if event in COMPILE_EVENTS:
                self.compile += duration

        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            yield
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)

    def run(self, fn):
        """`(fn(), seconds)`: its wall time less the compilation in it."""
        before, started = self.compile, time.perf_counter()
        with self.compiling():
            value = fn()
        return value, time.perf_counter() - started - (self.compile - before)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's result.

    Attributes:
      prompt: the prompt as given.
      prompt_ids: its ids, as the model read them (chat template included).
      ids: the new tokens, the stopping one included (an error: the tokens before it).
      text: the text of the new tokens before the stopping one.
      finish_reason: "stop" (an EOS id), "length" (--max-new-tokens) or "error" (no
        token could be picked: the logits held NaN or inf).
      error: for "error", what happened, where and what it means; else None.
    """

    prompt: str
    prompt_ids: list[int]
    ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None

    def as_json(self) -> dict:
        record = {"prompt": self.prompt, "completion": self.text, "prompt_tokens": len(self.prompt_ids),
                  "completion_tokens": len(self.ids), "token_ids": self.ids, "finish_reason": self.finish_reason}
        return record if self.error is None else {**record, "error": self.error}


def completion(tokenizer: Tokenizer, prompt: str, prompt_ids: list[int], row: list[int]) -> Completion:
    """A row of new tokens cut at its first stop id or `NO_TOKEN` (`pad_id` follows either),
    as a `Completion`."""
    stops = [i for i, token in enumerate(row) if token in tokenizer.stop_ids or token == NO_TOKEN]
    if stops and row[stops[0]] == NO_TOKEN:  # the row's logits held NaN or inf there
        ids = row[:stops[0]]
        return Completion(prompt, prompt_ids, ids, completion_text(tokenizer, prompt_ids, ids), "error",
                          f"new token {stops[0]}: {NonFiniteLogitsError.CAUSE}")
    ids = row[:stops[0] + 1] if stops else row
    text = completion_text(tokenizer, prompt_ids, ids[:-1] if stops else ids)
    return Completion(prompt, prompt_ids, ids, text, "stop" if stops else "length")


def stop_at_error(n: int, c: Completion) -> None:
    """Ends the command's plain output at prompt `n`'s completion if it failed: one line
    on stderr naming the prompt and what happened, exit status 1."""
    if c.finish_reason == "error":
        fail(PROG, f"{prompt_name(n, c.prompt)}: {c.error}", FAILED)


class Printer:
    """Prints one row's text as its tokens arrive (a `stream` step at a time), up to its stop id."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], out):
        self._tokenizer, self._out = tokenizer, out
        self._text = TextStream(tokenizer, prompt_ids)
        self._stopped = False

    def __call__(self, token: np.ndarray) -> None:
        token = int(token[0])
        self._stopped = self._stopped or token in self._tokenizer.stop_ids
        if not self._stopped:
            self._out.write(self._text.push([token]))
            self._out.flush()

    def close(self) -> None:
        self._out.write(self._text.finish() + "\n")
        self._out.flush()


@dataclasses.dataclass
class Stats:
    """What stderr reports, summed over the batches decoded."""

    prompt_tokens: int = 0
    new_tokens: int = 0  # up to each row's stop id
    prefill_seconds: float = 0.0  # the prefill and each row's first token
    decode_seconds: float = 0.0  # the steps after it (beam search: everything)
    # --prompt-lookup without --stream, over the rows still unfinished (speculative.Stats):
    # proposals made and accepted, passes of the model summed over rows, and tokens kept.
    proposed: int = 0
    accepted: int = 0
    row_passes: int = 0
    kept: int = 0
    lookup_k: int = 0  # the proposals a round made: --prompt-lookup, or fewer where max_seq_len had less room
    lookup_off: bool = False  # `plan` chose plain decoding: no room for even one proposal


def _ragged(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray | None]:
    """Prompts as a right-padded batch, and their lengths (None when all are alike)."""
    lengths = np.array([len(row) for row in ids], np.int32)
    batch = np.zeros((len(ids), lengths.max()), np.int32)
    for row, prompt in zip(batch, ids):
        row[:len(prompt)] = prompt
    return batch, (lengths if lengths.min() < lengths.max() else None)


def decode(model: Decoder, params, tokenizer: Tokenizer, prompts: list[str], ids: list[list[int]], args,
           clock: Clock, stats: Stats, on_token=None) -> list[Completion]:
    """Decodes the prompts as one batch: the prefill, then the steps, each timed; with
    --prompt-lookup, the steps are speculative rounds (`stats` counts their proposals).

    Args:
      on_token: called with each step's tokens (`[batch]`); the run then goes through
        `stream`. Without it, `start` and `finish` run it as two programs (beam search: `run`).

    Returns:
      One `Completion` a prompt, finish_reason "error" for a row whose logits were not finite.
    """
    batch, lengths = _ragged(ids)
    run_options = dataclasses.replace(options(args), key=jax.random.key(args.seed),
                                      eos_id=list(tokenizer.stop_ids) or None, pad_id=tokenizer.pad_id,
                                      prompt_lengths=lengths).keywords()
    if args.num_beams > 1:  # one program: its prefill is not timed apart
        request = DecodeRequest.create(model, batch, **run_options)
        out, seconds = clock.run(lambda: np.asarray(run(model, params, request, Beam())[0]))
        rows = out[:, batch.shape[1]:]  # NO_TOKEN where a row's logits held NaN or inf, as finish marks it
    elif on_token is None:
        request = DecodeRequest.create(model, batch, **run_options)
        strategy = choose(model, request, lookup(args))
        state, prefill = clock.run(lambda: jax.block_until_ready(start(model, params, request, strategy=strategy)))
        (rows, figures), seconds = clock.run(lambda: jax.device_get(finish(model, params, request, state, strategy)))
        stats.prefill_seconds += prefill
        count_lookup(stats, args, strategy, figures)
    else:
        steps, tokens = stream(model, params, batch, speculative=lookup(args), **run_options), []

        def take(token: np.ndarray) -> None:
            tokens.append(token)
            on_token(token)

        prefill = seconds = 0.0  # (a run stopped by an error keeps the time of the part that finished)
        try:
            _, prefill = clock.run(lambda: take(next(steps)))
            _, seconds = clock.run(lambda: [take(token) for token in steps])
            rows = np.stack(tokens, axis=1)
        except NonFiniteLogitsError as e:  # the batch stopped at a row whose logits held NaN or inf
            rows = e.tokens
            rows[e.rows, e.steps] = NO_TOKEN  # where each such row stopped, as finish marks it
        stats.prefill_seconds += prefill
    stats.decode_seconds += seconds
    completions = [completion(tokenizer, prompt, row_ids, row) for prompt, row_ids, row in
                   zip(prompts, ids, rows.tolist())]
    stats.prompt_tokens += sum(len(row) for row in ids)
    stats.new_tokens += sum(len(c.ids) for c in completions)
    return completions


def lookup(args) -> PromptLookup | None:
    """The speculative decoding --prompt-lookup asks for, or None."""
    if args.prompt_lookup is None:
        return None
    return PromptLookup(k=args.prompt_lookup, n=PromptLookup.n if args.prompt_lookup_ngram is None
                        else args.prompt_lookup_ngram)


def count_lookup(stats: Stats, args, strategy, figures) -> None:
    """Adds a batch's prompt lookup figures (`speculative.Stats`) to `stats`; notes a batch that
    `plan` left without room for a proposal (it decoded plainly, the same tokens)."""
    if args.prompt_lookup is None:
        return
    if not isinstance(strategy, Speculative):
        stats.lookup_off = True
        return
    _, proposed, accepted, row_passes, kept = (int(x) for x in figures)
    stats.lookup_k = strategy.proposer.k
    stats.proposed += proposed
    stats.accepted += accepted
    stats.row_passes += row_passes
    stats.kept += kept


def load(args, prompts: list[str]):
    """The tokenizer, the prompts' ids, the model and its parameters, every limit checked
    (`FileNotFoundError`, `ValueError` naming the file, prompt or flag)."""
    tokenizer = load_tokenizer(args.checkpoint)
    ids = encode_prompts(tokenizer, prompts, args)
    # The adapter and --quantize-group are checked first, against config.json. An adapter is
    # merged into the per-layer float tree, which is then stacked and, with --quantize, quantized:
    # its update `alpha / r * A @ B` is added to float matrices, and the merged matrix is rounded
    # once, as a merged checkpoint loaded with --quantize is.
    how, hf_config = args.quantization, load_hf_config(args.checkpoint)
    check_quantization(hf_config, how)
    adapter = None if args.adapter is None else load_peft(hf_config, args.adapter)
    with loading_memory():
        config, params = load_hf(args.checkpoint, max_seq_len=args.max_seq_len, dtype=DTYPES[args.dtype],
                                 scan_layers=args.scan_layers and adapter is None,
                                 quantize=how if adapter is None else None)
    if adapter is not None:
        params = merge(params, *adapter)
        if args.scan_layers:
            config, params = with_scan_layers(config, params, True)
        if how is not None:
            params = quantize_params(params, param_axes(Decoder(config)), how)
    check_prompts(ids, prompts, args.max_new_tokens, config.max_seq_len, config.vocab_size)
    options(args).check(config.vocab_size, names=FLAG_NAMES)
    check_fits_model(tokenizer, config.vocab_size, args.checkpoint)
    model = Decoder(config)
    check_memory(model, ids, args)
    return tokenizer, ids, model, params


def check_memory(model: Decoder, ids: list[list[int]], args) -> None:
    """Refuses, before anything is compiled or printed, a run whose largest prefill does not fit
    the free memory: all prompts as one batch (with their beams), or with --stream the longest alone."""
    prompt_len = max(len(row) for row in ids)  # a batch is padded to its longest prompt
    rows = 1 if args.stream else len(ids) * args.num_beams
    extra = args.prompt_lookup or 0  # a speculative round writes its proposals past what it keeps
    check_prefill_memory(model.decoding_spec(), rows, prompt_len, prompt_len + args.max_new_tokens - 1 + extra)


def report(args, config, params, stats: Stats, clock: Clock, load_seconds: float, rows: int, cache_dir) -> None:
    """Load, compile, prefill and decode times on stderr."""
    def say(line):
        print(line, file=sys.stderr)

    def plural(n: int, noun: str) -> str:
        return f"{n:,} {noun}{'s' * (n != 1)}"

    weights = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))  # (a quantized matrix is one)
    quantized = quantized_formats(params)  # (--quantize's, or as the checkpoint ships them)
    quantized = f", {quantized}" if quantized else ""
    say(f"loaded {args.checkpoint} in {load_seconds:.2f} s: {plural(config.n_layer, 'layer')} x {config.d_model}, "
        f"vocab {config.vocab_size:,}, {plural(sum(math.prod(x.shape) for x in weights), 'parameter')}, "
        f"{args.dtype}{quantized}")
    say(f"compile: {clock.compile:.2f} s (tracing and XLA; a repeated run loads the programs from {cache_dir})")
    prompts = f"{plural(stats.prompt_tokens, 'token')} of {plural(rows, 'prompt')}"
    if args.num_beams > 1:
        say(f"beam search ({args.num_beams} beams), {prompts}: {plural(stats.new_tokens, 'new token')} in "
            f"{stats.decode_seconds:.3f} s, prefill included ({stats.new_tokens / stats.decode_seconds:.1f} tokens/s)")
        return
    say(f"prefill: {prompts} in {stats.prefill_seconds:.3f} s ({stats.prompt_tokens / stats.prefill_seconds:.0f} "
        "tokens/s), each prompt's first new token included")
    stepped = stats.new_tokens - rows
    say(f"decode: {plural(stepped, 'token')} in {stats.decode_seconds:.3f} s "
        f"({stepped / stats.decode_seconds if stats.decode_seconds else 0:.1f} tokens/s)")
    if args.prompt_lookup is not None:
        say(lookup_line(args, stats))


def lookup_line(args, stats: Stats) -> str:
    """What --prompt-lookup did: its acceptance, and the new tokens each pass of the model made a row."""
    proposer = lookup(args)
    head = f"prompt lookup (k={proposer.k}, n={proposer.n})"
    if args.stream:  # `stream` hands out tokens, not the strategy's figures
        return f"{head}: --stream counts no acceptance"
    if stats.lookup_off:
        why = ("--max-new-tokens 1 leaves nothing to propose" if args.max_new_tokens == 1 else
               "the prompts and --max-new-tokens leave no room for a proposal within max_seq_len")
        return f"{head}: not used, {why}"
    if stats.lookup_k < proposer.k:
        head += f", k cut to {stats.lookup_k} to fit max_seq_len"
    if not stats.row_passes:
        return f"{head}: every row ended at its first token, before any proposal"
    return (f"{head}: {stats.accepted:,} of {stats.proposed:,} proposed tokens accepted "
            f"({stats.accepted / stats.proposed:.0%}), {stats.kept / stats.row_passes:.2f} new tokens a row "
            "per pass of the model after the prefill")


@contextlib.contextmanager
def out_of_memory_in_one_line() -> Iterator[None]:
    """Ends the command in one line (status 1) when an allocation fails: XLA's
    RESOURCE_EXHAUSTED or Python's MemoryError, naming what is free and where. `check_memory`
    refuses a prefill its estimate says cannot fit; this is for the rest, the work it does
    not count and the estimate's own margin."""
    try:
        yield
    except (MemoryError, jax.errors.JaxRuntimeError) as e:
        if isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" not in str(e):
            raise  # a bug, not the size: its traceback is the report
        what = str(e).partition("\n")[0].rstrip(".") or type(e).__name__
        free = free_bytes()
        room = "" if free is None else f" ({format_bytes(free[0])} free on {free[1]})"
        fail(PROG, f"out of memory: {what}{room}: a shorter prompt, fewer prompts at once or --dtype bfloat16 "
                   "needs less", FAILED)


def main(argv=None, stdin=None, stdout=None) -> int:
    return run_command(PROG, lambda: _main(argv, stdin, stdout))


def _main(argv, stdin, stdout) -> int:
    args = parse_args(argv)
    stdout = sys.stdout if stdout is None else stdout
    if stdout is None:  # started with its standard output closed (`>&-`): Python gives None
        fail(PROG, "standard output is closed: there is nowhere to write the completions")
    cache_dir = enable_compilation_cache()
    with out_of_memory_in_one_line():  # what the estimates before the work missed
        started = time.perf_counter()
        try:
            prompts = read_prompts(args, stdin)
            tokenizer, ids, model, params = load(args, prompts)
        except (OSError, ValueError) as e:
            fail(PROG, str(e))
        load_seconds, clock, stats = time.perf_counter() - started, Clock(), Stats()
        failed = False
        if args.stream:  # one prompt after another, each printed as it comes
            for n, (prompt, row) in enumerate(zip(prompts, ids), 1):
                printer = Printer(tokenizer, row, stdout)
                [c] = decode(model, params, tokenizer, [prompt], [row], args, clock, stats, on_token=printer)
                printer.close()
                stop_at_error(n, c)
        else:
            for n, c in enumerate(decode(model, params, tokenizer, prompts, ids, args, clock, stats), 1):
                print(json.dumps(c.as_json(), ensure_ascii=False) if args.json else c.text, file=stdout)
                if not args.json:  # (--json reports it in the row, "finish_reason": "error", and goes on)
                    stop_at_error(n, c)
                failed |= c.finish_reason == "error"
    report(args, model.config, params, stats, clock, load_seconds, len(prompts), cache_dir)
    return FAILED if failed else 0


if __name__ == "__main__":
    exit_process(main())
