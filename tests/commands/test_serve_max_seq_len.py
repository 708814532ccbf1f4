"""`jaxformer-serve` sizes its context from config.json and the free memory, before a weight is read."""

import math
import types

import jax.numpy as jnp
import pytest

from jaxformer import DecoderConfig
from jaxformer.commands import serve

CONFIG = DecoderConfig(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=64, max_seq_len=65536)
ARGS = dict(checkpoint="ckpt", max_batch=4, prefill_chunk=64)
# The tied embedding; per layer q and o, k and v, SwiGLU's three matrices and two norms; the final norm.
PARAMS = 512 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * CONFIG.ffn_dim + 2 * 64) + 64


def free(monkeypatch, nbytes: int | None) -> None:
    monkeypatch.setattr(serve, "free_bytes", lambda: None if nbytes is None else (nbytes, "the host"))


def direct_bytes(length: int) -> int:
    """The weights, 2 x 4 + 1 rows of float32 k and v, and one 64-token chunk's prefill work."""
    weights = 4 * PARAMS
    row = 2 * 2 * length * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads of 16
    work = serve.prefill_bytes(CONFIG, 1, 64, length) - row
    return weights + 9 * row + work


def test_serving_bytes_is_the_sum_of_its_parts():
    assert serve.serving_bytes(CONFIG, 4096, 4, 64) == direct_bytes(4096)


def test_without_max_seq_len_the_largest_fitting_multiple_of_256_is_chosen_and_said(monkeypatch):
    usable = direct_bytes(10 * 256) + direct_bytes(11 * 256) >> 1  # between 2,560 and 2,816 positions
    free(monkeypatch, math.ceil(usable / serve.USABLE))
    length, said = serve.choose_max_seq_len(CONFIG, types.SimpleNamespace(max_seq_len=None, **ARGS))
    assert length == 2560
    assert "max_seq_len 2,560 (the checkpoint allows 65,536" in said and "pass --max-seq-len" in said


def test_a_context_that_fits_is_taken_as_it_is(monkeypatch):
    free(monkeypatch, 2 * direct_bytes(65536))
    assert serve.choose_max_seq_len(CONFIG, types.SimpleNamespace(max_seq_len=None, **ARGS)) == (65536, None)
    free(monkeypatch, None)  # nothing known of the memory: nothing refused
    assert serve.choose_max_seq_len(CONFIG, types.SimpleNamespace(max_seq_len=None, **ARGS)) == (65536, None)


def test_a_max_seq_len_that_does_not_fit_is_refused_naming_the_largest_that_does(monkeypatch):
    free(monkeypatch, math.ceil(direct_bytes(1024) / serve.USABLE))
    with pytest.raises(ValueError, match=r"--max-seq-len 8,192 needs about .* the largest that fits is 1,024$"):
        serve.choose_max_seq_len(CONFIG.replace(max_seq_len=8192), types.SimpleNamespace(max_seq_len=8192, **ARGS))


def test_when_nothing_fits_the_refusal_names_max_batch(monkeypatch):
    free(monkeypatch, 1000)
    with pytest.raises(ValueError, match="do not fit .* try a smaller --max-batch"):
        serve.choose_max_seq_len(CONFIG, types.SimpleNamespace(max_seq_len=None, **ARGS))


def test_the_weights_count_in_their_stored_dtype():
    half = CONFIG.replace(param_dtype=jnp.bfloat16)
    assert serve.serving_bytes(CONFIG, 256, 1, 64) - serve.serving_bytes(half, 256, 1, 64) == 2 * PARAMS
