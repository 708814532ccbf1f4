"""The fault matrix: every bad input the library must refuse, and the look-alikes it must take.

The rule: bad input gets a `ValueError`, raised on the host before anything is traced or
compiled, naming the argument (config field, file) and its limit; and what numpy users
pass (`np.int64(3)`, `np.float32(0.5)`, `np.bool_(True)`) is taken as the Python value it
stands for, giving the same result and reusing the same compiled programs.

Sections:
  API cases: `API_CASES` (`test_api_refuses`): one short call per bad input, with the
    pattern its message must match; `ACCEPTED_CASES` (`test_api_accepts_numpy_scalars`):
    a numpy-typed call and its plain-Python twin, which must agree.
  File cases: `FILE_CASES` (`test_load_hf_refuses`): a checkpoint folder written by
    `save_hf`, damaged one way each; the message must name the file and the field.
  CLI cases: `train.reverse` and `train.lm`. `RUN_DIR_REFUSALS` run in this process
    (`run_in_process`, which sees all a subprocess's stderr would) against damaged copies
    of one finished run (exit 2, one stderr line, the directory unchanged byte for byte);
    `FLAG_REFUSALS` through `main(argv)`, before a device is touched; and runs killed with
    SIGKILL mid-run and mid-checkpoint (one also with its newest checkpoint cut short)
    resume to bitwise the losses they had logged.

Every case is cheap: one tiny decoder and one tiny encoder-decoder (vocab 32, d_model 16,
one layer) are built once and shared, and a refusal happens before `jit`, so the API
cases compile nothing but the two shared decoding loops of the accepted cases.
"""

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import count_compiles, run_main
from harness import (
    CLI_TINY,
    committed_steps,
    kill_when,
    logged_losses,
    mid_checkpoint,
    mid_run,
    run_in_process,
    shared_finished_run,
    snapshot,
    start_cli,
)

from jaxformer import Decoder, DecoderConfig, KVCache, VanillaConfig, VanillaTransformer, generate
from jaxformer.convert import config_from_hf, load_hf, save_hf
from jaxformer.decoding.sampling import check_temperature, check_top_k, check_top_p
from jaxformer.sharding import make_mesh
from train import lm, reverse

TINY = DecoderConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=16)
TINY_VANILLA = VanillaConfig(src_vocab_size=32, tgt_vocab_size=32, n_layer=1, d_model=16, d_ff=32, n_head=2,
                             max_seq_len=16)
TOKENS = np.ones((2, 4), np.int32)  # a valid [batch, T]


@functools.cache
def _decoder():
    model = Decoder(TINY)
    return model, jax.jit(model.init)(jax.random.key(0), *model.init_inputs())["params"]  # one compile, not one per op


@functools.cache
def _vanilla():
    model = VanillaTransformer(TINY_VANILLA)
    return model, jax.jit(model.init)(jax.random.key(0), *model.init_inputs())["params"]


def _call(build, *args, method="__call__", jit=False, **kwargs):
    """`model.apply` of the shared model `build()` makes, optionally under `jax.jit`."""
    model, params = build()
    apply = functools.partial(model.apply, {"params": params}, method=method, **kwargs)
    return (jax.jit(apply) if jit else apply)(*args)


def _generate(build=_decoder, prompt=TOKENS, **options):
    model, params = build()
    return generate(model, params, prompt, **{"max_new_tokens": 3, **options})


def _decoder_step(tokens):
    return _call(_decoder, tokens, KVCache.create(TINY, 2, 8), None, method="decode_step")


def _vanilla_step(tokens):
    return _call(_vanilla, tokens, _vanilla()[0].init_cache(2, 8), (None, TOKENS), method="decode_step")


# ---------------------------------------------------------------------------------------
# API cases
# ---------------------------------------------------------------------------------------

