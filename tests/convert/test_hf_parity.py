"""jaxformer against Hugging Face transformers itself, on tiny random checkpoints made here.

Every checkpoint's weights are redrawn at a large scale (std 0.25), so attention is sharp
and the logits are far from uniform (|logit| up to ~8): a wrong RoPE pairing, head
grouping, bias or layout moves them by whole units, far beyond the 1e-4 float32
tolerance. At that scale each float32 implementation stays within ~2e-5 of a float64 run
of transformers; sharper models amplify float32 rounding itself toward 1e-4 (at std 0.3
transformers' own float32 logits are 5e-5 from its float64 ones).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, greedy_tokens_compared, import_peer, jit_apply, random_params

from jaxformer import Decoder, KVCache, RopeScaling, generate
from jaxformer.convert import config_from_hf, load_hf, save_hf
from jaxformer.positions import rope_attention_factor, rope_inv_freq
from tests.families.shipped import scaled_up

torch = import_peer("torch")
transformers = import_peer("transformers")
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402 (after the skip)

pytestmark = pytest.mark.peers

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PEERS = {
    "llama-tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-untied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama-mqa": lambda: transformers.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}),
    # head_dim 24 > hidden / heads = 16; the default 4096 window is longer than any sequence.
    "mistral": lambda: transformers.MistralConfig(**COMMON, head_dim=24),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),  # q/k/v biases, untied
    # Llama 3.2's RoPE exactly as shipped (its 8192-token original context, theta 5e5).
    "llama3.2": lambda: transformers.LlamaConfig(**{**COMMON, "rope_parameters": LLAMA3_ROPE},
                                                 tie_word_embeddings=True),
}
PROMPT_LEN, NEW_TOKENS = 8, 64
TOLERANCE = 1e-4  # float32, with logits of magnitude ~10


@pytest.fixture(scope="module", params=sorted(PEERS))
def peer(request, tmp_path_factory):
    """(hf_model, config, params): a tiny random HF model, saved, and loaded by jaxformer."""
    hf_model = scaled_up(transformers.AutoModelForCausalLM.from_config(PEERS[request.param]()), seed=0).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path)
    config, params = load_hf(str(path))
    return hf_model, config, params


@pytest.fixture(scope="module")
def hf_greedy(peer):
    """transformers' greedy `generate`: its tokens and the raw logits of every step."""
    hf_model, config, _ = peer
    prompt = torch.randint(0, config.vocab_size, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).numpy()  # [batch, NEW_TOKENS, vocab]
    return prompt.numpy(), out.sequences.numpy(), logits


def test_logits_match(peer, optimized_programs):  # compiled as users get it
    hf_model, config, params = peer
    tokens = torch.randint(0, config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf_model(tokens).logits.numpy()
    got, _ = jax.jit(Decoder(config).apply)({"params": params}, jnp.asarray(tokens.numpy()))
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    # The comparison has teeth: sharp logits, and the other RoPE pairing is far off.
    assert np.abs(want).max() > 5.0
    wrong, _ = jax.jit(Decoder(config.replace(rope_pairing="interleaved")).apply)({"params": params}, tokens.numpy())
    assert np.abs(wrong - want).max() > 1.0
    if config.rope_scaling is not None:  # and the scaling is not ignored
        unscaled, _ = jax.jit(Decoder(config.replace(rope_scaling=None)).apply)({"params": params}, tokens.numpy())
        assert np.abs(unscaled - want).max() > 100 * TOLERANCE


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("head_dim", [16, 128])
@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500000.0}, LLAMA3_ROPE,
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    YARN_ROPE,  # Qwen2.5's long-context setting
    {**YARN_ROPE, "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.707, "truncate": False},
    {**YARN_ROPE, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 4096},
], ids=["default", "llama3", "linear", "yarn", "yarn-untruncated", "yarn-mscale"])
def test_rope_frequencies_equal_transformers(rope, head_dim):
    """`rope_inv_freq` and `rope_attention_factor` of the config `load_hf` reads against
    transformers' own. Pair i's frequency depends on `theta ** (2i/d)` alone, which torch
    computes with its float32 pow, not always correctly rounded (ours is): where the two
    powers agree, the frequencies are equal bit for bit (the same float32 steps after it);
    where they differ by their one ulp, within two. And the same scale of cos and sin."""
    hf_config = transformers.LlamaConfig(**{**COMMON, "rope_parameters": rope, "head_dim": head_dim,
                                            "max_position_embeddings": 131072})
    want = LlamaRotaryEmbedding(hf_config).inv_freq.numpy()  # the module transformers' Llama rotates q and k with
    config = config_from_hf(hf_config.to_dict())
    got = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert got.dtype == np.float32 and got.shape == want.shape
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    same_power = (np.float64(config.rope_theta) ** exponent).astype(np.float32) == (
        config.rope_theta ** torch.from_numpy(exponent)).numpy()
    assert same_power.mean() > 0.9
    np.testing.assert_array_equal(got[same_power], want[same_power])
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulps.max() <= 2, ulps
    assert np.float32(rope_attention_factor(config.rope_scaling)) == np.float32(
        LlamaRotaryEmbedding(hf_config).attention_scaling)


