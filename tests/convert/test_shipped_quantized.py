"""Checkpoints that ship quantized, read as shipped: a tiny gpt-oss folder with its experts in MXFP4
(`X_blocks`, `X_scales`) and a tiny DeepSeek-V3 folder with its matrices in block FP8 (`X.weight`
float8 e4m3, `X.weight_scale_inv`), each with its `quantization_config`, written in the test as those
checkpoints ship. jaxformer's model equals the same folder dequantized in NumPy (fast tier) and
transformers' (which dequantizes both on a CPU) to 1e-3 of the largest logit, with the same greedy
tokens (full tier). `save_hf` writes each back as shipped, bit for bit, which `load_hf` reads as the
same parameters and transformers opens as the same model (full tier); or dequantized, as the NumPy
folder."""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import import_peer
from safetensors.numpy import load_file, save_file

from jaxformer import Decoder
from jaxformer.convert import config_from_hf, load_hf, save_hf
from jaxformer.convert.safetensors_file import SafetensorsFile
from jaxformer.quantized import QArray, dequantize, format_of
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


def mxfp4_dequantized(blocks, scales):
    """MXFP4 as gpt-oss ships it, `[E, out, in / 32, 16]` bytes (the low nibble first) and `[E, out, in / 32]`
    e8m0 scales, as float32 `[E, in, out]` (as transformers dequantizes it)."""
    E, n_out, n_blocks = scales.shape
    codes = np.stack([blocks & 15, blocks >> 4], -1).reshape(E, n_out, n_blocks * 32)
    values = E2M1[codes] * np.repeat(2.0 ** (scales.astype(np.int64) - 127), 32, axis=-1)
    return np.ascontiguousarray(values.transpose(0, 2, 1), np.float32)


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
        dequantized[key] = mxfp4_dequantized(blocks, scales)
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


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """`folders(name)`: `shipped_folder(name)`, made once for the tests that only read them."""
    made = {}

    def folder(name):
        if name not in made:
            made[name] = shipped_folder(tmp_path_factory.mktemp(name), name)
        return made[name]

    return folder


def stored_tensors(folder):
    """Every tensor of `folder`'s model.safetensors as stored: `{name: (dtype, shape, bytes)}` (FP8's
    too, which safetensors' NumPy reader does not read)."""
    file = SafetensorsFile(os.path.join(folder, "model.safetensors"))
    return {key: (file.tensor(key).dtype, file.tensor(key).shape, file.tensor(key).tobytes()) for key in file.keys}


def quantization_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f).get("quantization_config")


def same_bits(a, b):
    """Two parameter trees of the same structure, each leaf the same dtype and bytes (a QArray's too)."""
    is_q = lambda x: isinstance(x, QArray)  # noqa: E731
    return (jax.tree.structure(a, is_leaf=is_q) == jax.tree.structure(b, is_leaf=is_q)
            and all(np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
                    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


@pytest.mark.parametrize("name", ["gpt-oss-20b", "DeepSeek-V3"])
def test_save_hf_writes_a_shipped_checkpoint_back_bit_for_bit(tmp_path, folders, name):
    """Its tensors (MXFP4's blocks and scales, FP8's values and block scales, DeepSeek's split into heads
    and gpt-oss's gate and up interleaved again, the float ones) and quantization_config are the
    folder's; load_hf reads the same parameters; with `dequantize=True`, the NumPy-dequantized folder."""
    shipped, plain = shipped_folder(tmp_path, name)
    config, params = load_hf(str(shipped))
    save_hf(config, params, str(tmp_path / "saved"))
    assert stored_tensors(tmp_path / "saved") == stored_tensors(shipped)
    assert quantization_config(tmp_path / "saved") == quantization_config(shipped)
    assert same_bits(load_hf(str(tmp_path / "saved"))[1], params)
    save_hf(config, params, str(tmp_path / "dequantized"), dequantize=True)
    assert stored_tensors(tmp_path / "dequantized") == stored_tensors(plain)
    assert quantization_config(tmp_path / "dequantized") is None


@pytest.mark.parametrize("name", ["gpt-oss-20b", "DeepSeek-V3"])
def test_save_hf_as_shipped_is_the_same_model_in_transformers(tmp_path, name):
    torch, transformers = import_peer("torch"), import_peer("transformers")
    shipped, _ = shipped_folder(tmp_path, name)
    save_hf(*load_hf(str(shipped)), str(tmp_path / "saved"))
    logits = {}
    for folder in (shipped, tmp_path / "saved"):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits[folder] = model(torch.from_numpy(TOKENS)).logits.numpy()
    assert np.all(np.isfinite(logits[shipped])) and np.abs(logits[shipped]).max() > 0.1
    np.testing.assert_array_equal(logits[tmp_path / "saved"], logits[shipped])


@pytest.mark.parametrize("mixed", ["int8 attention", "a float expert matrix"])
def test_save_hf_dequantizes_a_model_mixing_formats(tmp_path, folders, mixed):
    """gpt-oss's MXFP4 experts beside its attention quantized to int8 on load, or with one layer's
    `w_down` float (as an adapter merged into it leaves it; transformers would read it as MXFP4):
    written float, each expert tensor the NumPy-dequantized folder's."""
    shipped, plain = folders("gpt-oss-20b")
    config, params = load_hf(str(shipped), quantize="int8" if mixed == "int8 attention" else None)
    if mixed == "a float expert matrix":
        params["block_0"]["mlp"]["w_down"] = dequantize(params["block_0"]["mlp"]["w_down"])
    save_hf(config, params, str(tmp_path / "saved"))
    saved, want = stored_tensors(tmp_path / "saved"), stored_tensors(plain)
    assert quantization_config(tmp_path / "saved") is None and saved.keys() == want.keys()
    assert all(dtype == np.float32 for dtype, _, _ in saved.values())
    experts = [key for key in want if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and all(saved[key] == want[key] for key in experts)


def test_save_hf_refuses_by_name_a_matrix_whose_scales_are_not_its_blocks(tmp_path, folders):
    """An FP8 matrix whose scale differs within a 128 x 128 block cannot be written as shipped: refused,
    naming the tensor, the folder's files as they were."""
    shipped = shutil.copytree(folders("DeepSeek-V3")[0], tmp_path / "copy")
    config, params = load_hf(str(shipped))
    before = {f: (shipped / f).read_bytes() for f in ("model.safetensors", "config.json")}
    w = params["block_0"]["attn"]["wq_b"]
    params["block_0"]["attn"]["wq_b"] = w.replace(scale=w.scale.at[0, 0, 0].multiply(2))  # one row's
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_b_proj\.weight: an FP8 matrix .* one scale "
                                         r"per 128 x 128 block; save_hf\(dequantize=True\)"):
        save_hf(config, params, str(shipped))  # (over the folder it was read from)
    assert {f: (shipped / f).read_bytes() for f in before} == before


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
