"""Text to token ids and back, with Hugging Face's `tokenizers` library.

`load_tokenizer` reads a checkpoint folder's tokenizer the way transformers does, without
transformers (which files, in which order: docs/text.md, "Tokenizers"); `train_bpe`,
`char_tokenizer` and `word_tokenizer` build the demos' tokenizers, and `save_tokenizer`
writes any of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from jaxformer.files import read_json_object, write_text_atomically
from jaxformer.validation import as_int

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
END_OF_TEXT = "<|endoftext|>"  # the byte-level BPE tokenizers' end of a document


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` (`backend`) with the special tokens and chat template around it.

    Attributes:
      special_tokens: role (`bos_token`, `eos_token`, `pad_token`, `unk_token`) -> token text.
      chat_template: the Jinja template that turns messages into a prompt, or None.
      eos_ids: the stop ids the checkpoint names; None: the EOS token's.
    """

    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
    chat_template: str | None = None
    eos_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        for role, token in self.special_tokens.items():
            if self.backend.token_to_id(token) is None:
                raise ValueError(f"special token {role}={token!r} is not in the vocabulary")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a generated text: `eos_ids`, else the EOS token's, else none."""
        if self.eos_ids is not None:
            return self.eos_ids
        return () if self.eos_id is None else (self.eos_id,)

    @property
    def vocab_size(self) -> int:
        """Ids run from 0 to `vocab_size - 1`, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def _id(self, role: str) -> int | None:
        token = self.special_tokens.get(role)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; with `add_special_tokens`, framed by the post-processor (Llama's: BOS first).

        Raises:
          ValueError: the text holds something the vocabulary cannot spell.
        """
        try:
            # A batch of one: the same ids as `encode`, but tokenizers lets go of Python's lock while
            # it works, so a long text (a server's 1 MiB prompt, in a worker thread) holds up no other thread.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as e:  # tokenizers raises a bare Exception, e.g. for a word-level unknown
            raise ValueError(f"cannot tokenize {_preview(text)}: {e}") from None

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`, special tokens left out unless `skip_special_tokens` is False."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def check_fits_model(tokenizer: Tokenizer, vocab_size: int, where: str) -> None:
    """Raises `ValueError`, naming `where` (the folder), unless the tokenizer's pad and EOS ids
    are ids of the model's vocabulary."""
    for name, value in (("pad", tokenizer.pad_id), *(("eos", i) for i in tokenizer.stop_ids)):
        if value is not None and value >= vocab_size:
            raise ValueError(f"{where}: the tokenizer's {name} id {value} is past the model's vocab_size {vocab_size}")


def _preview(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _read_json(path: str, required: bool) -> dict:
    """The JSON object in `path`; {} for an optional file that is absent."""
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"{path}: missing")
        return {}
    return read_json_object(path)


def _token_text(value: Any, where: str) -> str | None:
    """A special token of `tokenizer_config.json`: a string, or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{where}: must be a token string or {{\"content\": ...}}, got {value!r}")


def _chat_template(path: str, config: dict) -> str | None:
    """The folder's default chat template: `chat_template.jinja`, else the config's."""
    jinja = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{os.path.join(path, TOKENIZER_CONFIG_FILE)}: chat_template must be a string "
                         f"or a list of {{\"name\", \"template\"}}")
    return template


def _eos_ids(path: str, vocab_size: int) -> tuple[int, ...] | None:
    """The stop ids of `generation_config.json`, else `config.json`; None when neither names any."""
    for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE):
        file = os.path.join(path, name)
        value = _read_json(file, required=False).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        return tuple(as_int(i, f"{file}: eos_token_id", minimum=0, maximum=vocab_size - 1,
                            maximum_name="the tokenizer's vocabulary size - 1") for i in ids)
    return None


def load_tokenizer(path: str) -> Tokenizer:
    """Reads the tokenizer of a Hugging Face checkpoint folder (`stop_ids` as transformers'
    `generate` finds them, and where it finds none, as docs/text.md says).

    Args:
      path: a folder holding `tokenizer.json`, and optionally `tokenizer_config.json`,
        `chat_template.jinja`, `generation_config.json` and `config.json`.

    Raises:
      FileNotFoundError: the folder or its `tokenizer.json` is missing.
      ValueError: naming the file that does not parse or holds a bad field.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    file = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: missing; the tokenizer is read from tokenizer.json "
                                "(a folder with only a sentencepiece tokenizer.model is not supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
        raise ValueError(f"{file}: not a readable tokenizer ({str(e).splitlines()[0]})") from None
    config_file = os.path.join(path, TOKENIZER_CONFIG_FILE)
    config = _read_json(config_file, required=False)
    special = {}
    for role in SPECIAL_ROLES:
        token = _token_text(config.get(role), f"{config_file}: {role}")
        if token is not None:
            special[role] = token
    # The post-processor of tokenizer.json alone frames a text (Llama's and Gemma's put a BOS in
    # front, Qwen's nothing): transformers 5 drops tokenizer_config.json's add_bos_token and
    # add_eos_token whenever a tokenizer.json is there, so neither is read here.
    try:
        tokenizer = Tokenizer(backend, special, _chat_template(path, config))
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    return dataclasses.replace(tokenizer, eos_ids=_eos_ids(path, tokenizer.vocab_size))


def save_tokenizer(tokenizer: Tokenizer, path: str) -> None:
    """Writes `tokenizer.json` and `tokenizer_config.json` into the folder `path` (created if
    needed), each atomically, for `load_tokenizer` and transformers' `AutoTokenizer`.
    """
    os.makedirs(path, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens,
              # (No add_bos_token: the post-processor in tokenizer.json frames the text.)
              "clean_up_tokenization_spaces": False}
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    write_text_atomically(os.path.join(path, TOKENIZER_FILE), tokenizer.backend.to_str(pretty=True))
    write_text_atomically(os.path.join(path, TOKENIZER_CONFIG_FILE), json.dumps(config, indent=2) + "\n")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (as GPT-2's) learned from `texts`: nothing is unknown.

    Args:
      texts: the training texts.
      vocab_size: the 256 bytes, `<|endoftext|>` (id 0: BOS, EOS and PAD) and the merges;
        below 257 is a ValueError.
    """
    vocab_size = as_int(vocab_size, "vocab_size", minimum=257)
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    return Tokenizer(backend, {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "pad_token": END_OF_TEXT})


def char_tokenizer(chars: Sequence[str]) -> Tokenizer:
    """Every character its own token: `chars[i]` is id i. A character outside `chars`
    cannot be encoded (`encode` raises)."""
    backend = tokenizers.Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")  # (?m): "." takes newlines too
    backend.decoder = decoders.Fuse()  # join the characters as they are, no separator
    return Tokenizer(backend)


def word_tokenizer(words: Sequence[str], **special_tokens: str) -> Tokenizer:
    """`words[i]` is id i, some of them in the roles `special_tokens` names (`bos_token=...`);
    a text is words separated by spaces, and decodes the same way.
    """
    backend = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(list(special_tokens.values()))  # (they keep their ids; decode skips them)
    return Tokenizer(backend, special_tokens)