def test_greedy_generation_matches_token_for_token(peer, hf_greedy):
    """Token for token wherever transformers' choice is no near-tie. The error model: every
    step's float32 logits are within TOLERANCE of transformers' own step's (the test below holds
    them there; `generate` runs the same steps in one program, rounded alike), so the two
    argmaxes can differ only where transformers' top two are within 2 * TOLERANCE: a choice
    that close is not compared, nor the row's tokens after it."""
    _, config, params = peer
    prompt, want, logits = hf_greedy
    got = generate(Decoder(config), params, jnp.asarray(prompt), max_new_tokens=NEW_TOKENS)
    assert len(np.unique(want[:, PROMPT_LEN:])) > 10  # a varied continuation, not one repeated token
    np.testing.assert_array_equal(got[:, :PROMPT_LEN], prompt)
    compared = greedy_tokens_compared(got[:, PROMPT_LEN:], want[:, PROMPT_LEN:], logits, bound=2 * TOLERANCE)
    assert compared >= want[:, PROMPT_LEN:].size // 2  # (sharp logits: near-ties are rare)


def test_cached_decoding_logits_match_at_every_step(peer, hf_greedy):
    """Prefill the prompt, then feed transformers' tokens one at a time through the cache."""
    _, config, params = peer
    prompt, sequences, want = hf_greedy
    model = Decoder(config)
    step = jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache))
    logits, cache = step(jnp.asarray(prompt), KVCache.create(config, 2, capacity=PROMPT_LEN + NEW_TOKENS))
    got = [logits[:, -1]]
    for t in range(PROMPT_LEN, PROMPT_LEN + NEW_TOKENS - 1):
        logits, cache = step(jnp.asarray(sequences[:, t:t + 1]), cache)
        got.append(logits[:, 0])
    np.testing.assert_allclose(np.stack(got, axis=1), want, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("changes", [
    dict(),  # Llama, tied
    dict(tie_embeddings=False, n_kv_head=1),
    dict(qkv_bias=True, tie_embeddings=False),  # written as Qwen2
    dict(rope_pairing="interleaved"),  # permuted to split-half on the way out
    dict(head_dim_override=24),
    dict(rope_theta=500000.0, rope_scaling=RopeScaling("llama3", 32.0, original_max_position_embeddings=8192,
                                                       low_freq_factor=1.0, high_freq_factor=4.0)),
    dict(rope_theta=1e6, rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16)),
])
def test_save_hf_loads_in_transformers_with_the_same_logits(tmp_path, changes):
    config = SMALL.replace(**changes)
    params = random_params(config, seed=5)
    save_hf(config, params, str(tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf_model).__name__ == ("Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM")
    tokens = np.arange(2 * 30).reshape(2, 30) * 7 % config.vocab_size
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    got, _ = jit_apply(Decoder(config), {"params": params}, tokens)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    if config.rope_scaling is not None:  # the scaling went both ways: without it, other logits
        unscaled, _ = jit_apply(Decoder(config.replace(rope_scaling=None)), {"params": params}, tokens)
        assert np.abs(unscaled - want).max() > 100 * TOLERANCE


def test_bfloat16_checkpoint_loads_as_its_float32_values(tmp_path):
    hf_model = scaled_up(transformers.AutoModelForCausalLM.from_config(PEERS["qwen2"]()), seed=3).to(torch.bfloat16)
    hf_model.save_pretrained(tmp_path)
    _, params = load_hf(str(tmp_path))
    want = hf_model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [n_head * head_dim, d_model]
    np.testing.assert_array_equal(params["block_1"]["attn"]["wq"].reshape(64, -1).T, want)
    np.testing.assert_array_equal(params["block_1"]["attn"]["bq"].reshape(-1),
                                  hf_model.model.layers[1].self_attn.q_proj.bias.detach().float().numpy())
