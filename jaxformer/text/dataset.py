"""Fine-tuning data in a checkpoint's own tokens: next-token windows of a text, or chat and
prompt/completion records whose loss falls on the answer alone.

A file ending in `.jsonl` holds one JSON record a line, either `{"messages": [{"role",
"content"}, ...]}` (rendered by the tokenizer's chat template; the assistant turns are
scored) or `{"prompt": str, "completion": str}` (the plain concatenation, BOS first where
the tokenizer frames text with one and EOS after the completion; the completion and its EOS
are scored). Each record is one row, padded at its end to the window (padding: each row
holds one example, so no example attends to another, and the loss is the mean over the
scored tokens of the batch, as transformers' labels of -100 give). Any other file is UTF-8
text: it is one stream of ids and each row a random window of it (packing: no padding).

The last 10 % (at least one record, or the text's last 10 % of characters) is held out for
validation.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.files import read_text
from jaxformer.text.chat import render_chat
from jaxformer.text.tokenizer import Tokenizer

IGNORE = -100  # the target of a position that carries no loss (transformers' label)
HELD_OUT = 0.1  # of the records, or of the text's characters


@dataclasses.dataclass(frozen=True)
class Example:
    """One record's ids and which of them the loss is on.

    Attributes:
      ids: the token ids, as the model reads them.
      scored: one bool per id, True where predicting that id counts in the loss.
      line: the line of the JSONL file it came from, or None.
    """

    ids: list[int]
    scored: list[bool]
    line: int | None = None

    def first_scored(self) -> int | None:
        """The index of the first id the loss is on (never 0: the first id is never predicted),
        which is the `seq_len` a row needs to score anything of this example; None if none."""
        return next((i for i, scored in enumerate(self.scored) if scored and i > 0), None)


def _scored_spans(tokenizer: Tokenizer, text: str, spans: list[tuple[int, int]],
                  add_special_tokens: bool) -> Example:
    """`text` tokenized once (so every merge is as the model sees it), a token scored when
    it starts inside one of the character `spans` `[start, end)` (never a BOS the
    tokenizer adds, whose offset is 0 too)."""
    encoding = tokenizer.backend.encode(text, add_special_tokens=add_special_tokens)
    scored = [not added and any(start <= begin < end for start, end in spans)
              for (begin, _), added in zip(encoding.offsets, encoding.special_tokens_mask)]
    return Example(ids=list(encoding.ids), scored=scored)


def chat_example(tokenizer: Tokenizer, messages: list[dict]) -> Example:
    """A conversation rendered by the tokenizer's chat template, its assistant turns scored.

    An assistant turn is the text the template adds for it: what `render_chat(messages[:i +
    1])` holds past `render_chat(messages[:i], add_generation_prompt=True)`, i.e. its content
    and the template's end-of-turn marker, not the header that announces it (the prompt
    ends with that header at inference, so the model never predicts it).

    Raises:
      ValueError: no chat template, no assistant turn, or a template whose rendering of a
        conversation does not begin with its rendering of the conversation's start (the
        turns could not be found in the text).
    """
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError("a messages record needs at least one assistant turn (the loss is on those)")
    text = render_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = render_chat(tokenizer, messages[:i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(f"the chat template does not render turn {i} as a continuation of the turns before "
                             "it: its assistant tokens cannot be told from the rest")
        spans.append((len(before), len(through)))
    return _scored_spans(tokenizer, text, spans, add_special_tokens=False)  # the template writes its own BOS


def completion_example(tokenizer: Tokenizer, prompt: str, completion: str) -> Example:
    """`prompt + completion` and EOS, the completion and EOS scored."""
    example = _scored_spans(tokenizer, prompt + completion, [(len(prompt), len(prompt) + len(completion))],
                            add_special_tokens=True)
    if tokenizer.eos_id is None:
        return example
    return Example(ids=example.ids + [tokenizer.eos_id], scored=example.scored + [True])


def read_records(path: str, tokenizer: Tokenizer) -> list[Example]:
    """The examples of a JSONL file of `messages` or `prompt`+`completion` records, each
    `Example` holding its line number.

    Raises:
      ValueError: naming the file and line: not UTF-8, not JSON, or a record of neither
        kind (whatever JSON it holds instead), or a message that is not a `{"role": str,
        "content": str}` object.
    """
    examples = [dataclasses.replace(example, line=n) for n, example in jsonl_records(path, record_example, tokenizer)]
    if len(examples) < 2:
        raise ValueError(f"{path} holds {len(examples)} record(s): at least 2 are needed (one to train, "
                         "one to validate)")
    return examples


def jsonl_records(path: str, read, *args) -> list[tuple[int, object]]:
    """`(line, read(*args, record))` for each record of the JSONL file `path` (blank lines skipped).

    Raises:
      ValueError: `cannot read --data path` (an unreadable file), or `path:line: why`: not UTF-8,
        not JSON, or what `read` raised for it.
    """
    out = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"cannot read --data {path}: {e.strerror or e}") from None
    with f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})") \
                    from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # (an integer of thousands of digits too)
                raise ValueError(f"{where}: not JSON ({getattr(e, 'msg', e)})") from None
            except RecursionError:
                raise ValueError(f"{where}: its JSON nests too deeply to read") from None
            try:
                out.append((n, read(*args, record)))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    return out


def record_example(tokenizer: Tokenizer, record) -> Example:
    """The `Example` of one parsed JSONL record; a `ValueError` saying what the record holds
    instead of `{"messages": [...]}` or `{"prompt": str, "completion": str}`."""
    kinds = '{"messages": [{"role": str, "content": str}, ...]} or {"prompt": str, "completion": str}'
    if not isinstance(record, dict):
        raise ValueError(f"a record is {kinds} (got {json_kind(record)})")
    if "messages" in record:
        return chat_example(tokenizer, checked_messages(record["messages"], "messages"))
    for key in ("prompt", "completion"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"a record is {kinds} ({key}: got {json_kind(record.get(key))})")
    return completion_example(tokenizer, record["prompt"], record["completion"])


def checked_messages(messages, key: str) -> list[dict]:
    """`messages`, the value of a record's `key`, if it is a list of `{"role": str, "content": str}`
    objects; else a `ValueError` naming the first that is not (`messages[2].content must be ...`)."""
    if not isinstance(messages, list):
        raise ValueError(f"{key} must be a list of {{\"role\": str, \"content\": str}} objects "
                         f"(got {json_kind(messages)})")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{key}[{i}] must be a {{\"role\": str, \"content\": str}} object "
                             f"(got {json_kind(message)})")
        for part in ("role", "content"):
            if not isinstance(message.get(part), str):
                raise ValueError(f"{key}[{i}].{part} must be a string (got {json_kind(message.get(part))})")
    return messages


def json_kind(value) -> str:
    """What a parsed JSON value is, as a message names it: `null`, `an object`, `the number 3`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"the number {value!r}"[:60]
    if isinstance(value, str):
        return f"the string {value[:40]!r}{'...' if len(value) > 40 else ''}"
    return f"{'a list' if isinstance(value, list) else 'an object'} of {len(value)}"


