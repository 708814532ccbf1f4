"""Constrained decoding for the server's `response_format`: JSON that parses, or that a schema accepts.

OpenAI's `response_format` is `{"type": "text"}` (no constraint), `{"type": "json_object"}` (any
JSON object) or `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`.
`read_response_format` checks it and compiles its grammar with llguidance (the optional `json`
extra), and gives a factory; each request's rows then get a `Constraint` from it, which says
which ids may come next (`allowed`, a mask the engine puts on the logits before sampling) and
follows the ids picked (`advance`). The JSON is compact (no whitespace between its tokens), so
a model that writes whitespace at random cannot write it forever.

The grammar is matched on bytes; llguidance needs each id's bytes, which it reads itself from
the byte-level and byte-fallback tokenizers of real checkpoints, and which are each token's own
text for tokenizers whose decoding just joins the tokens' texts (`char_tokenizer`'s). A
tokenizer that is neither (`word_tokenizer`'s, which puts spaces between words) is refused.
"""

from __future__ import annotations

import functools
import re
import reprlib
import threading
import weakref
from typing import Any, Callable

import numpy as np
import tokenizers

from jaxformer.text.tokenizer import Tokenizer

NEEDS_EXTRA = "response_format needs the json extra: pip install 'jaxformer[json]'"
# No whitespace between JSON tokens, "," and ":" alone: as `overrides`, a schema's own
# "x-guidance" options cannot turn whitespace back on.
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # the OpenAI API's rule for json_schema.name

_SHOWN = reprlib.Repr()  # how much of a client's value a message quotes
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, 60, 60


def read_response_format(value: Any, tokenizer: Tokenizer) -> Callable[[int], Constraint] | None:
    """The request body's `response_format`, checked and compiled for `tokenizer`.

    Returns:
      None for no constraint (`None`, `{"type": "text"}`); else a factory: `factory(vocab_size)`
      is a new `Constraint` at the start of the grammar, for a model of `vocab_size` logits
      (one a row; the factory may be called many times).

    Raises:
      ValueError: naming the part of `response_format` that is wrong (a schema llguidance
        refuses, or a tokenizer whose tokens' bytes are unknown), or the missing extra.
    """
    schema, where = _schema(value)
    if schema is None:
        return None
    llguidance = _llguidance()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
    ll_tokenizer = _ll_tokenizer(tokenizer)
    # Compiling the grammar checks the schema; it is done once here, and each row starts from a copy.
    start = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    if start.is_error():
        raise ValueError(f"{where}: {start.get_error()}")
    return functools.partial(Constraint, start, tokenizer.vocab_size, ll_tokenizer.vocab_size)


class Constraint:
    """One row's place in its grammar. Not thread-safe: one thread at a time uses a row's.

    Once the JSON is complete, only the stop ids are allowed, and `is_finished()` is true: a
    tokenizer with no stop id then allows nothing, and the row must end there.
    """

    def __init__(self, start, tokenizer_vocab_size: int, mask_size: int, vocab_size: int):
        """`start`: the grammar's first `LLMatcher` (copied); `mask_size`: the ids its masks
        cover (the tokenizer's, and an EOS of llguidance's own past them where it added one);
        `vocab_size`: the model's, whose ids past the tokenizer's are never allowed."""
        self._matcher = start.deep_copy()
        self._vocab_size = vocab_size
        self._known = min(tokenizer_vocab_size, vocab_size)
        self._bitmask = np.zeros((1, (mask_size + 31) // 32), np.int32)
        self._allowed = None  # this step's mask, once asked for

    def allowed(self) -> np.ndarray:
        """The ids that may come next: a read-only bool array [vocab_size].

        Raises:
          RuntimeError: the matcher failed (a grammar past llguidance's limits at this step).
        """
        if self._allowed is None:
            from llguidance.numpy import fill_next_token_bitmask

            fill_next_token_bitmask(self._matcher, self._bitmask)
            if self._matcher.is_error():
                raise RuntimeError(f"response_format: {self._matcher.get_error()}")
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")  # id i is bit i % 32 of word i // 32
            allowed = np.zeros(self._vocab_size, bool)
            allowed[:self._known] = bits[:self._known]
            allowed.flags.writeable = False  # handed out as is, so no caller may change it
            self._allowed = allowed
        return self._allowed

    def advance(self, token: int) -> None:
        """Follows `token`, the id picked, which `allowed()` must allow (else a ValueError, and
        nothing changes)."""
        token = int(token)
        if not (0 <= token < self._vocab_size and self.allowed()[token]):
            raise ValueError(f"token {token} is not allowed here by response_format")
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"response_format: {self._matcher.get_error()}")
        self._allowed = None

    def is_finished(self) -> bool:
        """The grammar is complete: nothing may follow but a stop id."""
        return self._matcher.is_stopped()


def _schema(value: Any) -> tuple[dict | None, str]:
    """The JSON Schema `response_format` asks for (None: none), and the field it came from."""
    if value is None:
        return None, "response_format"
    if not isinstance(value, dict):
        raise ValueError(f"response_format must be an object (got {_SHOWN.repr(value)})")
    kind = value.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return {"type": "object"}, "response_format"
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema' "
                         f"(got {_SHOWN.repr(kind)})")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError(f"response_format.json_schema must be an object with a name and a schema "
                         f"(got {_SHOWN.repr(spec)})")
    name = spec.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ValueError(f"response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-' "
                         f"(got {_SHOWN.repr(name)})")
    for field, kind, rule in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if spec.get(field) is not None and not isinstance(spec[field], kind):
            raise ValueError(f"response_format.json_schema.{field} must be {rule} (got {_SHOWN.repr(spec[field])})")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(f"response_format.json_schema.schema must be a JSON Schema object (got {_SHOWN.repr(schema)})")
    # `strict` changes nothing: the schema is always kept to, as OpenAI's strict mode does.
    return schema, "response_format.json_schema.schema"


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (Constraint.allowed's; fails here rather than mid-decoding)
    except ImportError:
        raise ValueError(NEEDS_EXTRA) from None
    return llguidance


# tokenizer.backend -> {stop ids: LLTokenizer}: made once (a quarter of a second for a 32k
# vocabulary), gone with the tokenizer. Keyed on the backend, as `Tokenizer` (a frozen
# dataclass holding a dict) has no hash; the lock makes the first requests wait for one build.
_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LL_TOKENIZERS_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer: Tokenizer):
    """llguidance's view of `tokenizer`: each id's bytes, its special ids, its stop ids."""
    with _LL_TOKENIZERS_LOCK:
        made = _LL_TOKENIZERS.setdefault(tokenizer.backend, {})
        stop_ids = tuple(tokenizer.stop_ids)
        if stop_ids not in made:
            made[stop_ids] = _make_ll_tokenizer(tokenizer, stop_ids)
        return made[stop_ids]


