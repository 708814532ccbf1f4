"""Prefix caching: the K/V of prompts the engine has prefilled, kept so that a later prompt
that begins the same way (a conversation's earlier turns, a shared system prompt, one
context scored with several continuations, a request's `n` choices) copies those positions
instead of computing them again.

An entry is a prompt's one-row `KVCache` once its prefill is done, as the engine made it:
position p's keys and values depend on tokens 0..p alone (causal attention), so any prompt
that shares the entry's first m tokens may start from it with `pos = m`: the slots past m
are overwritten before anything reads them. A sliding-window layer's ring has dropped the
positions its window no longer reads, so with rings an entry is reused only whole (m = its
length) or while it never wrapped. An entry may also hold the logprobs the prefill computed
for its prompt's tokens (a scoring request's), which a scoring request reuses with the K/V.

Memory is bounded by bytes: every entry costs one row of the engine's cache, and the least
recently used ones go first when a new one would pass `max_bytes`.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from jaxformer.cache import KVCache


@dataclasses.dataclass
class Entry:
    """A prefilled prompt: its `ids`, its `row` (a one-row `KVCache`, `pos = len(ids)`), and its
    tokens' logprobs if its prefill scored them (`scored`, with the `temperature` and the
    number of alternatives `top` they were computed with)."""

    ids: np.ndarray
    row: KVCache
    nbytes: int
    scored: list | None = None
    temperature: float = 0.0
    top: int = 0


class PrefixCache:
    """Prompts' caches, least recently used first out, within `max_bytes` (0: off)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[tuple[int, ...], Entry] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drops every entry (the weights that prefilled them have changed)."""
        self._entries.clear()
        self.nbytes = 0

    def longest(self, prompt: list[int], ring: int | None) -> tuple[Entry | None, int]:
        """The entry sharing the longest start with `prompt` and how many of its positions may be
        used, `(None, 0)` if none: at most `len(prompt) - 1`, since the last prompt token's
        logits pick the first new token, and with rings of `ring` slots only what the entry's ring
        still holds. The entry becomes the most recently used."""
        best, used = None, 0
        ids = np.asarray(prompt)
        for key, entry in self._entries.items():
            shared = shared_start(entry.ids, ids)
            if ring is not None and shared < len(entry.ids) and len(entry.ids) > ring:
                continue  # (its ring has moved past position `shared`)
            if shared > used:
                best, used = key, shared
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return self._entries[best], used

    def add(self, prompt: list[int], row: KVCache, scored: list | None = None, temperature: float = 0.0,
            top: int = 0) -> None:
        """Keeps `row`, the cache of `prompt` prefilled, dropping the least recently used entries
        to stay within `max_bytes` (one that would not fit alone is not kept)."""
        nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(row))
        key = tuple(prompt)
        if nbytes > self.max_bytes:
            return
        if key in self._entries:
            old = self._entries.pop(key)
            self.nbytes -= old.nbytes
            if scored is None and old.scored is not None:  # (keep what the older one had scored)
                scored, temperature, top = old.scored, old.temperature, old.top
        while self.nbytes + nbytes > self.max_bytes:
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes
        self._entries[key] = Entry(np.asarray(prompt), row, nbytes, scored, temperature, top)
        self.nbytes += nbytes


def shared_start(theirs: np.ndarray, prompt: np.ndarray) -> int:
    """How many first tokens `theirs` and `prompt` share, at most `len(prompt) - 1` (the last
    prompt token is always run: its logits pick the first new token)."""
    n = min(len(theirs), len(prompt) - 1)
    differ = np.flatnonzero(theirs[:n] != prompt[:n])
    return int(differ[0]) if differ.size else n


def restored(entry: Entry, used: int) -> KVCache:
    """A copy of `entry`'s row to prefill the rest of a prompt into, from position `used` (a copy:
    the engine's prefill gives its cache's buffers to the next one, and the entry must stay)."""
    row = jax.tree.map(lambda leaf: jax.device_put(leaf, may_alias=False), entry.row)
    return row.replace(pos=jax.device_put(np.full((1,), used, np.int32)))
