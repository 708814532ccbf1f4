"""Text in, text out: checkpoint folders' tokenizers and chat templates, and generated ids
as text (docs/text.md)."""

from jaxformer.text.chat import render_chat
from jaxformer.text.streaming import TextStream, completion_text
from jaxformer.text.tokenizer import (
                                      Tokenizer,
                                      char_tokenizer,
                                      load_tokenizer,
                                      save_tokenizer,
                                      train_bpe,
                                      word_tokenizer,
)

__all__ = ["TextStream", "Tokenizer", "char_tokenizer", "completion_text", "load_tokenizer", "render_chat",
           "save_tokenizer", "train_bpe", "word_tokenizer"]