API_CASES = [
    # Config fields: the kind of each, then its range; named `ClassName.field`.
    pytest.param(lambda: DecoderConfig(rope_theta="abc"), r"DecoderConfig\.rope_theta must be a finite number",
                 id="decoder-config-rope_theta-str"),
    pytest.param(lambda: DecoderConfig(rope_theta=float("inf")), r"DecoderConfig\.rope_theta must be ",
                 id="decoder-config-rope_theta-inf"),
    pytest.param(lambda: DecoderConfig(norm_eps=float("nan")), r"DecoderConfig\.norm_eps must be ",
                 id="decoder-config-norm_eps-nan"),
    pytest.param(lambda: DecoderConfig(norm_eps=None), r"DecoderConfig\.norm_eps must be ",
                 id="decoder-config-norm_eps-none"),
    pytest.param(lambda: DecoderConfig(n_layer=True), r"DecoderConfig\.n_layer must be a positive int \(got True\)",
                 id="decoder-config-n_layer-bool"),
    pytest.param(lambda: DecoderConfig(n_layer=None), r"DecoderConfig\.n_layer must be a positive int",
                 id="decoder-config-n_layer-none"),
    pytest.param(lambda: DecoderConfig(vocab_size="256"), r"DecoderConfig\.vocab_size must be ",
                 id="decoder-config-vocab_size-str"),
    pytest.param(lambda: DecoderConfig(n_head=np.float32(8)), r"DecoderConfig\.n_head must be ",
                 id="decoder-config-n_head-float"),
    pytest.param(lambda: DecoderConfig(n_kv_head=np.int64(0)), r"DecoderConfig\.n_kv_head must be ",
                 id="decoder-config-n_kv_head-zero"),
    pytest.param(lambda: DecoderConfig(d_model=256.0), r"DecoderConfig\.d_model must be ",
                 id="decoder-config-d_model-float"),
    pytest.param(lambda: DecoderConfig(max_seq_len=np.bool_(True)), r"DecoderConfig\.max_seq_len must be ",
                 id="decoder-config-max_seq_len-np-bool"),
    pytest.param(lambda: DecoderConfig(d_ff=2.5), r"DecoderConfig\.d_ff must be None or a positive int",
                 id="decoder-config-d_ff-float"),
    pytest.param(lambda: DecoderConfig(head_dim_override=True), r"DecoderConfig\.head_dim_override must be ",
                 id="decoder-config-head_dim_override-bool"),
    pytest.param(lambda: DecoderConfig(tie_embeddings=1), r"DecoderConfig\.tie_embeddings must be a bool",
                 id="decoder-config-tie_embeddings-int"),
    pytest.param(lambda: DecoderConfig(qkv_bias="no"), r"DecoderConfig\.qkv_bias must be a bool",
                 id="decoder-config-qkv_bias-str"),
    pytest.param(lambda: DecoderConfig(rope_pairing=None), r"DecoderConfig\.rope_pairing must be one of",
                 id="decoder-config-rope_pairing-none"),
    pytest.param(lambda: DecoderConfig(cache_dtype="int8"), r"DecoderConfig\.cache_dtype must be a floating dtype",
                 id="decoder-config-cache_dtype-int8"),
    pytest.param(lambda: VanillaConfig(src_vocab_size=1.5, tgt_vocab_size=10),
                 r"VanillaConfig\.src_vocab_size must be ",
                 id="vanilla-config-src_vocab_size-float"),
    pytest.param(lambda: TINY_VANILLA.replace(tgt_vocab_size=None), r"VanillaConfig\.tgt_vocab_size must be ",
                 id="vanilla-config-tgt_vocab_size-none"),
    pytest.param(lambda: TINY_VANILLA.replace(d_ff="32"), r"VanillaConfig\.d_ff must be ",
                 id="vanilla-config-d_ff-str"),
    pytest.param(lambda: TINY_VANILLA.replace(dropout="0.1"),
                 r"VanillaConfig\.dropout must be a finite number in \[0, 1\)",
                 id="vanilla-config-dropout-str"),
    pytest.param(lambda: TINY_VANILLA.replace(dropout=float("nan")), r"VanillaConfig\.dropout must be ",
                 id="vanilla-config-dropout-nan"),
    pytest.param(lambda: TINY_VANILLA.replace(pad_id=True), r"VanillaConfig\.pad_id must be an int >= 0 \(got True\)",
                 id="vanilla-config-pad_id-bool"),
    pytest.param(lambda: TINY_VANILLA.replace(pad_id=np.int64(32)),
                 r"VanillaConfig\.pad_id must be an id below .*=32 \(got 32\)",
                 id="vanilla-config-pad_id-out-of-range"),
    pytest.param(lambda: TINY_VANILLA.replace(norm_eps=-float("inf")), r"VanillaConfig\.norm_eps must be ",
                 id="vanilla-config-norm_eps-inf"),
    pytest.param(lambda: TINY_VANILLA.replace(norm_first=None), r"VanillaConfig\.norm_first must be a bool",
                 id="vanilla-config-norm_first-none"),
    pytest.param(lambda: TINY_VANILLA.replace(final_norm=0), r"VanillaConfig\.final_norm must be None or a bool",
                 id="vanilla-config-final_norm-int"),
    # The KV cache: a non-floating storage would round every key and value.
    *[pytest.param(lambda dtype=dtype: KVCache.create(TINY, 1, 8, dtype=dtype),
                   r"KVCache.create: dtype must be a floating dtype", id=f"kvcache-dtype-{jnp.dtype(dtype).name}")
      for dtype in (jnp.int8, jnp.uint8, jnp.bool_)],
    pytest.param(lambda: KVCache.create(TINY, True), r"KVCache.create: batch_size must be a positive int",
                 id="kvcache-batch_size-bool"),
    pytest.param(lambda: KVCache.create(TINY, 1, np.float32(8)), r"KVCache.create: capacity must be an int in "
                 r"\[1, max_seq_len=16\]", id="kvcache-capacity-float"),
    pytest.param(lambda: _vanilla()[0].init_cache(2, 17), r"capacity must be an int in \[1, max_seq_len=16\]",
                 id="vanilla-init_cache-capacity"),
    # Token arrays: `[batch, T]` integers, refused before the model unpacks them, under jit too.
    *[pytest.param(lambda shape=shape: _call(_decoder, np.zeros(shape, np.int32)),
                   rf"tokens must be 2-D \[batch, T\], got shape {re.escape(str(shape))}",
                   id=f"decoder-tokens-rank-{len(shape)}")
      for shape in ((), (4,), (2, 4, 1))],
    pytest.param(lambda: _call(_decoder, np.zeros(4, np.int32), jit=True), r"tokens must be 2-D \[batch, T\]",
                 id="decoder-tokens-rank-1-jit"),
    pytest.param(lambda: _call(_decoder, TOKENS.astype(np.float32)), "tokens must hold integer token ids",
                 id="decoder-tokens-float"),
    pytest.param(lambda: _call(_decoder, TOKENS.astype(np.float32), jit=True), "tokens must hold integer token ids",
                 id="decoder-tokens-float-jit"),
    pytest.param(lambda: _decoder_step(np.zeros(2, np.int32)), r"tokens must be 2-D \[batch, T\]",
                 id="decoder-decode_step-rank-1"),
    pytest.param(lambda: _call(_vanilla, np.zeros(4, np.int32), TOKENS), r"src must be 2-D \[batch, T\]",
                 id="vanilla-src-rank-1"),
    pytest.param(lambda: _call(_vanilla, TOKENS, np.zeros((2, 4, 1), np.int32), jit=True),
                 r"tgt_in must be 2-D \[batch, T\]", id="vanilla-tgt_in-rank-3-jit"),
    pytest.param(lambda: _call(_vanilla, np.int32(3), TOKENS, jit=True), r"src must be 2-D \[batch, T\]",
                 id="vanilla-src-rank-0-jit"),
    pytest.param(lambda: _call(_vanilla, np.zeros(4, np.int32), method="encode"), r"src must be 2-D",
                 id="vanilla-encode-rank-1"),
    pytest.param(lambda: _call(_vanilla, np.zeros(4, np.int32), None, TOKENS, method="decode"), r"tgt_in must be 2-D",
                 id="vanilla-decode-tgt_in-rank-1"),
    pytest.param(lambda: _call(_vanilla, TOKENS, None, np.zeros(4, np.int32), method="decode"), r"src must be 2-D",
                 id="vanilla-decode-src-rank-1"),
    pytest.param(lambda: _call(_vanilla, np.zeros(4, np.int32), method="decode_context"), r"src must be 2-D",
                 id="vanilla-decode_context-rank-1"),
    pytest.param(lambda: _vanilla_step(np.zeros(2, np.int32)), r"tgt_in must be 2-D", id="vanilla-decode_step-rank-1"),
    # generate's integers: any integral scalar but a bool, in range.
    pytest.param(lambda: _generate(max_new_tokens=True), r"max_new_tokens must be a positive int \(got True\)",
                 id="generate-max_new_tokens-bool"),
    pytest.param(lambda: _generate(max_new_tokens=3.0), "max_new_tokens must be a positive int",
                 id="generate-max_new_tokens-float"),
    pytest.param(lambda: _generate(max_new_tokens=np.int64(0)), "max_new_tokens must be a positive int",
                 id="generate-max_new_tokens-zero"),
    pytest.param(lambda: _generate(eos_id=np.int32(32)), r"eos_id must be an int in \[0, vocab_size - 1=31\]",
                 id="generate-eos_id-out-of-range"),
    pytest.param(lambda: _generate(eos_id=2.0), "eos_id must be an int", id="generate-eos_id-float"),
    pytest.param(lambda: _generate(eos_id=[2, 40]), r"eos_id\[1\] must be an int in \[0, vocab_size - 1=31\]",
                 id="generate-eos_ids-out-of-range"),
    pytest.param(lambda: _generate(eos_id=[]), "eos_id must be an id, a non-empty sequence",
                 id="generate-eos_ids-empty"),
    pytest.param(lambda: _generate(pad_id=True), "pad_id must be an int", id="generate-pad_id-bool"),
    pytest.param(lambda: _generate(_vanilla, bos_id="1"), "bos_id must be an int", id="generate-bos_id-str"),
    pytest.param(lambda: _generate(num_beams=np.float64(2)), "num_beams must be a positive int",
                 id="generate-num_beams-float"),
    pytest.param(lambda: _generate(num_beams=2, length_penalty="0.6"), "length_penalty must be a finite number >= 0",
                 id="generate-length_penalty-str"),
    pytest.param(lambda: _generate(num_beams=2, length_penalty=np.float32("nan")), "length_penalty",
                 id="generate-length_penalty-nan"),
    # Sampling knobs: one check each, reusable under a flag's name.
    pytest.param(lambda: _generate(temperature="0.5"), "temperature must be a number", id="generate-temperature-str"),
    pytest.param(lambda: _generate(temperature=np.float32("inf")), "temperature must be >= 0 and finite",
                 id="generate-temperature-inf"),
    pytest.param(lambda: _generate(top_k=np.float32(2.5)), r"top_k must be None or an int in \[1, vocab_size=32\]",
                 id="generate-top_k-fraction"),
    pytest.param(lambda: _generate(top_k=True), "top_k must be a number", id="generate-top_k-bool"),
    pytest.param(lambda: _generate(top_p=np.float32(0)), r"top_p must be None or in \(0, 1\]",
                 id="generate-top_p-zero"),
    pytest.param(lambda: _generate(top_p="0.9"), "top_p must be a number", id="generate-top_p-str"),
    pytest.param(lambda: check_temperature(-1, name="--temperature"), "--temperature must be >= 0",
                 id="check_temperature-flag-name"),
    pytest.param(lambda: check_top_k(0, None, name="--top-k"), r"--top-k must be None or an int >= 1 \(got 0\)",
                 id="check_top_k-flag-name"),
    pytest.param(lambda: check_top_p(1.5, name="--top-p"), r"--top-p must be None or in \(0, 1\]",
                 id="check_top_p-flag-name"),
    # The other integral arguments.
    pytest.param(lambda: make_mesh(model=True), "make_mesh: model must be a positive int", id="make_mesh-model-bool"),
    pytest.param(lambda: make_mesh(data=1.0), "make_mesh: data", id="make_mesh-data-float"),
    pytest.param(lambda: config_from_hf({}, max_seq_len="64"), "max_seq_len must be a positive int",
                 id="config_from_hf-max_seq_len-str"),
]


