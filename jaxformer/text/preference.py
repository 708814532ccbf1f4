"""Preference pairs in a checkpoint's own tokens, for direct preference optimisation.

A `.jsonl` file holds one pair a line, in TRL's preference format:

  {"prompt": str, "chosen": str, "rejected": str}             text
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   a conversation
  {"chosen": [messages], "rejected": [messages]}              the prompt implicit: the turns
                                                              both conversations begin with
  {"chosen": str, "rejected": str}                            the prompt implicit: the text both
                                                              begin with (a space before where
                                                              they part goes to the answers), as
                                                              TRL's extract_prompt takes it

A text pair is tokenized as TRL tokenizes it: the prompt alone, and the prompt followed by each
answer and the EOS token's text (unless the answer ends with it), each framed as the tokenizer
frames a text (a BOS first). A conversation is rendered by the chat template, the prompt with
the assistant's header after it (`add_generation_prompt`), the prompt and answer whole. The
answer's tokens are those past the ids the prompt and both full sequences share (where a
tokenizer merges across the boundary, or a template renders the prompt alone differently,
the answer starts where they part).

Each pair is two rows of `seq_len` inputs (padded at the end, cut past `seq_len + 1` ids), the
answer's tokens scored, the prompt's not (`jaxformer.text.dataset.rows`). A pair whose prompt
fills the window (no answer token left to score) is left out and counted, as TRL leaves it out.
The last 10 % of the pairs (at least one) are held out.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.text.chat import render_chat
from jaxformer.text.dataset import HELD_OUT, IGNORE, Example, checked_messages, json_kind, jsonl_records, rows
from jaxformer.text.tokenizer import Tokenizer

FORMAT = ('{"prompt": str, "chosen": str, "rejected": str}, the same with lists of {"role", "content"} '
          'messages, or either without its prompt')


@dataclasses.dataclass(frozen=True)
class Pair:
    """One preference pair's ids: the prompt's, then each answer's (its EOS included)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def examples(self) -> tuple[Example, Example]:
        """The chosen and the rejected sequence, each scored on its answer alone."""
        return tuple(Example(ids=self.prompt + answer, scored=[False] * len(self.prompt) + [True] * len(answer))
                     for answer in (self.chosen, self.rejected))


