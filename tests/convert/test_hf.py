"""load_hf / save_hf without the peers: config mapping, the tensor table, and every refusal.

The parity tests against transformers itself are in test_hf_parity.py.
"""

import json
import math
import os

import jax
import numpy as np
import pytest
from conftest import SMALL, init_params, jit_apply, random_params
from safetensors.numpy import load_file, save_file

from jaxformer import Decoder, RopeScaling
from jaxformer.convert import config_from_hf, config_to_hf, load_hf, save_hf
from jaxformer.families.common import Tensor, whole_shape
from jaxformer.quantized import Quantization

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}


MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}


def _saved(tmp_path, config=SMALL, seed=0):
    params = random_params(config, seed=seed)
    save_hf(config, params, str(tmp_path))
    return params


def _edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)


def test_config_from_hf_maps_every_field():
    config = config_from_hf(LLAMA)
    assert (config.vocab_size, config.d_model, config.ffn_dim, config.n_layer) == (64, 64, 96, 3)
    assert (config.n_head, config.n_kv_head, config.head_dim, config.max_seq_len) == (4, 2, 16, 64)
    assert (config.rope_theta, config.norm_eps, config.rope_pairing) == (500.0, 1e-6, "split_half")
    assert not config.tie_embeddings and not config.qkv_bias and config.head_dim_override is None
    assert config_from_hf({**LLAMA, "head_dim": 24}).head_dim == 24  # wider heads than hidden / heads
    assert config_from_hf({**LLAMA, "model_type": "qwen2"}).qkv_bias
    assert config_from_hf({**LLAMA, "max_position_embeddings": 4096}, max_seq_len=100).max_seq_len == 100
    with pytest.raises(ValueError, match=r"max_seq_len must be a positive int \(got 0\)"):
        config_from_hf(LLAMA, max_seq_len=0)  # not taken for "unset"


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_rope_scaling_as_llama_3_ships_it_and_as_transformers_5_writes_it():
    """Llama 3.2's config.json (top-level `rope_theta` and `rope_scaling`), and the same
    model in `rope_parameters`: one `RopeScaling`; saved back, it reads the same."""
    older = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    shipped = {**older, "rope_theta": 500000.0, "rope_scaling": {
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"}}
    want = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
    config = config_from_hf(shipped)
    assert (config.rope_theta, config.rope_scaling) == (500000.0, want)
    assert config_from_hf({**LLAMA, "rope_parameters": LLAMA3_ROPE}).rope_scaling == want
    assert config_to_hf(config)["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 500000.0}
    assert config_from_hf(config_to_hf(config)) == config
    linear = config.replace(rope_scaling=RopeScaling("linear", 4.0))
    assert config_from_hf(config_to_hf(linear)) == linear


def test_yarn_as_qwen_2_5_ships_it_with_transformers_defaults():
    """Qwen2.5's `rope_scaling` (only the type, factor and original context): the defaults
    beta 32 / 1, ramp ends truncated, attention factor 0.1 ln 4 + 1; with `mscale` and
    `mscale_all_dim` the factor is their ratio; without `factor`, the two contexts' ratio."""
    older = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    shipped = {**older, "model_type": "qwen2", "max_position_embeddings": 131072, "rope_theta": 1e6,
               "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
    config = config_from_hf(shipped)
    assert config.rope_scaling == RopeScaling("yarn", 4.0, 32768)  # the rest at its defaults:
    assert config.rope_scaling.ramp == (32.0, 1.0, True)
    assert config.rope_scaling.cos_sin_scale == 0.1 * math.log(4.0) + 1
    assert config_from_hf(config_to_hf(config)) == config
    # A default is not frozen in: another factor, another attention factor.
    assert config.rope_scaling.replace(factor=8.0).cos_sin_scale == 0.1 * math.log(8.0) + 1
    deepseek_like = {**shipped, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 4096,
                                                 "mscale": 1.0, "mscale_all_dim": 0.5}}
    scaling = config_from_hf(deepseek_like).rope_scaling
    assert scaling.factor == 32.0 and scaling.cos_sin_scale == pytest.approx(
        (0.1 * math.log(32) + 1) / (0.05 * math.log(32) + 1), rel=1e-15)
    # mscale_all_dim is kept (a latent attention's scores take its factor squared) and written back
    deepseek = config_from_hf(deepseek_like)
    assert scaling.mscale_all_dim == 0.5 and config_to_hf(deepseek)["rope_parameters"]["mscale_all_dim"] == 0.5
    assert config_from_hf(config_to_hf(deepseek)) == deepseek


def test_rope_theta_from_the_older_top_level_key():
    older = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    assert config_from_hf({**older, "rope_theta": 1e6, "rope_scaling": None}).rope_theta == 1e6
    assert config_from_hf(older).rope_theta == 10000.0  # transformers' default
    # rope_parameters (transformers >= 5) wins over a stale top-level key.
    assert config_from_hf({**LLAMA, "rope_theta": 1e6}).rope_theta == 500.0


def test_config_round_trips_through_config_json():
    for config in (SMALL, SMALL.replace(tie_embeddings=False, qkv_bias=True, head_dim_override=24, rope_theta=123.0)):
        # config.json states the SwiGLU width; jaxformer's None (the reference's rule) resolves to it,
        # and the loaded config remembers its family.
        family = "qwen2" if config.qkv_bias else "llama"
        assert config_from_hf(config_to_hf(config)) == config.replace(d_ff=config.ffn_dim, hf_model_type=family)


@pytest.mark.parametrize("changes, field", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0, "short_factor": [1.0] * 8,
                           "original_max_position_embeddings": 16}), "rope_parameters.long_factor"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5e5, "short_factor": [1.0], "long_factor": [1.0]}),
     "original_max_position_embeddings"),  # neither in the object nor at the top level
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}), "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}),
     "rope_parameters.original_max_position_embeddings"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "truncate": "no",
                           "original_max_position_embeddings": 64}), "rope_parameters.truncate"),
    (dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
    (dict(rope_parameters={**LLAMA3_ROPE, "factor": -1}), "rope_parameters.factor"),
    (dict(rope_parameters={**LLAMA3_ROPE, "high_freq_factor": 0.5}), "rope_parameters.high_freq_factor"),
    (dict(rope_parameters={k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}),
     "rope_parameters.low_freq_factor"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),  # rope_parameters says default
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]), "layer_types"),  # Llama never slides
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, layer_types=["full_attention"]),
     "layer_types"),
    (dict(model_type="mistral", sliding_window=-16), "sliding_window"),
    # Mixtures of experts: what is not computed exactly, and experts that cannot be
    (dict(MIXTRAL, router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(MIXTRAL, num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(MIXTRAL, num_local_experts=0), "num_local_experts"),
    (dict(MIXTRAL, router_aux_loss_coef=-1), "router_aux_loss_coef"),
    (dict(MIXTRAL, model_type="olmoe", num_experts=4, clip_qkv=8.0), "clip_qkv"),
    (dict(MIXTRAL, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32, use_sliding_window=True,
          sliding_window=16), "use_sliding_window"),
    (dict(MIXTRAL, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32, mlp_only_layers=[3]),
     "mlp_only_layers"),
    (dict(MIXTRAL, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32), "shared_expert_intermediate_size"),
    (dict(MIXTRAL, model_type="gpt_oss", quantization_config={"quant_method": "gptq"}),
     "quantization_config.quant_method"),
    (dict(MIXTRAL, model_type="gpt_oss", sliding_window=128, swiglu_limit=-7.0), "swiglu_limit"),
    # SmolLM3 and OLMo: what they state per layer, and what transformers reads otherwise than it says
    (dict(model_type="smollm3", use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (dict(model_type="smollm3", no_rope_layers=[1, 0]), "no_rope_layers"),  # fewer than the layers
    (dict(model_type="smollm3", no_rope_layers=[1, 0, 2]), "no_rope_layers"),
    (dict(model_type="olmo2", attention_bias=True), "attention_bias"),
    (dict(model_type="olmo3"), "rope_parameters"),  # flat: transformers' olmo3 ignores it
    (dict(model_type="olmo3", rope_parameters=None, rope_theta=1e4), "rope_theta"),  # its sliding layers at 5e5
    (dict(model_type="olmo3", rope_parameters={"full_attention": {"rope_theta": 5e5}, "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}), "rope_parameters.sliding_attention.rope_type"),
    (dict(model_type="olmo3", rope_parameters=None, sliding_window=None), "sliding_window"),
])
def test_unrepresentable_configs_are_refused_by_name(changes, field):
    with pytest.raises(ValueError, match=f"config.json {field}:"):
        config_from_hf({**LLAMA, **changes})


def test_sliding_windows_are_read_per_layer_as_each_family_applies_them():
    mistral = {**LLAMA, "model_type": "mistral", "sliding_window": 16}
    config = config_from_hf(mistral)
    assert (config.sliding_window, config.attention_types) == (16, ("sliding",) * 3)  # every layer
    assert config_from_hf({**mistral, "sliding_window": None}).sliding_window is None
    qwen = {**LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
    assert config_from_hf(qwen).attention_types == ("full", "sliding", "sliding")  # from max_window_layers on
    assert config_from_hf({**qwen, "use_sliding_window": False}).sliding_window is None  # the flag rules
    listed = {**qwen, "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    assert config_from_hf(listed).attention_types == ("sliding", "full", "full")  # layer_types rules


def test_per_layer_features_are_read_as_transformers_makes_them():
    """SmolLM3's NoPE layers from `no_rope_layer_interval` where `no_rope_layers` is absent; OLMo 3's
    windows three layers of four by default, YaRN on its full layers alone in either RoPE form."""
    smol = config_from_hf({**LLAMA, "model_type": "smollm3", "no_rope_layer_interval": 2})
    assert [spec.mixer.use_rope for spec in smol.layers] == [True, False, True] and smol.rope_theta == 500.0
    assert config_from_hf({**LLAMA, "model_type": "smollm3", "rope_parameters": None}).rope_theta == 2e6  # its own
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "rope_theta": 5e5}
    older = {**LLAMA, "model_type": "olmo3", "num_hidden_layers": 4, "rope_parameters": None, "rope_theta": 5e5,
             "rope_scaling": {k: v for k, v in yarn.items() if k != "rope_theta"}}
    newer = {**older, "rope_scaling": None, "rope_theta": None, "rope_parameters": {
        "full_attention": yarn, "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}}
    for hf in (older, newer):
        olmo = config_from_hf(hf)
        assert olmo.attention_types == ("sliding", "sliding", "sliding", "full") and olmo.sliding_window == 4096
        assert (olmo.rope_scaling.kind, olmo.local_rope_theta) == ("yarn", 5e5)  # the sliding layers unscaled
        assert {(spec.norms, spec.mixer.qk_norm_over) for spec in olmo.layers} == {("post", "projection")}
    same = config_from_hf({**newer, "rope_parameters": {"full_attention": yarn, "sliding_attention": yarn}})
    assert same.local_rope_theta is None and same.rope_scaling.kind == "yarn"  # every layer scaled alike


@pytest.mark.parametrize("changes", [dict(), dict(tie_embeddings=False), dict(qkv_bias=True),
                                     dict(head_dim_override=24)])
def test_save_then_load_gives_back_the_same_model(tmp_path, changes):
    config = SMALL.replace(**changes)
    params = _saved(tmp_path, config)
    loaded_config, loaded = load_hf(str(tmp_path))
    family = "qwen2" if config.qkv_bias else "llama"
    assert loaded_config == config.replace(d_ff=config.ffn_dim, hf_model_type=family)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert ("lm_head.weight" in names) == (not config.tie_embeddings)  # a tied head is the embedding
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == config.qkv_bias


def test_interleaved_model_is_saved_split_half_with_the_same_logits(tmp_path):
    config = SMALL.replace(rope_pairing="interleaved")
    params = _saved(tmp_path, config)
    loaded_config, loaded = load_hf(str(tmp_path))
    assert loaded_config == config.replace(rope_pairing="split_half", d_ff=config.ffn_dim, hf_model_type="llama")
    tokens = np.arange(40).reshape(2, 20) % config.vocab_size
    # The two pairings sum each q.k in another order: compared in float64, where that
    # reordering is far below the tolerance, a wrongly permuted row is not.
    with jax.enable_x64(True):
        f64 = dict(dtype="float64", param_dtype="float64")

        def as64(tree):
            return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)

        want, _ = jit_apply(Decoder(config.replace(**f64)), {"params": as64(params)}, tokens)
        got, _ = jit_apply(Decoder(loaded_config.replace(**f64)), {"params": as64(loaded)}, tokens)
    assert want.dtype == np.float64 and np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=1e-10, rtol=1e-10)


def test_sharded_checkpoint_loads_like_one_file(tmp_path):
    params = _saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    os.remove(tmp_path / "model.safetensors")
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00003.safetensors": names[i::3] for i in range(3)}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: file for file, keys in shards.items() for k in keys}}, f)
    _, loaded = load_hf(str(tmp_path))
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_wrong_shape_names_the_tensor(tmp_path):
    _saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.weight: expected shape \(32, 64\)"):
        load_hf(str(tmp_path))


def test_config_that_disagrees_with_the_tensors_is_refused(tmp_path):
    _saved(tmp_path)
    _edit_config(tmp_path, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"unexpected \['model.layers.2.input_layernorm.weight'"):
        load_hf(str(tmp_path))
    _edit_config(tmp_path, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"missing \['model.layers.3.input_layernorm.weight'"):
        load_hf(str(tmp_path))


@pytest.mark.parametrize("quantize", [None, Quantization("int8", head=True)], ids=["float", "quantized-head"])
def test_tied_checkpoint_with_a_different_head_is_refused(tmp_path, quantize):
    _saved(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, str(tmp_path / "model.safetensors"))
    load_hf(str(tmp_path), quantize=quantize)  # a stored copy of the embedding is fine
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_hf(str(tmp_path), quantize=quantize)


def test_missing_weights_file_is_a_clear_error(tmp_path):
    _saved(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf(str(tmp_path))


def test_save_refuses_params_of_another_config(tmp_path):
    params = init_params(SMALL)
    with pytest.raises(ValueError, match="params has no lm_head"):
        save_hf(SMALL.replace(tie_embeddings=False), params, str(tmp_path))
    with pytest.raises(ValueError, match=r"params\['block_0'\]\['attn'\]\['wq'\]: expected shape \(64, 8, 8\)"):
        save_hf(SMALL.replace(n_head=8, n_kv_head=2), params, str(tmp_path))


def test_a_tensors_parts_by_rows_of_each_group_read_and_write_back_the_whole():
    """`Tensor.grouped`: parts that take rows `start .. stop - 1` of every group of `size` rows
    (Qwen3-Next's `in_proj_qkvz`, each key head's q, k, v and z together) read each part's rows
    in group order, and written back fill the whole tensor as it was."""
    whole = np.arange(3 * 5 * 2).reshape(15, 2)  # 3 groups of 5 rows: 2 of one part, then 3 of the other
    a = Tensor("w", (6, 2), ("a",), (6, 2), grouped=(5, 0, 2))
    b = Tensor("w", (9, 2), ("b",), (9, 2), grouped=(5, 2, 5))
    np.testing.assert_array_equal(whole[a.index][:, 0], [0, 2, 10, 12, 20, 22])
    np.testing.assert_array_equal(whole[b.index][:, 0], [4, 6, 8, 14, 16, 18, 24, 26, 28])
    assert whole_shape([a, b]) == (15, 2)
    back = np.zeros_like(whole)
    for part in (a, b):
        back[part.index] = whole[part.index]
    np.testing.assert_array_equal(back, whole)