@pytest.mark.parametrize("call, match", API_CASES)
def test_api_refuses(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _decoder_config(as_numpy):
    n = np.int64 if as_numpy else int
    x = np.float32 if as_numpy else float
    b = np.bool_ if as_numpy else bool
    return DecoderConfig(vocab_size=n(32), n_layer=n(1), n_head=n(2), n_kv_head=n(1), d_model=n(16),
                         max_seq_len=n(16), rope_theta=x(500.0), norm_eps=x(0.5), d_ff=n(24), tie_embeddings=b(False),
                         head_dim_override=n(8), qkv_bias=b(True), rope_pairing="interleaved")


def _vanilla_config(as_numpy):
    n = np.int32 if as_numpy else int
    x = np.float64 if as_numpy else float
    b = np.bool_ if as_numpy else bool
    return VanillaConfig(src_vocab_size=n(32), tgt_vocab_size=n(32), n_layer=n(1), d_model=n(16), d_ff=n(32),
                         n_head=n(2), dropout=x(0.25), pad_id=n(3), max_seq_len=n(16), norm_first=b(True),
                         tie_embeddings=b(True), norm_eps=x(0.5), final_norm=b(False))


ACCEPTED_CASES = [
    pytest.param(lambda: _decoder_config(True), lambda: _decoder_config(False), id="decoder-config"),
    pytest.param(lambda: _vanilla_config(True), lambda: _vanilla_config(False), id="vanilla-config"),
    pytest.param(lambda: KVCache.create(TINY, np.int64(2), np.int32(8)), lambda: KVCache.create(TINY, 2, 8),
                 id="kvcache-numpy-ints"),
    *[pytest.param(lambda dtype=dtype: KVCache.create(TINY, 1, 4, dtype=dtype).layers[0].k.dtype,
                   lambda dtype=dtype: jnp.dtype(dtype), id=f"kvcache-{jnp.dtype(dtype).name}")
      for dtype in (jnp.float16, jnp.bfloat16, "bfloat16")],
    pytest.param(lambda: _generate(max_new_tokens=np.int64(3), eos_id=np.int32(2), pad_id=np.int64(1),
                                   temperature=np.float32(0.7), top_k=np.int64(5), top_p=np.float32(0.9),
                                   key=jax.random.key(1)),
                 lambda: _generate(max_new_tokens=3, eos_id=2, pad_id=1, temperature=0.7, top_k=5, top_p=0.9,
                                   key=jax.random.key(1)), id="generate-sampling"),
    pytest.param(lambda: _generate(_vanilla, bos_id=np.uint8(1), num_beams=np.int64(2),
                                   length_penalty=np.float32(0.5)),
                 lambda: _generate(_vanilla, bos_id=1, num_beams=2, length_penalty=0.5), id="generate-beams"),
    pytest.param(lambda: check_top_k(np.int64(3), 32), lambda: np.asarray(3, np.int32), id="check_top_k"),
    pytest.param(lambda: make_mesh(np.int64(jax.device_count()), np.int64(1)).shape,
                 lambda: make_mesh(jax.device_count(), 1).shape, id="make_mesh"),
    pytest.param(lambda: config_from_hf(_hf_config(), max_seq_len=np.int64(8)),
                 lambda: config_from_hf(_hf_config(), max_seq_len=8), id="config_from_hf-max_seq_len"),
]


def _hf_config() -> dict:
    return {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": TINY.ffn_dim,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 16, "rms_norm_eps": TINY.norm_eps}


def _assert_same(got, want):
    if isinstance(got, (DecoderConfig, VanillaConfig)):
        assert got == want and hash(got) == hash(want)
        # Plain Python values, so asdict serialises (dtypes aside) and the fields compare by type too.
        types = [[type(v) for v in dataclasses.asdict(config).values()] for config in (got, want)]
        assert types[0] == types[1]
        return
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("numpy_call, python_call", ACCEPTED_CASES)
def test_api_accepts_numpy_scalars(numpy_call, python_call):
    _assert_same(numpy_call(), python_call())


def test_numpy_max_new_tokens_reuses_the_compiled_loop():
    """`max_new_tokens` and `num_beams` are static: read as plain ints, np.int64(3) and 3
    are one program, not two."""
    want = _generate(max_new_tokens=np.int64(3))
    with count_compiles() as compiles:
        got = _generate(max_new_tokens=3)
    np.testing.assert_array_equal(got, want)
    assert compiles == []


# ---------------------------------------------------------------------------------------
# File cases: load_hf on a damaged checkpoint folder
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A good checkpoint folder of the tiny decoder, written by save_hf."""
    path = tmp_path_factory.mktemp("checkpoint")
    save_hf(TINY, _decoder()[1], str(path))
    return path


def _edit_json(path, change):
    with open(path) as f:
        data = json.load(f)
    change(data)
    with open(path, "w") as f:
        json.dump(data, f)


def _write(path, content: bytes):
    with open(path, "wb") as f:
        f.write(content)


def _truncate(path, end: int):
    """Keeps the bytes before `end` (a negative `end` counts from the end)."""
    with open(path, "rb") as f:
        data = f.read()
    _write(path, data[:end])


def _bad_header(path):
    """A header of the stated length that is not JSON."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    _write(path, data[:8] + b"{" * n + data[8 + n:])


def _stored_as(path, key: str, dtype):
    """`key` rewritten in `dtype` (an int8 weight, as a quantised checkpoint holds)."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(path)
    save_file({**tensors, key: tensors[key].astype(dtype)}, path)


def _edit_json_text(path, text: str):
    with open(path, "w") as f:
        f.write(text)


def _shards(folder, weight_map):
    """The single file replaced by an index naming `weight_map`'s shards."""
    os.remove(folder / "model.safetensors")
    _edit_json_text(folder / "model.safetensors.index.json", json.dumps({"weight_map": weight_map}))


def _replace_with_a_file(folder):
    shutil.rmtree(folder)
    _write(folder, b"{}")


REQUIRED_FIELDS = ["hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                   "rms_norm_eps", "max_position_embeddings"]

FILE_CASES = [
    *[pytest.param(lambda folder, key=key: _edit_json(folder / "config.json", lambda hf: hf.pop(key)),
                   ValueError, rf"config\.json {key}: missing", id=f"config-{key}-missing")
      for key in REQUIRED_FIELDS],
    pytest.param(lambda folder: _edit_json(folder / "config.json", lambda hf: hf.update(hidden_size="16")),
                 ValueError, r"config\.json hidden_size: must be a positive int \(got '16'\)",
                 id="config-hidden_size-str"),
    pytest.param(lambda folder: _edit_json(folder / "config.json", lambda hf: hf.update(num_key_value_heads=0)),
                 ValueError, r"config\.json num_key_value_heads: must be a positive int", id="config-kv-heads-zero"),
    pytest.param(lambda folder: _edit_json(folder / "config.json", lambda hf: hf.update(rms_norm_eps="x")),
                 ValueError, r"config\.json rms_norm_eps: must be a finite number > 0", id="config-rms_norm_eps-str"),
    pytest.param(lambda folder: _edit_json(folder / "config.json", lambda hf: hf["rope_parameters"].update(
        rope_theta=-1.0)), ValueError, r"config\.json rope_parameters\.rope_theta: must be a finite number > 0",
                 id="config-rope_theta-negative"),
    pytest.param(lambda folder: _edit_json(folder / "config.json", lambda hf: hf.update(rope_parameters="default")),
                 ValueError, r"config\.json rope_parameters: must be an object", id="config-rope_parameters-str"),
    pytest.param(lambda folder: _edit_json(folder / "config.json", lambda hf: hf.update(tie_word_embeddings="false")),
                 ValueError, r"config\.json tie_word_embeddings: must be true or false", id="config-tie-str"),
    pytest.param(lambda folder: _edit_json_text(folder / "config.json", '{"hidden_size": '),
                 ValueError, r"config\.json is not valid JSON \(", id="config-invalid-json"),
    pytest.param(lambda folder: _edit_json_text(folder / "config.json", "[1, 2]"),
                 ValueError, "config.json holds a list, not a model config", id="config-not-an-object"),
    pytest.param(lambda folder: os.remove(folder / "config.json"),
                 FileNotFoundError, r"config\.json: missing", id="config-missing"),
    pytest.param(lambda folder: _truncate(folder / "model.safetensors", -10),
                 ValueError, r"model\.safetensors: not a readable safetensors file \(.*incomplete",
                 id="safetensors-truncated"),
    pytest.param(lambda folder: _truncate(folder / "model.safetensors", 5),
                 ValueError, r"model\.safetensors: not a readable safetensors file", id="safetensors-truncated-header"),
    pytest.param(lambda folder: _write(folder / "model.safetensors", b"garbage bytes, not tensors" * 4),
                 ValueError, r"model\.safetensors: not a readable safetensors file", id="safetensors-garbage"),
    pytest.param(lambda folder: _bad_header(folder / "model.safetensors"),
                 ValueError, r"model\.safetensors: not a readable safetensors file \(.*JSON",
                 id="safetensors-bad-header"),
    pytest.param(lambda folder: _stored_as(folder / "model.safetensors", "model.norm.weight", np.int8),
                 ValueError, r"model\.safetensors: model\.norm\.weight is stored as I8; only floating tensors",
                 id="safetensors-int8-tensor"),
    pytest.param(lambda folder: _edit_json_text(folder / "model.safetensors.index.json", "{oops"),
                 ValueError, r"model\.safetensors\.index\.json is not valid JSON", id="index-invalid-json"),
    pytest.param(lambda folder: _edit_json_text(folder / "model.safetensors.index.json", '{"metadata": {}}'),
                 ValueError, r"model\.safetensors\.index\.json: weight_map must map", id="index-no-weight_map"),
    pytest.param(lambda folder: _shards(folder, {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}),
                 FileNotFoundError, r"model-00001-of-00002\.safetensors: missing", id="index-shard-missing"),
    pytest.param(lambda folder: os.remove(folder / "model.safetensors"),
                 FileNotFoundError, "no model.safetensors or model.safetensors.index.json", id="weights-missing"),
    pytest.param(lambda folder: shutil.rmtree(folder), FileNotFoundError, "no such checkpoint folder",
                 id="folder-missing"),
    pytest.param(_replace_with_a_file, ValueError, "path must be a checkpoint folder", id="folder-is-a-file"),
]


@pytest.mark.parametrize("damage, error, match", FILE_CASES)
def test_load_hf_refuses(checkpoint, tmp_path, damage, error, match):
    folder = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, folder)
    damage(folder)
    with pytest.raises(error, match=match) as raised:
        load_hf(str(folder))
    assert str(folder) in str(raised.value)  # the message names the file's folder, whatever else it says


def test_the_undamaged_checkpoint_loads(checkpoint):
    """The file cases' baseline: the folder they damage loads as written."""
    config, params = load_hf(str(checkpoint))
    assert config == TINY.replace(d_ff=TINY.ffn_dim, hf_model_type="llama")
    jax.tree.map(np.testing.assert_array_equal, params, _decoder()[1])


# ---------------------------------------------------------------------------------------
# The CLI cases: the training commands as a user runs them (in a process of their own
# where a process is killed, else in this one).

def damage_data_file(checkpoint: Path) -> None:
    """Truncates the largest array file of a checkpoint (a disk that filled up mid-copy)."""
    largest = max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])


def garble_metadata(checkpoint: Path) -> None:
    (checkpoint / "default" / "_METADATA").write_text("{garbled")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished `train.reverse` run to step 10 (checkpoints 5 and 10), shared: copy it to change it."""
    return shared_finished_run(tmp_path_factory)


def copy_of(run_dir: Path, damage: Callable[[Path], None] | None = None) -> Callable[[Path], Path]:
    """A case's run directory: a copy of the finished run, then `damage(copy)`."""
    def make(case_dir: Path) -> Path:
        copy = case_dir / "run"
        shutil.copytree(run_dir, copy)
        if damage is not None:
            damage(copy)
        return copy
    return make


def remove_config(run: Path) -> None:
    (run / "config.json").unlink()


def garble_every_checkpoint(run: Path) -> None:
    for checkpoint in (run / "checkpoints").iterdir():
        garble_metadata(checkpoint)


def remove_checkpoints(run: Path) -> None:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()


def invalid_config(run: Path) -> None:
    (run / "config.json").write_text('{"model": ')


# Cases that read or guard a run directory, run in this process with its descriptors 1 and
# 2 captured (what orbax, asyncio or C++ might print is caught too). Each: (id, command, argv with
# {run} for the case's run directory, how to make that directory from the finished run
# (None: it does not exist), what the one stderr line must say). Every case must exit 2
# before any work, its run directory unchanged (or still absent).
RUN_DIR_REFUSALS = [
    ("resume-without-config", "reverse", ["--resume", "--run-dir", "{run}", "--d-model", "32"],
     lambda run: copy_of(run, remove_config), "holds no config.json"),
    ("resume-nothing-restores", "reverse", ["--resume", "--run-dir", "{run}", "--steps", "10", *CLI_TINY],
     lambda run: copy_of(run, garble_every_checkpoint), "no checkpoint in"),
    ("resume-no-checkpoint", "reverse", ["--resume", "--run-dir", "{run}", "--steps", "10", *CLI_TINY],
     lambda run: copy_of(run, remove_checkpoints), "holds no checkpoint"),
    ("resume-missing-dir", "reverse", ["--resume", "--run-dir", "{run}"], None, "does not exist"),
    ("resume-invalid-config", "reverse", ["--resume", "--run-dir", "{run}", *CLI_TINY],
     lambda run: copy_of(run, invalid_config), "config.json is not valid JSON"),
    ("resume-other-config", "reverse", ["--resume", "--run-dir", "{run}", *CLI_TINY, "--d-model", "64"],
     lambda run: copy_of(run), "config.json holds a different config"),
    ("resume-past-steps", "reverse", ["--resume", "--run-dir", "{run}", *CLI_TINY, "--steps", "5"],
     lambda run: copy_of(run), "--steps 5 is below step 10"),
    ("new-run-in-used-dir", "reverse", ["--run-dir", "{run}", *CLI_TINY], lambda run: copy_of(run), "is not empty"),
]


@pytest.fixture(scope="module")
def run_dir_refusals(finished_run, tmp_path_factory) -> dict:
    """Every run-directory case, one after another, in this process.

    Returns:
      `{id: (status, stderr, run_dir, snapshot before, snapshot after)}`.
    """
    results = {}
    for case_id, module, argv, prepare, _ in RUN_DIR_REFUSALS:
        case_dir = tmp_path_factory.mktemp(case_id)
        run_dir = case_dir / "run" if prepare is None else prepare(finished_run)(case_dir)
        before = snapshot(run_dir)
        done = run_in_process(module, [a.replace("{run}", str(run_dir)) for a in argv])
        results[case_id] = done.returncode, done.stderr, run_dir, before, snapshot(run_dir)
    return results


@pytest.mark.parametrize("case_id, message", [(case[0], case[4]) for case in RUN_DIR_REFUSALS],
                         ids=[case[0] for case in RUN_DIR_REFUSALS])
def test_cli_refuses_a_run_dir_in_one_line_and_changes_nothing(run_dir_refusals, case_id, message):
    returncode, stderr, run_dir, before, after = run_dir_refusals[case_id]
    assert returncode == 2, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], stderr
    assert after == before, f"{run_dir} changed"


