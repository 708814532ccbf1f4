"""Gemma 4 beyond what every family's tests check (tests/families/test_families.py): its config.json in both
forms transformers reads (the hub's `global_head_dim` and the `per_layer_config` transformers 5.25 writes),
what it refuses, the sizes its makers publish, its image-text checkpoints' text model, and a quick check of
its per-layer inputs, shared keys and values and wider global heads against transformers."""

import json
import logging
import math
import re
import shutil

import numpy as np
import pytest
from conftest import GEMMA4, import_peer, jit_apply, torch_peer
from shipped import SHIPPED, scaled_up, tiny

from jaxformer import Decoder
from jaxformer.convert import config_from_hf, load_hf, save_hf
from jaxformer.families import family_of

torch = torch_peer()
transformers = import_peer("transformers")

pytestmark = pytest.mark.peers
TOLERANCE = 1e-4  # as tests/families/test_families.py
# The tiny E2B of test_families.py cut to one sliding and one global layer that compute keys and values, then one
# of each that reads theirs: what the quick check below compiles in a few seconds (and the decoding paths' tests run).
SHORT_E2B = GEMMA4["gemma-4-E2B-it"]


def test_per_layer_inputs_shared_keys_and_global_heads_give_transformers_logits(tmp_path):
    """The fast tier's check of Gemma 4 against transformers (the full tier has every family test)."""
    hf_model = scaled_up(transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**tiny("gemma-4-E2B-it", **SHORT_E2B))), seed=0).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    config, params = load_hf(str(tmp_path), max_seq_len=64)
    assert [s.mixer.kv_shared for s in config.layers] == [False, False, False, True, True]
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = reference(tokens).logits.numpy()
    got, _ = jit_apply(Decoder(config), {"params": params}, tokens.numpy())
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", ["gemma-4-E2B-it", "gemma-4-26B-A4B-it"])
def test_each_layer_is_what_config_json_states_in_either_form(name):
    """The hub's form (`global_head_dim`, `num_global_key_value_heads`) and the one transformers 5.25
    writes (`per_layer_config`) read as one config; the layers are as the shipped sizes say."""
    config = config_from_hf(SHIPPED[name], max_seq_len=64)
    rewritten = transformers.AutoConfig.for_model(**SHIPPED[name]).to_dict()
    assert "per_layer_config" in rewritten and "global_head_dim" not in rewritten
    assert config_from_hf(rewritten, max_seq_len=64) == config
    mixers, ffns = [s.mixer for s in config.layers], [s.ffn for s in config.layers]
    full = [m for m in mixers if m.window is None]
    assert len(full) == config.n_layer // (5 if name == "gemma-4-E2B-it" else 6)
    assert all(m.v_norm and m.scale == 1.0 and m.qk_norm for m in mixers)
    if name == "gemma-4-E2B-it":  # 20 shared layers, MLPs twice as wide; per-layer inputs of 256
        assert [m.kv_shared for m in mixers] == [False] * 15 + [True] * 20
        assert [f.width for f in ffns] == [6144] * 15 + [12288] * 20
        assert {(m.n_kv_head, m.head_dim, m.k_eq_v) for m in full} == {(1, 512, False)}
        assert (config.per_layer_width, config.per_layer_vocab_size) == (256, 262144)
    else:  # the global layers' 2 kv heads of 512, the keys' projection as the values; experts beside the MLP
        assert {(m.n_kv_head, m.head_dim, m.k_eq_v) for m in full} == {(2, 512, True)}
        assert {(f.dense.width, f.experts.n_experts, f.experts.top_k, f.experts.width) for f in ffns} == {
            (2112, 128, 8, 704)}
    assert {(m.rope_scaling.kind, m.rope_scaling.partial_rotary_factor, m.rope_theta) for m in full} == {
        ("proportional", 0.25, 1e6)}


def test_the_published_sizes():
    """Google's figures: the 26B A4B has 25.2B parameters and 3.8B a token reads (its 8 experts of 128);
    the E2B 2.3B "effective" ones, those besides its per-layer embedding table (its 5.1B count the
    image and audio encoders too). From the tensor table `load_hf` reads; nothing is allocated."""
    def size(config):
        return sum(math.prod(t.shape) for t in family_of(config).tensors(config))

    moe = config_from_hf(SHIPPED["gemma-4-26B-A4B-it"], max_seq_len=64)
    experts = moe.layers[0].ffn.experts
    idle = moe.n_layer * (experts.n_experts - experts.top_k) * 3 * moe.d_model * experts.width
    assert (round(size(moe) / 1e9, 1), round((size(moe) - idle) / 1e9, 1)) == (25.2, 3.8)
    e2b = config_from_hf(SHIPPED["gemma-4-E2B-it"], max_seq_len=64)
    table = e2b.per_layer_vocab_size * e2b.n_layer * e2b.per_layer_width
    assert round((size(e2b) - table) / 1e9, 1) == 2.3


