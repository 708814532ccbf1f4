"""Text in, text out: tokenizers read from (and written to) Hugging Face checkpoint
folders, chat templates, and generated ids turned into text as they arrive.

`python -m jaxformer.text.generate --checkpoint DIR --prompt TEXT` decodes a checkpoint
folder from the command line.
"""

from jaxformer.text.chat import render_chat
from jaxformer.text.streaming import TextStream, completion_text
from jaxformer.text.tokenizer import (Tokenizer, char_tokenizer, load_tokenizer, save_tokenizer, train_bpe,
                                      word_tokenizer)

__all__ = ["TextStream", "Tokenizer", "char_tokenizer", "completion_text", "load_tokenizer", "render_chat",
           "save_tokenizer", "train_bpe", "word_tokenizer"]