def test_in_process_runs_catch_what_a_process_of_their_own_would():
    """`run_in_process` (the refusals above) sees what the pipes of a process would: Python's
    streams, descriptors 1 and 2 written directly (as C++ code writes), and a logging handler
    made earlier around `sys.stderr`; and afterwards all of it is as it was (a handler made
    during the run can still write)."""
    logger, handler = logging.getLogger("faults-capture"), logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logger.propagate = False
    made = []

    def main(argv):
        made.append(logging.StreamHandler(sys.stderr))
        print("python out")
        print("python err", file=sys.stderr)
        os.write(1, b"descriptor out\n")
        os.write(2, b"descriptor err\n")
        logger.warning("logged")
        sys.exit("the message")

    streams, descriptors = (sys.stdout, sys.stderr), [_file_of(fd) for fd in (1, 2)]
    try:
        done = run_main(main, [])
    finally:
        logger.removeHandler(handler)
    assert done.returncode == 1
    assert done.stdout == "python out\ndescriptor out\n"
    assert done.stderr == "python err\ndescriptor err\nlogged\nthe message\n"
    assert (sys.stdout, sys.stderr) == streams and handler.stream is streams[1]
    assert [_file_of(fd) for fd in (1, 2)] == descriptors
    assert not made[0].stream.closed