def _shared(a, b) -> int:
    """The number of leading items (ids, characters, turns) `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _split(prompt: list[int], chosen: list[int], rejected: list[int]) -> Pair:
    """The pair of the tokenized prompt and the two tokenized full sequences: the prompt ends
    where either full sequence first departs from it."""
    cut = min(_shared(prompt, chosen), _shared(prompt, rejected))
    return Pair(prompt=chosen[:cut], chosen=chosen[cut:], rejected=rejected[cut:])


def text_pair(tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str) -> Pair:
    """A text pair, tokenized as the module docstring says."""
    eos = tokenizer.special_tokens.get("eos_token")

    def full(answer: str) -> list[int]:
        ended = answer if eos is None or answer.endswith(eos) else answer + eos
        return tokenizer.encode(prompt + ended)

    return _split(tokenizer.encode(prompt), full(chosen), full(rejected))


def chat_pair(tokenizer: Tokenizer, prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> Pair:
    """A conversation pair, rendered by the chat template (which writes its own BOS)."""
    def ids(messages: list[dict], start: bool) -> list[int]:
        return tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt=start), add_special_tokens=False)

    return _split(ids(prompt, True), ids(prompt + chosen, False), ids(prompt + rejected, False))


def pair_of(tokenizer: Tokenizer, record) -> Pair:
    """The `Pair` of one parsed record; a one-line `ValueError` saying what it holds instead."""
    if not isinstance(record, dict):
        raise ValueError(f"a preference record is {FORMAT} (got {json_kind(record)})")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise ValueError(f"a preference record is {FORMAT}: it has no {key!r}")
    if "prompt" not in record and all(isinstance(record[key], str) for key in ("chosen", "rejected")):
        chosen, rejected = record["chosen"], record["rejected"]
        n = _shared(chosen, rejected)
        n -= n > 0 and n < min(len(chosen), len(rejected)) and chosen[n - 1] == " "  # the space: the answers'
        if n == 0:
            raise ValueError("chosen and rejected share no first character, so they hold no prompt: give it as "
                             "'prompt'")
        return text_pair(tokenizer, chosen[:n], chosen[n:], rejected[n:])
    if all(isinstance(record.get(key), str) for key in ("prompt", "chosen", "rejected")):
        return text_pair(tokenizer, record["prompt"], record["chosen"], record["rejected"])
    if any(isinstance(record.get(key), str) for key in ("prompt", "chosen", "rejected")):
        kinds = ", ".join(f"{key}: {json_kind(record.get(key))}" for key in ("prompt", "chosen", "rejected"))
        raise ValueError(f"a preference record's prompt, chosen and rejected are all strings or all messages "
                         f"({kinds})")
    chosen, rejected = checked_messages(record["chosen"], "chosen"), checked_messages(record["rejected"], "rejected")
    if "prompt" in record:
        prompt = checked_messages(record["prompt"], "prompt")
    else:  # the prompt implicit: the turns both conversations begin with
        n = _shared(chosen, rejected)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise ValueError("chosen and rejected share no first turn, so they hold no prompt: give it as 'prompt'")
    if not chosen or not rejected:
        raise ValueError(f"the {'chosen' if not chosen else 'rejected'} conversation adds no turn to the prompt")
    return chat_pair(tokenizer, prompt, chosen, rejected)


class PreferenceData:
    """A preference file as batches of pairs (module docstring: the format).

    Args:
      path: a `.jsonl` file of preference records.
      tokenizer: the checkpoint's tokenizer.
      seq_len: tokens per row.

    Attributes:
      train, val: `{"tokens", "targets"}` `[pairs, 2, seq_len]` (the chosen row, then the rejected).
      cut: pairs cut to the window; dropped: pairs left out, their prompt filling it.

    Raises:
      ValueError: naming the file (and line): unreadable, a malformed record, fewer than two
        pairs left, or no pair whose answers the window reaches.
    """

    def __init__(self, path: str, tokenizer: Tokenizer, seq_len: int):
        if not path.endswith(".jsonl"):
            raise ValueError(f"--data {path}: preference pairs are a .jsonl file of {FORMAT} records")
        pairs = jsonl_records(path, pair_of, tokenizer)
        # A prompt of seq_len ids or more leaves no answer token predicted within the window.
        kept = [pair for _, pair in pairs if len(pair.prompt) < seq_len + 1]
        self.seq_len, self.dropped = seq_len, len(pairs) - len(kept)
        self.cut = sum(max(len(p.chosen), len(p.rejected)) + len(p.prompt) > seq_len + 1 for p in kept)
        if len(kept) < 2:
            longest = f"; {self.dropped} left out, their prompt filling --seq-len {seq_len}" if self.dropped else ""
            raise ValueError(f"--data {path}: {len(kept)} pair(s) to use{longest}: at least 2 are needed (one to "
                             "train, one to validate)")
        n_val = max(1, int(round(HELD_OUT * len(kept))))
        self.train, self.val = (self._rows(part) for part in (kept[:-n_val], kept[-n_val:]))

    def _rows(self, pairs: list[Pair]) -> dict[str, np.ndarray]:
        """`{"tokens", "targets"}` `[len(pairs), 2, seq_len]`."""
        both = rows([example for pair in pairs for example in pair.examples()], self.seq_len)  # [2 n, seq_len]
        return {name: x.reshape(len(pairs), 2, self.seq_len) for name, x in both.items()}

    @functools.cached_property
    def _train(self):
        return jax.tree.map(jnp.asarray, self.train)  # on the device once, not at every batch

    def batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        """`batch_size` training pairs drawn from `key` (with replacement): `tokens`, `targets`
        `[2 batch_size, seq_len]` (the chosen rows, then the rejected, in the same order) and
        `pair` `[batch_size]`, each row's index in the training split."""
        return _pick_pairs(self._train, key, batch_size)

    def validation_batches(self, batch_size: int) -> list[dict[str, np.ndarray]]:
        """The held-out pairs, once, in batches as `batch`'s; `pair` is -1 for the rows that fill
        the last batch, which score nothing."""
        return _in_order(self.val, batch_size)

    def training_batches(self, batch_size: int) -> list[dict[str, np.ndarray]]:
        """The training pairs, once, in order, as `validation_batches` gives the held-out ones."""
        return _in_order(self.train, batch_size)


def _in_order(pairs: dict[str, np.ndarray], batch_size: int) -> list[dict[str, np.ndarray]]:
    """`pairs` (`[n, 2, T]`) in batches of `batch_size`, the last filled with pairs that score nothing."""
    n, _, seq_len = pairs["tokens"].shape
    padded = -(-n // batch_size) * batch_size
    tokens = np.zeros((padded, 2, seq_len), np.int32)
    targets = np.full((padded, 2, seq_len), IGNORE, np.int32)
    tokens[:n], targets[:n] = pairs["tokens"], pairs["targets"]
    pair = np.where(np.arange(padded) < n, np.arange(padded), -1).astype(np.int32)
    return [_chosen_then_rejected({"tokens": tokens[i:i + batch_size], "targets": targets[i:i + batch_size]},
                                  pair[i:i + batch_size], np) for i in range(0, padded, batch_size)]


def _chosen_then_rejected(pairs: dict, pair, xp) -> dict:
    """`[B, 2, T]` pairs as `[2 B, T]` rows, the chosen rows first, as TRL batches them."""
    return {**{name: xp.concatenate([x[:, 0], x[:, 1]]) for name, x in pairs.items()}, "pair": pair}


@functools.partial(jax.jit, static_argnames="batch_size")
def _pick_pairs(pairs: dict, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    pick = jax.random.randint(key, (batch_size,), 0, pairs["tokens"].shape[0])  # [batch_size]
    return _chosen_then_rejected(jax.tree.map(lambda x: x[pick], pairs), pick.astype(jnp.int32), jnp)

