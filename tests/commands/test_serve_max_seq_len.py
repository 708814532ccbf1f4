"""`jaxformer-serve` sizes its context from config.json and the free memory, before a weight is read."""

import dataclasses
import math
import types

import jax.numpy as jnp
import pytest

from jaxformer import DecoderConfig
from jaxformer.command_line import check_quantization
from jaxformer.commands import serve
from jaxformer.experts import ExpertsSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.layers import layer_specs
from jaxformer.quantized import Quantization

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


# A mixture of experts of CONFIG's shape: layer 0 routes each token to 2 of 8 experts 256 wide, beside a shared
# expert 64 wide; layer 1 is a gated MLP 128 wide. The experts' activations are wider than CONFIG.ffn_dim's MLP.
EXPERTS = ExpertsSpec(8, 2, 256, shared_width=64)
MOE = CONFIG.replace(layers=(dataclasses.replace(layer_specs(CONFIG)[0], ffn=EXPERTS),
                             dataclasses.replace(layer_specs(CONFIG)[1], ffn=GatedMLPSpec(128))))
# The tied embedding; per layer q and o, k and v and two norms; layer 0's router, its experts' three matrices
# each and its shared expert's three, layer 1's three; the final norm.
MOE_PARAMS = (512 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 2 * 64) + 64 * 8 + 8 * 3 * 64 * 256 + 3 * 64 * 64
              + 3 * 64 * 128 + 64)


def test_a_mixture_of_experts_prefill_counts_each_layers_own_feed_forward():
    """2 rows of 16 tokens into 16 slots: the experts' phase is the largest, a token's 2 experts' gate, up and
    their product, 256 wide each, its router's 8 logits and its shared expert's 3 x 64, all float32; on top of
    the cache and the residual stream. (Read as `CONFIG.ffn_dim`, 192 wide, the attention's phase would be.)"""
    rows = 2 * 16
    cache = 2 * 2 * 2 * 16 * 2 * 16 * 4  # 2 layers' k and v, 2 rows of 16 slots, 2 kv heads of 16, float32
    stream = 2 * rows * 64 * 4
    experts = 3 * rows * 2 * 256 * 4 + rows * 8 * 4 + 3 * rows * 64 * 4
    assert serve.prefill_bytes(MOE, 2, 16, 16) == cache + stream + experts


def test_serving_bytes_of_a_mixture_of_experts_counts_every_expert():
    """Every expert's weights are held (E x 3 x d_model x width), though a token reads 2 of them."""
    row = 2 * 2 * 4096 * 2 * 16 * 4
    work = serve.prefill_bytes(MOE, 1, 64, 4096) - row
    assert serve.serving_bytes(MOE, 4096, 4, 64) == 4 * MOE_PARAMS + 9 * row + work


def test_each_layers_own_heads_count_in_its_cache_and_the_widest_in_the_prefill():
    """A layer of one kv head 64 wide (Gemma 4's global layers' form) keeps 2 x 64 x 1 x 64 float32 a row, and
    its attention, the widest, is the prefill's largest phase: q, k, v of 6 heads x 64 and RoPE tables 32 wide
    where CONFIG's layers have 8 x 16 and 8 (the float32 scores, 4 heads x 64 x 64, and the mask, the same).
    A layer that reads another's keys and values keeps nothing, and holds no k or v projection."""
    wide = dataclasses.replace(layer_specs(CONFIG)[1].mixer, n_kv_head=1, head_dim=64)
    shared = dataclasses.replace(layer_specs(CONFIG)[1].mixer, kv_shared=True)
    wider, sharing = (CONFIG.replace(layers=(layer_specs(CONFIG)[0], dataclasses.replace(layer_specs(CONFIG)[1],
                                                                                         mixer=mixer)))
                      for mixer in (wide, shared))
    rows = 64
    cache_of = {"config": 2 * 64 * 2 * 16 * 4, "wide": 2 * 64 * 1 * 64 * 4}  # one row's layer 1, 64 slots
    attention_of = {name: 2 * rows * (4 + 2 * kv) * width * 4 + 2 * (64 + rows) * (width // 2) * 4
                    for name, kv, width in (("config", 2, 16), ("wide", 1, 64))}
    assert serve.prefill_bytes(wider, 1, 64, 64) - serve.prefill_bytes(CONFIG, 1, 64, 64) == (
        cache_of["wide"] - cache_of["config"] + attention_of["wide"] - attention_of["config"])
    assert serve.prefill_bytes(CONFIG, 1, 64, 64) - serve.prefill_bytes(sharing, 1, 64, 64) == cache_of["config"]
    projections = 2 * 64 * 2 * 16 * 4  # its k and v, float32
    assert serve.serving_bytes(CONFIG, 64, 4, 64) - serve.serving_bytes(sharing, 64, 4, 64) == (
        9 * cache_of["config"] + projections)


# CONFIG's matrices, each layer's: q and o 64 x 64, k and v 64 x 32, SwiGLU's three 64 x ffn_dim; and their
# output channels (a scale each in int8).
MATRICES = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * CONFIG.ffn_dim
OUTPUTS = 64 + 32 + 32 + 64 + 2 * CONFIG.ffn_dim + 64


def test_quantized_weights_count_their_bits_and_their_scales(monkeypatch):
    """--quantize: each matrix's values at their bits (an int4 or nf4 value half a byte: XLA packs them on a
    CPU too), its float32 scales (int8's per output channel, nf4's per 32 inputs), the rest float32; the
    context chosen by them."""
    rest = 4 * (PARAMS - 2 * MATRICES)
    int8 = check_quantization(CONFIG, Quantization("int8"))
    assert int8 == rest + 2 * (MATRICES + 4 * OUTPUTS)
    assert check_quantization(CONFIG, Quantization("nf4", 32)) == rest + 2 * (MATRICES // 2 + 4 * MATRICES // 32)
    assert check_quantization(CONFIG, None) is None
    assert serve.serving_bytes(CONFIG, 4096, 4, 64, int8) == direct_bytes(4096) - 4 * PARAMS + int8
    # Memory that holds 2,816 positions beside the int8 weights: the float32 weights leave room for 2,560.
    free(monkeypatch, math.ceil(serve.serving_bytes(CONFIG, 2816, 4, 64, int8) / serve.USABLE))
    args = types.SimpleNamespace(max_seq_len=None, **ARGS)
    assert serve.choose_max_seq_len(CONFIG, args, int8)[0] == 2816
    assert serve.choose_max_seq_len(CONFIG, args)[0] == 2560