def _file_of(fd: int) -> tuple[int, int]:
    """What descriptor `fd` points at: (device, inode)."""
    stat = os.fstat(fd)
    return stat.st_dev, stat.st_ino


# Flags checked as they are parsed, before a device is touched: run in-process through
# the same `main(argv)` the command calls. {run} is a directory that must stay absent.
FLAG_REFUSALS = [
    ("run-dir-is-a-file", reverse, ["--run-dir", "{file}"], "is a file, not a directory"),
    ("run-dir-under-a-file", reverse, ["--run-dir", "{file}/run"], "cannot be created"),
    ("seed-past-31-bits", reverse, ["--run-dir", "{run}", "--seed", str(2**70)],
     "--seed must be an int in [0, 2147483647]"),
    ("seed-negative", lm, ["--run-dir", "{run}", "--seed", "-1"], "--seed must be an int in [0, 2147483647]"),
    ("top-p-0", lm, ["--run-dir", "{run}", "--top-p", "0"], "--top-p must be None or in (0, 1]"),
    ("top-p-1.5", lm, ["--run-dir", "{run}", "--top-p", "1.5"], "--top-p must be None or in (0, 1]"),
    ("top-k-0", lm, ["--run-dir", "{run}", "--top-k", "0"], "--top-k must be None or an int >= 1"),
    ("lr-0", lm, ["--run-dir", "{run}", "--lr", "0"], "--lr must be a finite number > 0"),
    ("clip-inf", lm, ["--run-dir", "{run}", "--clip", "inf"], "--clip must be a finite number > 0"),
    ("weight-decay-negative", lm, ["--run-dir", "{run}", "--weight-decay", "-1"], "--weight-decay must be a finite"),
    ("temperature-nan", lm, ["--run-dir", "{run}", "--temperature", "nan"], "--temperature must be >= 0"),
    ("mesh-syntax", reverse, ["--run-dir", "{run}", "--mesh", "data=x"], "--mesh 'data=x'"),
    ("fsdp-without-mesh", reverse, ["--run-dir", "{run}", "--fsdp"], "--fsdp needs --mesh"),
]


