"""Checkpoints that ship quantized, read as shipped: a tiny gpt-oss folder with its experts in MXFP4
(`X_blocks`, `X_scales`) and a tiny DeepSeek-V3 folder with its matrices in block FP8 (`X.weight`
float8 e4m3, `X.weight_scale_inv`), each with its `quantization_config`, written in the test as those
checkpoints ship. jaxformer's model equals the same folder dequantized in NumPy (fast tier) and
transformers' (which dequantizes both on a CPU) to 1e-3 of the largest logit, with the same greedy
tokens (full tier)."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import import_peer
from safetensors.numpy import load_file, save_file

from jaxformer import Decoder
from jaxformer.convert import config_from_hf, load_hf, save_hf
from jaxformer.quantized import QArray, format_of
from tests.families.shipped import tiny

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
TOKENS = np.array([[3, 17, 5, 42, 9, 11, 2, 30]])


def random_params(config, seed):
    shapes = jax.eval_shape(lambda: Decoder(config).init(jax.random.key(0), TOKENS))["params"]
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [np.asarray(0.3 * jax.random.normal(k, s.shape), np.float32)
                                     for k, s in zip(keys, leaves)])


def write_mxfp4(path, rng):
    """gpt-oss's experts as shipped: each `[E, d, 2F]` / `[E, F, d]` tensor replaced by random e2m1
    codes and exponents, `[E, out, in / 32, 16]` bytes and `[E, out, in / 32]` scales; returns the
    tensors dequantized (`[E, in, out]`, as transformers dequantizes them)."""
    tensors, dequantized = load_file(os.path.join(path, "model.safetensors")), {}
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, n_in, n_out = tensors.pop(key).shape
        blocks = rng.integers(0, 256, (E, n_out, n_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(117, 121, (E, n_out, n_in // 32), dtype=np.uint8)  # values of at most 6 / 64
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        codes = np.stack([blocks & 15, blocks >> 4], -1).reshape(E, n_out, n_in)
        values = E2M1[codes] * np.repeat(2.0 ** (scales.astype(np.int64) - 127), 32, axis=-1)
        dequantized[key] = np.ascontiguousarray(values.transpose(0, 2, 1), np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"), {"format": "pt"})
    return dequantized


def write_fp8(path, rng):
    """DeepSeek's matrices as shipped: each projection's `[out, in]` weight as float8 e4m3 with a scale
    per 128 x 128 block (the tiny model's are partial blocks); returns them dequantized."""
    tensors, dequantized = load_file(os.path.join(path, "model.safetensors")), {}
    for key in [k for k in tensors if k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight")]:
        w = tensors[key]
        blocks = (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        scale_inv = rng.uniform(1, 2, blocks).astype(np.float32) * np.abs(w).max() / 448  # (e4m3 holds 448 at most)
        full = np.repeat(np.repeat(scale_inv, 128, 0), 128, 1)[:w.shape[0], :w.shape[1]]
        tensors[key] = (w / full).astype(ml_dtypes.float8_e4m3fn)
        tensors[key + "_scale_inv"] = scale_inv
        dequantized[key] = tensors[key].astype(np.float32) * full
    save_file(tensors, os.path.join(path, "model.safetensors"), {"format": "pt"})
    return dequantized


def shipped_folder(tmp_path, name):
    """`(folder as shipped, folder dequantized in NumPy)` of a tiny `name`, float32 elsewhere."""
    hf = tiny(name, quantization_config=None)
    config = config_from_hf(hf, max_seq_len=64)
    shipped, plain = tmp_path / "shipped", tmp_path / "dequantized"
    save_hf(config, random_params(config, 0), str(shipped))
    rng = np.random.default_rng(0)
    dequantized = (write_mxfp4 if name.startswith("gpt-oss") else write_fp8)(str(shipped), rng)
    save_hf(config, random_params(config, 0), str(plain))
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    save_file({**tensors, **dequantized}, os.path.join(plain, "model.safetensors"), {"format": "pt"})
    with open(shipped / "config.json") as f:
        written = json.load(f)
    written["quantization_config"] = MXFP4 if name.startswith("gpt-oss") else FP8
    with open(shipped / "config.json", "w") as f:
        json.dump(written, f)
    return shipped, plain


@pytest.mark.parametrize("name,fmt", [("gpt-oss-20b", "mxfp4"), ("DeepSeek-V3", "fp8")])
def test_a_shipped_checkpoint_is_its_dequantized_model(tmp_path, name, fmt):
    shipped, plain = shipped_folder(tmp_path, name)
    config, params = load_hf(str(shipped))
    quantized = [w for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray)) if isinstance(w, QArray)]
    assert quantized and all(format_of(w) == fmt for w in quantized)
    _, float_params = load_hf(str(plain))
    logits = Decoder(config).apply({"params": params}, TOKENS)[0]
    want = Decoder(config).apply({"params": float_params}, TOKENS)[0]
    assert np.all(np.isfinite(want)) and np.abs(want).max() > 0.1
    np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("name", ["gpt-oss-20b", "DeepSeek-V3"])
def test_a_shipped_checkpoint_equals_transformers_dequantized_model(tmp_path, name):
    torch, transformers = import_peer("torch"), import_peer("transformers")
    shipped, _ = shipped_folder(tmp_path, name)
    config, params = load_hf(str(shipped))
    reference = transformers.AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.from_numpy(TOKENS)).logits.numpy()
    logits = np.asarray(Decoder(config).apply({"params": params}, TOKENS)[0])
    assert np.all(np.isfinite(want)) and np.abs(want).max() > 0.1
    assert np.abs(logits - want).max() <= 1e-3 * np.abs(want).max()
    ours, theirs = list(TOKENS[0]), list(TOKENS[0])
    for _ in range(8):  # greedy, each from its own model's choices
        ours.append(int(np.argmax(Decoder(config).apply({"params": params}, np.array([ours]))[0][0, -1])))
        with torch.no_grad():
            theirs.append(int(reference(torch.tensor([theirs])).logits[0, -1].argmax()))
    assert ours == theirs


def test_a_matrix_shipped_without_its_scales_is_refused(tmp_path):
    shipped, _ = shipped_folder(tmp_path, "gpt-oss-20b")
    tensors = load_file(os.path.join(shipped, "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, os.path.join(shipped, "model.safetensors"), {"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.down_proj: its scales are missing"):
        load_hf(str(shipped))


@pytest.mark.parametrize("quant,field", [({"quant_method": "gptq"}, "quantization_config.quant_method"),
                                         ({**FP8, "weight_block_size": None}, "weight_block_size"),
                                         ({**FP8, "fmt": "e5m2"}, "quantization_config.fmt")])
def test_a_quantization_not_read_is_refused_by_name(quant, field):
    with pytest.raises(ValueError, match=field):
        config_from_hf(tiny("DeepSeek-V3", quantization_config=quant))
