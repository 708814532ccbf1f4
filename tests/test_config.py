import dataclasses

import jax.numpy as jnp
import pytest

from jaxformer import DecoderConfig, RopeScaling, VanillaConfig
from jaxformer.config import swiglu_hidden_dim


def test_reference_defaults():
    c = DecoderConfig()
    assert (c.vocab_size, c.n_layer, c.n_head, c.n_kv_head, c.d_model, c.max_seq_len) == (256, 4, 8, 2, 256, 512)
    assert (c.rope_theta, c.norm_eps, c.rope_pairing, c.tie_embeddings) == (1e4, 1e-6, "split_half", True)
    assert c.dtype == jnp.float32
    assert c.ffn_dim == 704 == round(256 * 8 / 3 / 64) * 64
    assert (c.head_dim, c.n_rep) == (32, 4)


def test_frozen_and_replace_revalidates():
    c = DecoderConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 128
    wider = c.replace(d_model=512)
    assert wider.ffn_dim == swiglu_hidden_dim(512) == 1344  # the derived width follows d_model
    assert DecoderConfig(d_ff=100).ffn_dim == 100
    with pytest.raises(ValueError, match="n_head"):
        c.replace(n_kv_head=3)
    assert DecoderConfig(dtype="bfloat16").dtype == jnp.bfloat16


def test_head_dim_override_frees_the_head_width_from_d_model():
    c = DecoderConfig(d_model=250, n_head=5, n_kv_head=1, head_dim_override=64)  # 250 / 5 would be 50
    assert c.head_dim == 64 and c.replace(d_model=500).head_dim == 64
    assert c.replace(head_dim_override=None, d_model=320).head_dim == 64  # back to the rule


def test_vanilla_final_norm_follows_norm_first_unless_set():
    c = VanillaConfig(src_vocab_size=10, tgt_vocab_size=10)
    assert not c.has_final_norm and c.replace(norm_first=True).has_final_norm
    assert c.replace(final_norm=True).has_final_norm  # torch's nn.Transformer: post-norm with final norms
    assert not c.replace(norm_first=True, final_norm=False).has_final_norm


@pytest.mark.parametrize("changes, field, rule", [
    (dict(d_model=250), "d_model", "divisible by n_head"),
    (dict(n_head=8, n_kv_head=3), "n_head", "divisible by n_kv_head"),
    (dict(d_model=24, n_head=8, n_kv_head=2), "d_model", "even"),
    (dict(vocab_size=0), "vocab_size", "positive"),
    (dict(n_layer=-1), "n_layer", "positive"),
    (dict(n_head=0), "n_head", "positive"),
    (dict(n_kv_head=0), "n_kv_head", "positive"),
    (dict(d_model=0), "d_model", "positive"),
    (dict(max_seq_len=0), "max_seq_len", "positive"),
    (dict(max_seq_len=1.5), "max_seq_len", "positive int"),
    (dict(d_ff=0), "d_ff", "positive"),
    (dict(rope_theta=0.0), "rope_theta", "> 0"),
    (dict(norm_eps=-1e-6), "norm_eps", "> 0"),
    (dict(rope_pairing="adjacent"), "rope_pairing", "one of"),
    (dict(dtype=jnp.int32), "dtype", "floating"),
    (dict(head_dim_override=0), "head_dim_override", "positive"),
    (dict(head_dim_override=15), "head_dim_override", "even"),
])
def test_each_rule_names_field_and_rule(changes, field, rule):
    with pytest.raises(ValueError, match=rf"DecoderConfig\.{field} must be .*{rule}"):
        DecoderConfig(**changes)


@pytest.mark.parametrize("fields, message", [
    (dict(kind="dynamic", factor=2.0),
     r"RopeScaling.kind must be one of \('linear', 'llama3', 'yarn', 'longrope', 'proportional'\)"),
    (dict(kind="proportional", factor=1.0), r"RopeScaling.partial_rotary_factor must be a finite number > 0"),
    (dict(kind="proportional", factor=1.0, partial_rotary_factor=1.5),
     r"RopeScaling.partial_rotary_factor must be at most 1 \(got 1.5\)"),
    (dict(kind="linear", factor=2.0, partial_rotary_factor=0.5),
     r"RopeScaling.partial_rotary_factor must be None for kind='linear'"),
    (dict(kind="longrope", factor=2.0, original_max_position_embeddings=64, short_factor=[1.0], long_factor=[0.0]),
     r"RopeScaling.long_factor must be a list of finite numbers > 0, one per RoPE pair"),
    (dict(kind="longrope", factor=2.0, original_max_position_embeddings=64, short_factor=[1.0], long_factor=[1, 2]),
     r"RopeScaling.long_factor must be as long as short_factor \(1\)"),
    (dict(kind="linear", factor=0.0), r"RopeScaling.factor must be a finite number > 0 \(got 0.0\)"),
    (dict(kind="linear", factor=2.0, original_max_position_embeddings=64),
     r"RopeScaling.original_max_position_embeddings must be None for kind='linear' \(got 64\)"),
    (dict(kind="llama3", factor=8.0, original_max_position_embeddings=64, low_freq_factor=4.0, high_freq_factor=1.0),
     r"RopeScaling.high_freq_factor must be above low_freq_factor=4 \(got 1.0\)"),
    (dict(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
     r"RopeScaling.original_max_position_embeddings must be a positive int \(got None\)"),
    (dict(kind="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=0.5),
     r"RopeScaling.beta_fast must be at least beta_slow=1 \(got 0.5\)"),
    (dict(kind="yarn", factor=4.0, original_max_position_embeddings=64, low_freq_factor=1.0),
     r"RopeScaling.low_freq_factor must be None for kind='yarn' \(got 1.0\)"),
    (dict(kind="yarn", factor=4.0, original_max_position_embeddings=64, truncate="yes"),
     r"RopeScaling.truncate must be None or a bool \(got 'yes'\)"),
])
def test_rope_scaling_refuses_what_it_cannot_mean(fields, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling(**fields)


def test_rope_scaling_in_a_config_and_yarns_defaults_follow_the_factor():
    yarn = RopeScaling("yarn", 4.0, original_max_position_embeddings=64)
    assert yarn.ramp == (32.0, 1.0, True) and yarn.cos_sin_scale == pytest.approx(1 + 0.1 * 1.3862943611198906)
    assert yarn.replace(factor=1.0).cos_sin_scale == 1.0 and RopeScaling("linear", 4.0).cos_sin_scale == 1.0
    assert DecoderConfig(rope_scaling=yarn).rope_scaling is yarn
    with pytest.raises(ValueError, match=r"DecoderConfig.rope_scaling must be None or a RopeScaling"):
        DecoderConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0})