def rows(examples: list[Example], seq_len: int) -> dict[str, np.ndarray]:
    """Each example as one row of `seq_len` inputs and their targets, padded at the end.

    Returns:
      `tokens [n, seq_len]` (padding id 0, never scored) and `targets [n, seq_len]`: the
      next id where it is scored, else `IGNORE`. An example longer than `seq_len + 1` ids
      is cut to its first `seq_len + 1`.
    """
    tokens = np.zeros((len(examples), seq_len), np.int32)
    targets = np.full((len(examples), seq_len), IGNORE, np.int32)
    for i, example in enumerate(examples):
        ids = np.asarray(example.ids[:seq_len + 1], np.int32)
        scored = np.asarray(example.scored[1:seq_len + 1], bool)  # whether ids[t + 1], predicted at t, counts
        tokens[i, :len(ids) - 1] = ids[:-1]
        targets[i, :len(ids) - 1] = np.where(scored, ids[1:], IGNORE)
    return {"tokens": tokens, "targets": targets}


class FinetuneData:
    """A fine-tuning file as batches of the checkpoint's ids (module docstring: the formats).

    Args:
      path: a `.jsonl` file of records, or a UTF-8 text file.
      tokenizer: the checkpoint's tokenizer.
      seq_len: tokens per row.

    Attributes:
      kind: "records" or "text".
      train, val: `{"tokens", "targets"}` rows (records), or 1-D int32 ids (text).

    Raises:
      ValueError: naming the file: unreadable, malformed, or too short for `seq_len`.
    """

    def __init__(self, path: str, tokenizer: Tokenizer, seq_len: int):
        self.seq_len = seq_len
        if path.endswith(".jsonl"):
            examples = read_records(path, tokenizer)
            self.kind = "records"
            n_val = max(1, int(round(HELD_OUT * len(examples))))
            _check_scored(examples[:-n_val], seq_len, path, "training")
            _check_scored(examples[-n_val:], seq_len, path, "held-out")
            self.train, self.val = rows(examples[:-n_val], seq_len), rows(examples[-n_val:], seq_len)
            self.cut = sum(len(e.ids) > seq_len + 1 for e in examples)  # rows cut to the window
            return
        text = read_text(path, "--data")
        self.kind, self.cut = "text", 0
        split = int((1 - HELD_OUT) * len(text))
        # No BOS or EOS: the windows are cut from the middle of the text.
        self.train, self.val = (np.asarray(tokenizer.encode(part, add_special_tokens=False), np.int32)
                                for part in (text[:split], text[split:]))
        if min(len(self.train), len(self.val)) < seq_len + 2:
            raise ValueError(f"--data {path}: its 90/10 train/validation splits hold {len(self.train)} and "
                             f"{len(self.val)} tokens; each needs --seq-len + 2 = {seq_len + 2}")

    @functools.cached_property
    def _train(self):
        return jax.tree.map(jnp.asarray, self.train)  # on the device once, not at every batch

    def batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        """A training batch drawn from `key`: `tokens` and `targets`, `[batch_size, seq_len]`."""
        if self.kind == "text":
            return windows(self._train, key, batch_size, self.seq_len)
        return _pick_rows(self._train, key, batch_size)

    def validation_batches(self, batch_size: int) -> list[dict[str, np.ndarray]]:
        """The whole held-out split, once, in batches of `batch_size` rows (the last filled
        with rows that score nothing): text as consecutive windows, records one a row."""
        if self.kind == "text":
            n = (len(self.val) - 1) // self.seq_len
            index = np.arange(n)[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]  # [n, seq_len + 1]
            val = {"tokens": self.val[index[:, :-1]], "targets": self.val[index[:, 1:]]}
        else:
            val = self.val
        n = len(val["tokens"])
        padded = -(-n // batch_size) * batch_size
        filled = {"tokens": np.zeros((padded, self.seq_len), np.int32),
                  "targets": np.full((padded, self.seq_len), IGNORE, np.int32)}
        for name in filled:
            filled[name][:n] = val[name]
        return [{name: rows[i:i + batch_size] for name, rows in filled.items()} for i in range(0, padded, batch_size)]


def _check_scored(examples: list[Example], seq_len: int, path: str, split: str) -> None:
    """Raises unless some example of `split` scores a token within `seq_len`: a loss over no
    token is 0/0, NaN, and no result. The message names the record that needs the least
    `--seq-len` to be scored, and that length."""
    if any(e.first_scored() is not None and e.first_scored() <= seq_len for e in examples):
        return
    lines = f"line {examples[0].line}" if len(examples) == 1 else f"lines {examples[0].line}-{examples[-1].line}"
    scorable = [(e.first_scored(), e.line) for e in examples if e.first_scored() is not None]
    if not scorable:
        raise ValueError(f"{path}: the {split} records ({lines}) have no token to score at all")
    need, line = min(scorable)
    raise ValueError(f"{path}: the {split} records ({lines}) have no scored token within --seq-len {seq_len}, so "
                     f"their loss would be 0/0, no result: the earliest, line {line}'s, is token {need} of its "
                     f"record, which a --seq-len of {need} or more reaches")


@functools.partial(jax.jit, static_argnames="batch_size")
def _pick_rows(rows: dict, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """`batch_size` rows of `rows` drawn uniformly (with replacement) from `key`."""
    pick = jax.random.randint(key, (batch_size,), 0, rows["tokens"].shape[0])  # [batch_size], in range
    return jax.tree.map(lambda x: x[pick], rows)


@functools.partial(jax.jit, static_argnames=("batch_size", "seq_len"))
def windows(data: jax.Array, key: jax.Array, batch_size: int, seq_len: int) -> dict[str, jax.Array]:
    """Random windows of the ids `data` (at least `seq_len + 2` of them): `tokens [batch,
    seq_len]` and the next ids, `targets`."""
    start = jax.random.randint(key, (batch_size,), 0, data.shape[0] - seq_len - 1)
    index = start[:, None] + jnp.arange(seq_len + 1)[None, :]  # [batch, seq_len + 1]
    window = data[index]
    return {"tokens": window[:, :-1], "targets": window[:, 1:]}