@pytest.mark.parametrize("change, match", [
    (dict(attention_bias=True), "attention_bias: must be false"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention: must be null or 'vision'"),
    (dict(hidden_activation="gelu"), "hidden_activation: must be 'gelu_pytorch_tanh'"),
    (dict(num_kv_shared_layers=35), "num_kv_shared_layers: must leave"),
    (dict(per_layer_config={"4": {"sliding_window": 8}}), "per_layer_config: must be an object of layer indices"),
    (dict(per_layer_config={"4": {"head_dim": 64}}), "per_layer_config: must give the full_attention layers one"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "rope_theta": 1e6}}),
     r"rope_parameters.full_attention.rope_type: must be one of"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     r"rope_parameters.sliding_attention.rope_type: must be 'default'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.5}}),
     r"rope_parameters.full_attention.partial_rotary_factor: must be a number in \(0, 1\]"),
], ids=["attention_bias", "bidirectional", "activation", "all-shared", "per-layer-field", "per-layer-type",
        "rope-type", "sliding-rope", "partial-rotary"])
def test_what_is_not_implemented_is_refused_naming_the_field(change, match):
    with pytest.raises(ValueError, match=f"config.json {match}"):
        config_from_hf({**SHIPPED["gemma-4-E2B-it"], **change})
    image_text = {"model_type": "gemma4", "text_config": {**SHIPPED["gemma-4-E2B-it"], **change}}
    with pytest.raises(ValueError, match=f"config.json text_config.{match}"):
        config_from_hf(image_text)
    with pytest.raises(ValueError, match="config.json text_config: must be an object"):
        config_from_hf({"model_type": "gemma4"})


def test_an_image_text_checkpoint_loads_its_text_model_and_saves_it_as_gemma4_text(tmp_path, caplog):
    """`Gemma4ForConditionalGeneration` (tiny towers beside the tiny E2B): its text model's logits are
    transformers' of the whole model on text; the towers are skipped in one line; `save_hf` writes a
    `gemma4_text` checkpoint that transformers reopens. And the loader follows `global_head_dim`: a
    config.json whose global layers were as wide as the others no longer fits the tensors."""
    text = tiny("gemma-4-E2B-it", **SHORT_E2B)
    config = transformers.Gemma4Config(
        text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16),
        audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32,
                          subsampling_conv_channels=[4, 4]))
    hf_model = scaled_up(transformers.Gemma4ForConditionalGeneration(config), seed=0).to(torch.bfloat16)
    folder = tmp_path / "image-text"
    hf_model.save_pretrained(folder, max_shard_size="40KB")
    with caplog.at_level(logging.WARNING):
        loaded, params = load_hf(str(folder), max_seq_len=64)
    skipped = caplog.text
    assert re.search(r"not read \(jaxformer runs the text model alone\): \d+ tensors under model.audio_tower., .*"
                     r"\d+ tensors under model.vision_tower.", skipped)
    assert loaded.hf_model_type == "gemma4_text" and loaded == config_from_hf(text, max_seq_len=64)
    reference = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, loaded.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(input_ids=tokens).logits.numpy()
    got, _ = jit_apply(Decoder(loaded), {"params": params}, tokens.numpy())
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)

    save_hf(loaded, params, str(tmp_path / "text"))
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "gemma4_text"
    reopened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(reopened(tokens).logits.numpy(), want, atol=TOLERANCE, rtol=0)

    narrow = tmp_path / "narrow"
    shutil.copytree(folder, narrow)
    hf = json.loads((narrow / "config.json").read_text())
    hf["text_config"]["per_layer_config"] = {}  # (transformers' form: no layer wider than head_dim)
    (narrow / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"layers\.[14]\.self_attn\.\w+\.weight: expected shape"):
        load_hf(str(narrow), max_seq_len=64)


def test_the_experts_beside_each_mlp_report_their_load():
    """`decoder.expert_load` counts the experts of Gemma 4's layers, beside their MLPs: k a token each."""
    from conftest import random_params

    from jaxformer.decoder import expert_load

    config = config_from_hf(tiny("gemma-4-26B-A4B-it"), max_seq_len=64)
    tokens = np.random.RandomState(0).randint(0, config.vocab_size, (2, 5))
    loads = expert_load(Decoder(config), {"params": random_params(config, seed=0)}, tokens)
    assert sorted(loads) == list(range(config.n_layer))
    assert all(int(load.sum()) == config.layers[0].ffn.experts.top_k * tokens.size for load in loads.values())
