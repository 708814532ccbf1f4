"""TextStream: pieces that join into the completion's text, with no broken character and
no lost space, whatever the tokens' boundaries."""

import dataclasses

import pytest
from checkpoints import CORPUS, bpe_tokenizer
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxformer.text import TextStream, Tokenizer, completion_text
from jaxformer.text.streaming import CONTEXT_IDS, REBASE_IDS, REPLACEMENT

BPE = Tokenizer(bpe_tokenizer())
# 龍 and 鳳 are not in the corpus: the tokenizer spells each in three byte tokens.
TEXT = "The Transformer 读入整个句子, then 龍鳳 appear.\n机器学习 needs patience."


def _pieces(tokenizer, prompt_ids, ids):
    stream = TextStream(tokenizer, prompt_ids)
    return [stream.push([i]) for i in ids] + [stream.finish()]


def test_pieces_join_into_the_text_and_never_hold_half_a_character():
    prompt = BPE.encode("Attention: ")
    ids = BPE.encode(TEXT, add_special_tokens=False)
    assert BPE.decode(ids) == TEXT
    assert any(REPLACEMENT in BPE.decode([i]) for i in ids)  # some tokens are parts of a character
    pieces = _pieces(BPE, prompt, ids)
    assert "".join(pieces) == TEXT == completion_text(BPE, prompt, ids)
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert pieces.count("") >= 4  # the first two bytes of 龍 and of 鳳 wait for the third
    assert len([p for p in pieces if p]) > 10  # and the rest streams


def test_an_unfinished_character_at_the_end_comes_out_as_the_decoder_says():
    ids = BPE.encode("天龍", add_special_tokens=False)[:-1]  # 龍 cut after two of its bytes
    pieces = _pieces(BPE, [], ids)
    assert "".join(pieces) == BPE.decode(ids) and pieces[-1].endswith(REPLACEMENT)
    assert not any(REPLACEMENT in piece for piece in pieces[:-1])


def _sentencepiece_like():
    """Words marked by a leading "▁" that decodes to a space, except at the very start."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    backend.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    return Tokenizer(backend)


def test_the_first_word_keeps_its_space():
    tokenizer = _sentencepiece_like()
    prompt, whole = tokenizer.encode("The cat"), tokenizer.encode("The cat sat on the mat")
    assert whole[:len(prompt)] == prompt
    completion = whole[len(prompt):]
    assert tokenizer.decode(completion) == "sat on the mat"  # decoded alone, the space is lost
    assert completion_text(tokenizer, prompt, completion) == " sat on the mat"
    assert "".join(_pieces(tokenizer, prompt, completion)) == " sat on the mat"


@pytest.mark.parametrize("prompt", ["", "龍"])
def test_a_prompt_without_usable_context_decodes_the_completion_alone(prompt):
    ids = BPE.encode(prompt, add_special_tokens=False)
    if prompt:
        ids = ids[:-1]  # the prompt ends inside 龍: its bytes are not context
    completion = BPE.encode(" then more", add_special_tokens=False)
    assert completion_text(BPE, ids, completion) == " then more"


@dataclasses.dataclass(frozen=True)
class CountingTokenizer(Tokenizer):
    """The tokenizer, noting how many ids each decode is given."""

    lengths: list = dataclasses.field(default_factory=list)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self.lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_a_long_completion_decodes_a_bounded_window_at_each_push():
    ids = BPE.encode(TEXT * 12, add_special_tokens=False)  # some 500 ids, characters split in bytes among them
    counting = CountingTokenizer(BPE.backend, BPE.special_tokens)
    pieces = _pieces(counting, BPE.encode("Attention: "), ids)
    assert "".join(pieces) == TEXT * 12 == BPE.decode(ids)
    assert not any(REPLACEMENT in piece for piece in pieces)
    # Each decode stays near a window (a rebase waits while a character is split), however long the text:
    assert len(ids) > 10 * REBASE_IDS and max(counting.lengths) < 2 * (CONTEXT_IDS + REBASE_IDS)