def _make_ll_tokenizer(tokenizer: Tokenizer, stop_ids: tuple[int, ...]):
    import llguidance

    tokens, special, tokenize = _vocabulary(tokenizer)

    class Backend:  # what llguidance's TokenizerWrapper reads
        # With no stop id, llguidance adds an id of its own past the vocabulary as its end of
        # text: Constraint never allows it, and is_finished() says when only it would be.
        eos_token_id = stop_ids[0] if stop_ids else None
        bos_token_id = tokenizer.bos_id
        special_token_ids = sorted(special | set(stop_ids))  # ids the grammar's text never spells

        def __init__(self):
            self.tokens = tokens

        # Where the grammar forces a text (a required key), llguidance allows only the first id
        # of its tokenization, as the model would have seen the text in training.
        def __call__(self, text: str) -> list[int]:  # (str only: TokenizerWrapper probes with bytes)
            return tokenize(text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Backend()), eos_token=list(stop_ids) or None)


def _vocabulary(tokenizer: Tokenizer) -> tuple[list[bytes], set[int], Callable[[str], list[int]]]:
    """Each id's bytes, the ids of special tokens (whose text is not generated text), and
    the tokenization of a text in the middle of one, none of them holding `tokenizer` (the
    cache's key: held, it would never go).

    Raises:
      ValueError: a tokenizer whose tokens do not each stand for fixed bytes.
    """
    import llguidance

    n = tokenizer.vocab_size
    try:
        # Byte-level and byte-fallback tokenizers (those of real checkpoints): llguidance reads
        # them from their tokenizer.json, partial UTF-8 characters included, and tokenizes
        # with no "▁" put in front as sentencepiece's do at the start of a text.
        known = llguidance.LLTokenizer(tokenizer.backend.to_str())
    except ValueError:  # "can't determine decoder type"
        known = None
    if known is not None:
        special = {i for i in range(n) if known.is_special_token(i)}
        return [known.decode_bytes([i]) for i in range(n)], special, known.tokenize_str
    special = {i for i, added in tokenizer.backend.get_added_tokens_decoder().items() if added.special}
    texts = [tokenizer.backend.decode([i], skip_special_tokens=False) for i in range(n)]
    # A token's text alone is its bytes only where decoding joins the texts as they are.
    plain = [i for i in range(n) if i not in special]
    if tokenizer.backend.decode(plain, skip_special_tokens=False) != "".join(texts[i] for i in plain):
        raise ValueError("response_format is not supported with this tokenizer: its decoding does not "
                         "join its tokens' texts as they are (e.g. it puts spaces between words)")
    copy = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    return [t.encode() for t in texts], special, lambda text: copy.encode(text, add_special_tokens=False).ids
