"""`python -m benchmarks.gpt_oss_20b` on a small gpt-oss folder written as openai ships gpt-oss-20b (its
experts MXFP4 blocks and scales, the rest bfloat16) at a small width (no timing asserted): the folder is
what transformers reads as gpt-oss, its weights at a real model's scale, and jaxformer's model of it is
the NumPy-dequantized folder's; both sides decode it in processes of their own and report, and a side
over its memory limit is killed and recorded. The real size's counts are gpt-oss-20b's."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import import_peer

from benchmarks import gpt_oss_20b
from jaxformer import Decoder
from jaxformer.convert import load_hf
from jaxformer.convert.safetensors_file import SafetensorsFile, write_safetensors
from jaxformer.quantized import QArray, format_of
from tests.convert.test_shipped_quantized import mxfp4_dequantized
from tests.families.shipped import SHIPPED

pytestmark = pytest.mark.peers  # transformers reads the folder and is the peer

SMALL = dict(hidden_size=64, intermediate_size=96, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
             num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, vocab_size=512)
E, D, F = 4, 64, 96
TOKENS = np.array([[3, 17, 5, 42, 9, 11, 2, 30]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return gpt_oss_20b.write(str(tmp_path_factory.mktemp("gpt_oss") / "small"), gpt_oss_20b.config(3, **SMALL))


def stored(folder):
    """`{name: array}` of every tensor in `folder`'s shards, in its stored dtype."""
    out = {}
    for shard in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        file = SafetensorsFile(os.path.join(folder, shard))
        out |= {key: np.array(file.tensor(key)) for key in file.keys}
    return out


