"""Generated ids to text as they arrive, without broken characters or lost spaces.

Decoding each new token alone goes wrong two ways: a byte-level BPE token can hold part of
a character (alone it decodes to U+FFFD), and sentencepiece decodes a word's leading space
only after something (`"▁world"` alone is `"world"`). So `TextStream` decodes the whole
completion so far behind the prompt's last few ids, hands out what was added since the
last call, and holds back a trailing U+FFFD until its character completes. The decoders
only ever extend the text as ids are added, so the pieces join to `completion_text`. Once
`REBASE_IDS` ids have come out whole, their last few become the context and the rest is
dropped, so each push decodes a few dozen ids however long the completion grows (a server
pushes every token of every stream).
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from jaxformer.text.tokenizer import Tokenizer

CONTEXT_IDS = 4  # prompt ids decoded ahead of the completion: enough for a leading space
REPLACEMENT = "\ufffd"  # what a decoder makes of bytes that do not (yet) form a character
REBASE_IDS = 32  # completion ids decoded again at each push, at most, before they become context


class TextStream:
    """The text of a growing completion, a piece at a time.

    Args:
      tokenizer: the `Tokenizer`.
      prompt_ids: the prompt's ids; the last `CONTEXT_IDS` are decoded ahead of the
        completion so its first word keeps its leading space (none, if they end inside a
        character).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._context_ids = [int(i) for i in list(prompt_ids)[-CONTEXT_IDS:]]
        self._context = tokenizer.decode(self._context_ids)
        if self._context.endswith(REPLACEMENT):
            self._context_ids, self._context = [], ""
        self._ids: list[int] = []  # the completion's
        self._sent = ""  # the text handed out so far

    def _text(self) -> str:
        """The completion's text: context and completion decoded together, less the context."""
        return self._tokenizer.decode(self._context_ids + self._ids)[len(self._context):]

    def push(self, ids: Iterable[int]) -> str:
        """Adds the next ids; returns the text they add ('' while a character is unfinished)."""
        self._ids += [int(i) for i in ids]
        whole = self._text()
        text = whole.rstrip(REPLACEMENT)
        if not text.startswith(self._sent):
            return ""  # a decoder that rewrites earlier text: wait until it extends what was sent
        piece, self._sent = text[len(self._sent):], text
        if text == whole and len(self._ids) >= REBASE_IDS:
            self._rebase()
        return piece

    def _rebase(self) -> None:
        """Makes the last `CONTEXT_IDS` ids the context, all of their text sent (unless they end
        inside a character: then nothing changes until they do not)."""
        context_ids = (self._context_ids + self._ids)[-CONTEXT_IDS:]
        context = self._tokenizer.decode(context_ids)
        if not context.endswith(REPLACEMENT):
            self._context_ids, self._context, self._ids, self._sent = context_ids, context, [], ""

    def finish(self) -> str:
        """The rest of the text, an unfinished character included (as U+FFFD)."""
        text = self._text()
        piece = text[len(os.path.commonprefix([text, self._sent])):]
        self._sent = text
        return piece


def completion_text(tokenizer: Tokenizer, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> str:
    """The text of `completion_ids` after `prompt_ids`: what a `TextStream` hands out in all."""
    stream = TextStream(tokenizer, prompt_ids)
    return stream.push(completion_ids) + stream.finish()
