"""Synthetic tasks whose right answer is known, drawn fresh from a PRNG key.

The reversal task: `src = a b c d`, target `d c b a`. It needs a sequence-to-sequence
model, and the right cross-attention is known in advance: decoder step k should read
source position L - 1 - k, an anti-diagonal.

The copy task (`copy_batch`) and the text corpus (`TextCorpus`) are `train.lm`'s; each
has a `jaxformer.text.Tokenizer`, so that its model can be exported and prompted with text.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.files import read_text
from jaxformer.text import Tokenizer, char_tokenizer, train_bpe, word_tokenizer
from jaxformer.text.dataset import IGNORE, windows  # IGNORE: the target id of an unscored position

PAD, BOS, EOS = 0, 1, 2
N_SYMBOLS = 16
FIRST_SYMBOL = 3
REVERSE_VOCAB = FIRST_SYMBOL + N_SYMBOLS  # 19


@functools.partial(jax.jit, static_argnames=("batch_size", "min_len", "max_len", "width"))
def reverse_batch(key: jax.Array, batch_size: int, min_len: int = 5, max_len: int = 10,
                  width: int | None = None) -> dict[str, jax.Array]:
    """A batch of the reversal task, lengths uniform in `[min_len, max_len]`.

    Args:
      key: PRNG key; the same key gives the same batch.
      batch_size: rows.
      min_len: shortest sequence.
      max_len: longest sequence.
      width: source width (padded with PAD); defaults to `max_len`.

    Returns:
      A dict of int32 arrays:
        src     `[batch, width]`      symbols, then PAD;
        tgt_in  `[batch, width + 1]`  BOS, the reversed symbols, then PAD;
        tgt_out `[batch, width + 1]`  the reversed symbols, EOS, then PAD;
        length  `[batch]`.
    """
    width = max_len if width is None else width
    key_len, key_sym = jax.random.split(key)
    length = jax.random.randint(key_len, (batch_size,), min_len, max_len + 1)  # [batch]
    symbols = jax.random.randint(key_sym, (batch_size, width), FIRST_SYMBOL, REVERSE_VOCAB)
    position = jnp.arange(width)[None, :]  # [1, width]
    valid = position < length[:, None]  # [batch, width]
    src = jnp.where(valid, symbols, PAD)
    # reversed[b, i] = src[b, length - 1 - i] for i < length
    source_index = jnp.clip(length[:, None] - 1 - position, 0, width - 1)
    reversed_ = jnp.where(valid, jnp.take_along_axis(src, source_index, axis=1), PAD)  # [batch, width]
    pad_column = jnp.full((batch_size, 1), PAD, jnp.int32)
    tgt_in = jnp.concatenate([jnp.full((batch_size, 1), BOS, jnp.int32), reversed_], axis=1)
    tgt_out = jnp.concatenate([reversed_, pad_column], axis=1).at[jnp.arange(batch_size), length].set(EOS)
    return {"src": src.astype(jnp.int32), "tgt_in": tgt_in.astype(jnp.int32),
            "tgt_out": tgt_out.astype(jnp.int32), "length": length.astype(jnp.int32)}


# The copy task: [BOS] p_1..p_L [SEP] p_1..p_L with a fresh random pattern p every
# time. Only the second copy is scored, and since the pattern is noise nothing can be
# memorised in the weights: it takes attention reading back across SEP (an induction head).
COPY_LEN, COPY_SYMBOLS = 32, 48
COPY_BOS, COPY_SEP = COPY_SYMBOLS, COPY_SYMBOLS + 1
COPY_VOCAB = COPY_SYMBOLS + 2  # 50


@functools.partial(jax.jit, static_argnames=("batch_size", "length"))
def copy_batch(key: jax.Array, batch_size: int, length: int = COPY_LEN) -> dict[str, jax.Array]:
    """`tokens [batch, 2L + 1]` and next-token `targets` (the first L + 1 are IGNORE)."""
    pattern = jax.random.randint(key, (batch_size, length), 0, COPY_SYMBOLS)
    column = lambda token: jnp.full((batch_size, 1), token, jnp.int32)  # noqa: E731
    sequence = jnp.concatenate([column(COPY_BOS), pattern, column(COPY_SEP), pattern], axis=1)  # [batch, 2L + 2]
    targets = sequence[:, 1:].at[:, :length + 1].set(IGNORE)  # score only the second copy
    return {"tokens": sequence[:, :-1], "targets": targets}


@functools.partial(jax.jit, static_argnames=("n", "length"))  # one program, not one per operation
def copy_prompts(key: jax.Array, n: int, length: int = COPY_LEN) -> tuple[jax.Array, jax.Array]:
    """`([BOS] pattern [SEP]` prompts `[n, L + 2]`, the patterns `[n, L]`) to copy back."""
    batch = copy_batch(key, n, length)
    return batch["tokens"][:, :length + 2], batch["targets"][:, length + 1:]


def copy_tokenizer() -> Tokenizer:
    """The copy task's ids as words, so that its model can be prompted with text.

    Symbol i is the word "i", then "<bos>" (`COPY_BOS`) and "<sep>" (`COPY_SEP`): the
    prompt `[BOS] 3 11 42 [SEP]` reads "<bos> 3 11 42 <sep>".
    """
    return word_tokenizer([str(i) for i in range(COPY_SYMBOLS)] + ["<bos>", "<sep>"], bos_token="<bos>")


# The text task's tokenizers: every distinct character a token, or byte-level BPE.
TEXT_TOKENIZERS = ("char", "bpe")
BPE_MIN_VOCAB = 257  # the 256 bytes and <|endoftext|> (`jaxformer.text.train_bpe`)
TRAIN_FRACTION = 0.9  # of the text's characters; the rest validates


class TextCorpus:
    """A UTF-8 file as the token ids of a tokenizer made for it.

    The first 90 % of the characters trains, the rest validates. The two parts are
    encoded apart, so no token spans the cut, and BPE learns its merges from the
    training part alone.

    Args:
      path: the file.
      seq_len: tokens per training window.
      tokenizer: "char" (the file's distinct characters, sorted: `chars[i]` is id i) or
        "bpe" (byte-level BPE, `jaxformer.text.train_bpe`).
      vocab_size: with "bpe", the most ids the BPE vocabulary may hold.

    Raises:
      ValueError: the file cannot be read, is not UTF-8, or is too short for `seq_len`.
    """

    def __init__(self, path, seq_len: int, tokenizer: str = "char", vocab_size: int | None = None):
        text = read_text(path, "--data")
        split = int(TRAIN_FRACTION * len(text))
        train_text, val_text = text[:split], text[split:]
        self.tokenizer = (char_tokenizer(sorted(set(text))) if tokenizer == "char"
                          else train_bpe([train_text], vocab_size))
        self.seq_len = seq_len
        # No BOS or EOS: the windows are cut from the middle of the text.
        self.train, self.val = (jnp.asarray(self.tokenizer.encode(part, add_special_tokens=False), jnp.int32)
                                for part in (train_text, val_text))
        if min(len(self.train), len(self.val)) < seq_len + 2:
            raise ValueError(f"--data {path} holds {len(text)} characters: too few for --seq-len {seq_len} "
                             f"(each of the 90/10 train/validation splits needs {seq_len + 2} tokens; they hold "
                             f"{len(self.train)} and {len(self.val)})")

    def batch(self, key: jax.Array, batch_size: int, split: str = "train") -> dict[str, jax.Array]:
        return windows(self.train if split == "train" else self.val, key, batch_size, self.seq_len)


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The ids of `--prompt`, without special tokens (as the training windows).

    Raises:
      ValueError: naming `--prompt` and the characters a character vocabulary lacks.
    """
    try:
        return tokenizer.encode(prompt, add_special_tokens=False)
    except ValueError:  # only a character vocabulary can lack something: BPE spells every byte
        unknown = sorted(set(prompt) - set(tokenizer.backend.get_vocab()))
        raise ValueError(f"--prompt holds characters the corpus does not: {unknown}") from None