@pytest.mark.parametrize("demo, argv, message", [case[1:] for case in FLAG_REFUSALS],
                         ids=[case[0] for case in FLAG_REFUSALS])
def test_cli_refuses_a_flag_in_one_line_before_any_work(tmp_path, capsys, demo, argv, message):
    (tmp_path / "file").write_text("not a directory\n")
    run_dir = tmp_path / "run"
    argv = [a.replace("{run}", str(run_dir)).replace("{file}", str(tmp_path / "file")) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_cli_killed_mid_checkpoint_resumes_bitwise(tmp_path):
    """SIGKILL while a checkpoint is written: `--resume` continues from the newest finished
    one, redoes the updates after it, and logs bitwise the losses the killed run logged.
    (SIGKILL ends a process: the killed run is one of its own;
    the resume runs in this one.)"""
    run_dir = tmp_path / "run"
    argv = [*CLI_TINY, "--run-dir", str(run_dir), "--log-every", "1", "--checkpoint-every", "1"]
    kill_when(start_cli("reverse", ["--steps", "100000", *argv]), lambda: mid_checkpoint(run_dir))
    before, restored = logged_losses(run_dir), committed_steps(run_dir)[-1]
    done = run_in_process("reverse", ["--resume", "--steps", str(max(before)), *argv])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming at step {restored} of {max(before)}" in done.stdout
    assert logged_losses(run_dir) == before  # floats compared exactly


def test_cli_killed_mid_run_with_a_damaged_checkpoint_resumes_from_the_one_before(tmp_path):
    """SIGKILL between checkpoints, then the newest checkpoint cut short (a disk that filled
    up): `--resume` reports it in one line, keeps it aside, resumes from the one before
    and redoes the updates since bitwise. (SIGKILL ends a process: the killed run is
    one of its own; the resume runs in this one.)"""
    run_dir = tmp_path / "run"
    argv = [*CLI_TINY, "--run-dir", str(run_dir), "--log-every", "1", "--checkpoint-every", "10"]
    kill_when(start_cli("reverse", ["--steps", "100000", *argv]), lambda: mid_run(run_dir))
    before, (*_, older, newest) = logged_losses(run_dir), committed_steps(run_dir)
    damage_data_file(run_dir / "checkpoints" / str(newest))
    done = run_in_process("reverse", ["--resume", "--steps", str(max(before)), *argv])
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [line for line in done.stderr.splitlines() if "does not restore" in line]
    assert len(reports) == 1 and reports[0].startswith(f"checkpoint {newest} does not restore ("), done.stderr
    assert f"resuming at step {older} of {max(before)}" in done.stdout
    assert logged_losses(run_dir) == before
    assert (run_dir / "unrestorable_checkpoints" / str(newest)).is_dir()  # kept, not deleted
