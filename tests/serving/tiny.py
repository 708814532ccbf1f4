"""A tiny chat model trained in the test, its tokenizer and its checkpoint folder: what the
serving tests run the engine and the server on. It has learned a few short dialogues by
heart, each ended by `<|endoftext|>` (its EOS), so greedy decoding writes real words and
stops by itself, and one long count that does not stop."""

import dataclasses

from conftest import memorised_params

from jaxformer import DecoderConfig
from jaxformer.convert import save_hf
from jaxformer.text import save_tokenizer, train_bpe

EOS = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
DIALOGUES = [
    ("What is attention?", "Attention mixes the values, weighted by how well each key fits the query."),
    ("Why cache keys and values?", "So each new token costs one step, not the whole sequence again."),
    ("What does RoPE do?", "It rotates queries and keys by their positions, so scores see distances."),
    ("Say hello.", "Hello! The cat sat on the mat, and the dog sat on the log."),
]
# And one answer longer than any request (past max_seq_len): a request that runs until it is
# stopped, by its max_tokens, a cancel or its client leaving.
COUNT = "<|user|>Count.\n<|assistant|>" + " ".join(str(n) for n in range(1, 60))
CORPUS = ("".join(f"<|user|>{q}\n<|assistant|>{a}{EOS}" for q, a in DIALOGUES) + COUNT + EOS) * 8
TOKENIZER = dataclasses.replace(train_bpe([CORPUS], 320), chat_template=CHAT_TEMPLATE)
CONFIG = DecoderConfig(vocab_size=TOKENIZER.vocab_size, n_layer=1, n_head=4, n_kv_head=2, d_model=64,
                       max_seq_len=96)


def trained_params():
    # Windows as long as the context: learned to the last EOS of every dialogue on this machine's
    # float path too (300 updates of 48-token windows left three of the four answers unfinished
    # here: greedy decoding ran past "the query." without stopping). 300 updates of 8 such windows
    # learn it as surely as 600 of 16, at a quarter of the cost (the training is most of the
    # engine tests' time): every answer and its EOS greedy, the count running on, and the least
    # margin of an answer's token over the runner-up 3.8 logits or more with XLA's optimisations
    # off (the tests'), on, or with its fusion emitters (600 of 16: 4.0 here).
    return memorised_params(CONFIG, TOKENIZER.encode(CORPUS, add_special_tokens=False), steps=300, batch=8,
                            width=96)


# A random decoder wider and deeper than the tiny one: requests of 400 tokens take long enough
# (seconds, 8 at once) to be still running while a test does what it must meanwhile.
SLOW = DecoderConfig(vocab_size=TOKENIZER.vocab_size, n_layer=4, n_head=8, n_kv_head=2, d_model=256, max_seq_len=448)


def save_folder(params, path: str, config: DecoderConfig = CONFIG) -> str:
    """`path`, now a checkpoint folder of the tiny model (or `config`'s) and its tokenizer."""
    save_hf(config, params, path, bos_id=TOKENIZER.bos_id, eos_id=TOKENIZER.eos_id, pad_id=TOKENIZER.pad_id)
    save_tokenizer(TOKENIZER, path)
    return path
