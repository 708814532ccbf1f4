"""The tiny random Llama-shaped checkpoint the hostile-input files of fine-tuning, adapters and
perplexity start from: a byte-level BPE tokenizer with a chat template (tests/text's), two
layers of width 32, written by jaxformer (no network, no torch); and its weights damaged."""

import sys
from pathlib import Path

import jax
import numpy as np
from conftest import random_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import CHAT_TEMPLATE, bpe_tokenizer  # noqa: E402

from jaxformer import DecoderConfig  # noqa: E402
from jaxformer.convert import save_hf  # noqa: E402
from jaxformer.text import Tokenizer, save_tokenizer  # noqa: E402

TOKENIZER = Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
                      chat_template=CHAT_TEMPLATE)
CONFIG = DecoderConfig(vocab_size=TOKENIZER.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)


def params(change=None) -> dict:
    """The checkpoint's weights (random, scale 0.2), as numpy arrays changed in place by
    `change(params)` if given."""
    tree = jax.tree.map(np.array, random_params(CONFIG, seed=0, scale=0.2))
    if change is not None:
        change(tree)
    return tree


def checkpoint_and_text(root: Path, text: str) -> Path:
    """`root`, now holding `checkpoint/` (`save_checkpoint`) and `text.txt` (`text`)."""
    save_checkpoint(root / "checkpoint")
    (root / "text.txt").write_text(text)
    return root


def save_checkpoint(path: Path, weights=None) -> Path:
    """`path`, now a checkpoint folder of `weights` (default `params()`) and the tokenizer:
    exactly the files an export writes."""
    save_hf(CONFIG, params() if weights is None else weights, str(path), bos_id=TOKENIZER.bos_id,
            eos_id=TOKENIZER.eos_id, pad_id=TOKENIZER.pad_id)
    save_tokenizer(TOKENIZER, str(path))
    return path
