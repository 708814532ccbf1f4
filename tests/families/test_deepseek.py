"""DeepSeek's families read from their config.json (transformers itself: tests/families/test_families.py):
Kimi K2's own `model_type`, the fields refused in one line, and the multi-token prediction layers a
checkpoint stores past the last, skipped as `load_hf` reads it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from shipped import SHIPPED, tiny

from jaxformer import Decoder
from jaxformer.convert import config_from_hf, load_hf, save_hf


def test_kimi_k2_is_read_as_deepseek_v3_under_its_own_name():
    kimi = tiny("Kimi-K2-Instruct", quantization_config=None)
    config = config_from_hf(kimi, max_seq_len=64)
    assert config == config_from_hf({**kimi, "model_type": "deepseek_v3"}, max_seq_len=64).replace(
        hf_model_type="kimi_k2")
    mixer = config.layers[0].mixer
    assert (mixer.rope_scaling.beta_fast, mixer.rope_scaling.beta_slow) == (1.0, 1.0)  # Kimi's ramp of no width
    assert config.layers[1].ffn.n_group == 1 and config.layers[1].ffn.routed_scale == 2.827


@pytest.mark.parametrize("name, changes, message", [
    ("DeepSeek-V3", dict(quantization_config={"quant_method": "fp8", "weight_block_size": None}),
     "quantization_config.weight_block_size: must be two positive ints"),
    ("DeepSeek-V2-Lite", dict(topk_method="group_limited_greedy"), "topk_method: must be 'greedy'"),
    ("DeepSeek-V2-Lite", dict(routed_scaling_factor=16.0), "routed_scaling_factor: must be 1.0"),
    ("DeepSeek-V3", dict(quantization_config=None, scoring_func="softmax"), "scoring_func: must be 'sigmoid'"),
    ("DeepSeek-V3", dict(quantization_config=None, attention_bias=True), "attention_bias: must be false"),
    ("DeepSeek-V3", dict(quantization_config=None, first_k_dense_replace=62), "first_k_dense_replace: must be at"),
])
def test_what_is_not_computed_exactly_is_refused_naming_the_field(name, changes, message):
    with pytest.raises(ValueError, match=f"config.json {message}"):
        config_from_hf({**SHIPPED[name], **changes}, max_seq_len=64)


def test_the_shipped_fields_read_as_the_checkpoints_state_them():
    v3 = config_from_hf(dict(SHIPPED["DeepSeek-V3"], quantization_config=None), max_seq_len=64)
    mixer, experts = v3.layers[0].mixer, v3.layers[3].ffn
    assert [type(spec.ffn).__name__ for spec in v3.layers[:4]] == ["GatedMLPSpec"] * 3 + ["ExpertsSpec"]
    assert (mixer.q_lora_rank, mixer.kv_lora_rank, mixer.rope_pairing) == (1536, 512, "interleaved")
    assert mixer.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2, rel=1e-12)
    assert (experts.n_group, experts.topk_group, experts.shared_width) == (8, 4, 2048)
    lite = config_from_hf(SHIPPED["DeepSeek-V2-Lite"], max_seq_len=64)
    assert lite.layers[0].mixer.q_lora_rank is None and lite.layers[1].ffn.shared_width == 2 * 1408
    assert not lite.layers[1].ffn.normalize and lite.layers[1].ffn.routing == "softmax_topk"
    split = config_from_hf(dict(SHIPPED["DeepSeek-V3"], quantization_config=None, rope_interleave=False))
    assert split.rope_pairing == split.layers[0].mixer.rope_pairing == "split_half"


def test_the_prediction_layers_past_the_last_are_skipped_and_nothing_else(tmp_path):
    """A folder as DeepSeek ships it, with its multi-token prediction module stored as layer
    `num_hidden_layers` (its own tensors and a whole layer's): `load_hf` reads the decoder alone; a
    tensor that belongs to no layer of the model is still refused. `save_hf` keeps the interleaved
    pairing as it is (transformers' DeepSeek-V3 reads it so: `rope_interleave`)."""
    config = config_from_hf(tiny("DeepSeek-V3", quantization_config=None, num_hidden_layers=2), max_seq_len=64)
    shapes = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(np.float32), shapes)
    save_hf(config, params, str(tmp_path))
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    assert tensors["model.layers.0.self_attn.q_b_proj.weight"].shape == (4 * 16, 24)  # as ours, not permuted
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_b_proj.weight"],
                                  params["block_0"]["attn"]["wq_b"].reshape(24, -1).T)
    mtp = {"model.layers.2.eh_proj.weight": np.zeros((64, 128), np.float32),
           "model.layers.2.self_attn.kv_b_proj.weight": tensors["model.layers.0.self_attn.kv_b_proj.weight"]}
    save_file({**tensors, **mtp}, file)
    loaded_config, loaded = load_hf(str(tmp_path), max_seq_len=64)
    assert loaded_config == config
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    save_file({**tensors, "model.norm.extra": np.zeros(3, np.float32)}, file)
    with pytest.raises(ValueError, match="unexpected \\['model.norm.extra'\\]"):
        load_hf(str(tmp_path), max_seq_len=64)