def test_the_config_is_the_published_one_and_the_real_size_gpt_oss_20bs():
    published = {k: v for k, v in SHIPPED["gpt-oss-20b"].items()
                 if k not in ("eos_token_id", "pad_token_id", "transformers_version")}  # (ids: the tokenizer's)
    assert gpt_oss_20b.CONFIG == published == gpt_oss_20b.config(24)
    assert gpt_oss_20b.config(3)["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    params = gpt_oss_20b.parameters(gpt_oss_20b.CONFIG)
    assert round(params / 1e9, 1) == 20.9  # the model card's total
    experts = 24 * 32 * 3 * 2880 * 2880  # their matrices, at MXFP4's 4.25 bits a value; all else 2 bytes
    assert gpt_oss_20b.file_bytes(gpt_oss_20b.CONFIG) == 2 * (params - experts) + experts * 17 // 32
    assert round(gpt_oss_20b.file_bytes(gpt_oss_20b.CONFIG) / 1e9, 2) == 13.76
    assert round(2 * params / 1e9, 1) == 41.8  # (transformers' bfloat16 model)


def test_a_size_mxfp4_cannot_block_and_no_layers_are_refused():
    with pytest.raises(ValueError, match="hidden_size 48 and intermediate_size 96 must be multiples of 32"):
        gpt_oss_20b.tensors(gpt_oss_20b.config(1, **dict(SMALL, hidden_size=48)))
    with pytest.raises(ValueError, match="layers must be >= 1, got 0"):
        gpt_oss_20b.config(0)
    with pytest.raises(SystemExit):
        gpt_oss_20b.main(["unwritten", "--layers", "0"])


def test_the_folder_is_gpt_oss_as_shipped(folder):
    transformers, torch = import_peer("transformers"), import_peer("torch")
    hf = transformers.AutoConfig.from_pretrained(folder)
    assert type(hf).__name__ == "GptOssConfig" and hf.quantization_config["quant_method"] == "mxfp4"
    tensors = stored(folder)
    for i in range(3):
        x = f"model.layers.{i}.mlp.experts."
        assert tensors[x + "gate_up_proj_blocks"].shape == (E, 2 * F, D // 32, 16)
        assert tensors[x + "gate_up_proj_scales"].shape == (E, 2 * F, D // 32)
        assert tensors[x + "down_proj_blocks"].shape == (E, D, F // 32, 16)
        assert tensors[x + "down_proj_scales"].shape == (E, D, F // 32)
        assert tensors[x + "gate_up_proj_bias"].shape == (E, 2 * F) and tensors[x + "down_proj_bias"].shape == (E, D)
    quantized = [k for k in tensors if k.endswith(("_blocks", "_scales"))]
    assert len(quantized) == 12 and all(tensors[k].dtype == np.uint8 for k in quantized)
    assert all(w.dtype == ml_dtypes.bfloat16 for k, w in tensors.items() if k not in quantized)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in tensors.values())  # the real bytes
    assert index["weight_map"].keys() == tensors.keys()
    _, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def test_its_weights_are_at_a_real_models_scale(folder):
    """The experts' std is 2.93 * sqrt((2 ** -16 + 2 ** -14) / 2) = 0.018 (the module's reckoning), the
    bfloat16 matrices' 0.02, the norms 1."""
    tensors = stored(folder)
    experts = np.concatenate([mxfp4_dequantized(tensors[k + "_blocks"], tensors[k + "_scales"]).ravel()
                              for k in (f"model.layers.{i}.mlp.experts.{m}" for i in range(3)
                                        for m in ("gate_up_proj", "down_proj"))])
    want = np.sqrt(68.5 / 8 * (2.0 ** -16 + 2.0 ** -14) / 2)
    assert round(want, 3) == 0.018 and abs(experts.std() / want - 1) < 0.02 and abs(experts.mean()) < 1e-3
    embedding = tensors["model.embed_tokens.weight"].astype(np.float32)
    assert abs(embedding.std() / 0.02 - 1) < 0.02
    assert np.all(tensors["model.layers.0.input_layernorm.weight"].astype(np.float32) == 1)


def test_jaxformers_model_is_the_numpy_dequantized_folders(folder, tmp_path):
    tensors = stored(folder)
    plain = {k: w for k, w in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    for k in [k[:-len("_blocks")] for k in tensors if k.endswith("_blocks")]:
        plain[k] = mxfp4_dequantized(tensors[k + "_blocks"], tensors[k + "_scales"])  # [E, in, out], as named
    os.makedirs(tmp_path / "plain")
    write_safetensors(str(tmp_path / "plain" / "model.safetensors"), [(k, w.shape, w.dtype) for k, w in plain.items()],
                      plain.get, {"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    logits = {}
    for name, path in (("shipped", folder), ("plain", str(tmp_path / "plain"))):
        config, params = load_hf(path)
        logits[name] = np.asarray(Decoder(config).apply({"params": params}, TOKENS)[0])
    assert any(isinstance(w, QArray) and format_of(w) == "mxfp4" for w in jax.tree.leaves(
        load_hf(folder)[1], is_leaf=lambda w: isinstance(w, QArray)))  # (read as shipped: MXFP4 kept)
    want = logits["plain"]
    assert np.all(np.isfinite(want)) and np.abs(want).max() > 0.1
    np.testing.assert_allclose(logits["shipped"], want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_both_sides_decode_in_processes_of_their_own_and_report(folder, tmp_path, capsys):
    out = tmp_path / "g.json"
    gpt_oss_20b.main([folder, "--reuse", "--batch", "1", "2", "--prompt", "4", "--new", "3", "--out", str(out)])
    got = json.loads(out.read_text())
    ours, theirs = got["results"]["jaxformer"], got["results"]["transformers"]
    assert [r["batch"] for r in ours["rows"]] == [r["batch"] for r in theirs["rows"]] == [1, 2]
    assert all(len(r["tokens"]) == r["batch"] and len(r["tokens"][0]) == 3 for r in ours["rows"] + theirs["rows"])
    config = gpt_oss_20b.config(3, **SMALL)
    n_scales = sum(np.prod(shape) for name, (shape, _) in gpt_oss_20b.tensors(config).items()
                   if name.endswith("_scales"))
    # The experts stay MXFP4 (their values at 4 bits, their scales at 2 bytes at most), the rest bfloat16.
    assert gpt_oss_20b.file_bytes(config) <= ours["weight_bytes"] <= gpt_oss_20b.file_bytes(config) + n_scales
    assert theirs["weight_bytes"] == 2 * gpt_oss_20b.parameters(config)  # (MXFP4 expanded to bfloat16)
    assert got["file_bytes"] > gpt_oss_20b.file_bytes(config)  # (the shards' headers besides)
    printed = capsys.readouterr().out
    for said in ("3 layers", "RSS / file size", "(goal 1.3x:", "x jaxformer's, same tokens:"):
        assert said in printed


def test_a_side_over_its_memory_limit_is_killed_and_recorded(folder, tmp_path, capsys):
    out = tmp_path / "g.json"
    gpt_oss_20b.main([folder, "--reuse", "--batch", "1", "--prompt", "4", "--new", "2", "--peer-limit", "0.05",
                      "--out", str(out)])
    got = json.loads(out.read_text())["results"]
    assert got["jaxformer"]["rows"] and got["transformers"]["limit"] == int(0.05 * 2**30)
    assert got["transformers"]["killed_at"] > got["transformers"]["limit"]
    assert "transformers killed at" in capsys.readouterr().out
