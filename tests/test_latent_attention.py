"""Multi-head latent attention: the layer against transformers' DeepSeek-V3 and V2 attention, the
absorbed decoding over a latent cache against the expanded form, and the cache's size."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, import_peer, jit_apply, jit_apply_anew, torch_peer, without_modules
from conftest import random_params as random_params_of

from jaxformer import Decoder, DecoderConfig, KVCache, generate
from jaxformer.attention import Part
from jaxformer.cache import Entry
from jaxformer.config import LoraConfig
from jaxformer.convert.rope_pairing import with_rope_pairing
from jaxformer.families.common import rope
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttention, LatentAttentionSpec
from jaxformer.layers import LayerSpec
from jaxformer.lora import init_lora
from jaxformer.positions import rope_attention_factor

D, H, NOPE, ROPE, DV, R, Q_RANK = 32, 4, 8, 8, 6, 16, 12  # v narrower than q and k: the padded paths run
CONFIG = SMALL.replace(n_layer=1, d_model=D)
# rope_scaling as the checkpoints ship it (verbatim): DeepSeek-V3's, Kimi K2's (beta_fast = beta_slow) and
# DeepSeek-V2-Lite's; and one whose mscale and mscale_all_dim differ, which scales cos and sin and the scores.
V3_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096, "type": "yarn"}
K2_YARN = {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096, "type": "yarn"}
V2_LITE_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 4096, "type": "yarn"}
UNEQUAL_YARN = {**V3_YARN, "mscale_all_dim": 0.707}
START = 3000  # the first position: far enough that YaRN's stretched slow pairs turn


def spec_of(rope_scaling: dict | None, q_lora_rank: int | None, pairing: str, **changes) -> LatentAttentionSpec:
    """The layer's spec, its RoPE read from `rope_scaling` as a config.json states it."""
    hf = {"rope_theta": 10000.0, "max_position_embeddings": 163840, "rope_scaling": rope_scaling}
    theta, scaling = rope({**(rope_scaling or {}), "rope_theta": 10000.0}, "rope_scaling", hf)
    return LatentAttentionSpec(n_head=H, q_lora_rank=q_lora_rank, kv_lora_rank=R, qk_nope_head_dim=NOPE,
                               qk_rope_head_dim=ROPE, v_head_dim=DV, rope_theta=theta, rope_scaling=scaling,
                               rope_pairing=pairing, **changes)


def random_params(spec: LatentAttentionSpec, seed: int = 1) -> dict:
    """The layer's matrices drawn at random (float32), its norms' weights around 1."""
    rng = np.random.default_rng(seed)
    params = {name: 0.3 * rng.normal(size=w.shape) for name, w in spec.weights(D).items()}
    params["kv_a_norm"] = {"weight": 1 + 0.2 * rng.normal(size=R)}
    if spec.q_lora_rank is not None:
        params["q_a_norm"] = {"weight": 1 + 0.2 * rng.normal(size=Q_RANK)}
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def part_at(spec, position, key_position, rows, cache=None) -> Part:
    cos, sin, seen = spec.view(position, key_position)
    return Part(rows, position.shape[-1], cos, sin, {spec.attention_type: seen}, cache)


def expanded(spec, variables, x, config=CONFIG, start=START, apply=jit_apply):
    """The layer's output over `x [batch, T, d]` at positions `start ..`, uncached (the expanded form)."""
    position = start + jnp.arange(x.shape[1])
    part = part_at(spec, position, position, x.shape[0])
    return apply(LatentAttention(config, spec), variables, x, (part,))[0]


def torch_state(spec, params) -> dict:
    """Our parameters as transformers' attention's `state_dict` (a Linear's weight is [out, in])."""
    p = {name: np.asarray(a, np.float32) for name, a in params.items() if not isinstance(a, dict)}
    state = {"kv_a_proj_with_mqa.weight": p["wkv_a"].T, "kv_b_proj.weight": p["wkv_b"].reshape(R, -1).T,
             "kv_a_layernorm.weight": np.asarray(params["kv_a_norm"]["weight"]),
             "o_proj.weight": p["wo"].reshape(H * DV, D).T}
    if spec.q_lora_rank is None:
        state["q_proj.weight"] = p["wq"].reshape(D, -1).T
    else:
        state.update({"q_a_proj.weight": p["wq_a"].T, "q_b_proj.weight": p["wq_b"].reshape(Q_RANK, -1).T,
                      "q_a_layernorm.weight": np.asarray(params["q_a_norm"]["weight"])})
    return state


# (transformers' module, q_lora_rank, rope_interleave, rope_scaling): V3 both pairings, V2 its complex pairs.
PEERS = {"v3": ("deepseek_v3", Q_RANK, True, V3_YARN),
         "v3-k2-yarn-no-q-lora": ("deepseek_v3", None, False, K2_YARN),
         "v3-unequal-mscales": ("deepseek_v3", Q_RANK, True, UNEQUAL_YARN),
         "v2-lite": ("deepseek_v2", None, True, V2_LITE_YARN),
         "v2-q-lora-plain-rope": ("deepseek_v2", Q_RANK, True, None)}


@pytest.mark.peers
@pytest.mark.parametrize("case", list(PEERS))
def test_the_layer_equals_transformers_deepseek_attention(case):
    """`LatentAttention` (expanded) against transformers' `DeepseekV3Attention` / `DeepseekV2Attention`
    (eager, torch float32) with its weights copied over, each side's own YaRN rope from the same
    config.json fields, positions from 3000 on, the causal mask written out: within float32
    rounding. The softmax scale and the cos/sin scale are transformers' numbers, and the score
    scale's mscale_all_dim factor counts: the scores scaled by qk_head_dim ** -0.5 alone differ. So do
    the latents' norms (q_a_layernorm, kv_a_layernorm): without either one, the layer is transformers'
    layer without it, and not the layer with it."""
    torch = torch_peer()
    name, q_lora_rank, interleave, rope_scaling = PEERS[case]
    module = import_peer(f"transformers.models.{name}.modeling_{name}")
    spec = spec_of(rope_scaling, q_lora_rank, "interleaved" if interleave else "split_half")
    batch, T = 2, 12
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, T, D)), jnp.float32)
    params = random_params(spec)
    ours = np.asarray(expanded(spec, {"params": params}, x))

    prefix = "DeepseekV3" if name == "deepseek_v3" else "DeepseekV2"
    rope_parameters = {"rope_type": "default"} if rope_scaling is None else {
        "rope_type": "yarn", **{k: v for k, v in rope_scaling.items() if k != "type"}}
    fields = dict(rope_interleave=interleave) if name == "deepseek_v3" else {}
    hf_config = getattr(module, f"{prefix}Config")(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=H, num_hidden_layers=1, q_lora_rank=q_lora_rank,
        kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=DV, max_position_embeddings=163840,
        rope_parameters={**rope_parameters, "rope_theta": 10000.0}, **fields)
    hf_config._attn_implementation = "eager"
    layer = getattr(module, f"{prefix}Attention")(hf_config, layer_idx=0).eval()
    layer.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in torch_state(spec, params).items()})
    rotary = getattr(module, f"{prefix}RotaryEmbedding")(hf_config)
    assert spec.softmax_scale == pytest.approx(layer.scaling, rel=1e-12)
    assert rope_attention_factor(spec.rope_scaling) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    x_torch = torch.from_numpy(np.array(x))
    causal = torch.triu(torch.full((T, T), torch.finfo(torch.float32).min), diagonal=1)[None, None]
    with torch.no_grad():
        angles = rotary(x_torch, START + torch.arange(T)[None].expand(batch, T))
        want = layer(x_torch, position_embeddings=angles, attention_mask=causal)[0].numpy()
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    if spec.softmax_scale != spec.qk_head_dim ** -0.5:
        plain = np.asarray(expanded(dataclasses.replace(spec, scale=spec.qk_head_dim ** -0.5), {"params": params}, x))
        assert np.abs(plain - want).max() > 100 * 1e-5 * np.abs(want).max()
    # Each latent's norm removed from both layers: they agree again, and differ from the layer with it.
    for norm, hf_norm in [("kv_a_norm", "kv_a_layernorm")] + ([("q_a_norm", "q_a_layernorm")] if q_lora_rank else []):
        with without_modules((norm,)):
            unnormed = np.asarray(expanded(spec, {"params": params}, x, apply=jit_apply_anew))
        kept = getattr(layer, hf_norm)
        setattr(layer, hf_norm, torch.nn.Identity())
        with torch.no_grad():
            want_unnormed = layer(x_torch, position_embeddings=angles, attention_mask=causal)[0].numpy()
        setattr(layer, hf_norm, kept)
        np.testing.assert_allclose(unnormed, want_unnormed, rtol=1e-5, atol=1e-5 * np.abs(want_unnormed).max())
        assert np.abs(unnormed - want).max() > 100 * 1e-5 * np.abs(want).max(), f"{norm} removed changes nothing"


def latent_cache(batch: int, slots: int, spec: LatentAttentionSpec, dtype=jnp.float32) -> KVCache:
    """An empty cache of one latent layer: k the latents `[batch, slots, 1, r]`, v the RoPE keys."""
    kind, (latent, rope_key) = spec.cache_entry
    assert kind == spec.attention_type and latent == (1, R) and rope_key == (1, ROPE)
    return KVCache.zeros(batch, slots, n_layer=1, n_kv_head=1, head_dim=1, max_seq_len=slots, dtype=dtype,
                         entries=(Entry(*spec.cache_entry),))


def cached_calls(spec, variables, x, pieces, config=CONFIG, slots=24):
    """The layer's outputs over `x`'s tokens fed in `pieces` (their lengths, in order) over one
    latent cache, each call at the cache's positions (from 0): `[batch, T, d]` concatenated."""
    @jax.jit
    def call(variables, x, cache):
        position = cache.pos[:, None] + jnp.arange(x.shape[1])[None]  # [batch, n]
        part = part_at(spec, position, jnp.arange(slots), x.shape[0], cache)
        return LatentAttention(config, spec).apply(variables, x, (part,), 0)

    cache, outs, start = latent_cache(x.shape[0], slots, spec), [], 0
    for n in pieces:
        y, (cache,), _ = call(variables, x[:, start:start + n], cache)
        cache, start = cache.advance(n), start + n
        outs.append(y)
    return jnp.concatenate(outs, axis=1)


@pytest.mark.parametrize("case", ["prompt-then-steps", "two-pieces", "lora-no-q-lora", "window"])
def test_absorbed_decoding_over_the_latent_cache_equals_the_expanded_form(case):
    """A prompt prefilled into the latent cache then tokens one at a time (or a prompt in two
    pieces), attending in the latent space with W_UK and W_UV absorbed, gives the expanded form's
    outputs over the whole sequence; with LoRA on every matrix (kv_b_proj's adapter merged into the
    absorbed halves), and over a window (positions read by `Visibility`, the cache's slots whole)."""
    T = 9
    q_lora_rank = None if case == "lora-no-q-lora" else Q_RANK
    spec = spec_of(V3_YARN, q_lora_rank, "interleaved", window=4 if case == "window" else None)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, T, D)), jnp.float32)
    params = random_params(spec, seed=4)
    variables, config = {"params": params}, CONFIG
    if case == "lora-no-q-lora":
        lora = LoraConfig(rank=2, alpha=2.0, targets=("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
        config = CONFIG.replace(lora=lora)
        adapters = init_lora({"block_0": {"attn": params}}, lora, jax.random.key(5))["block_0"]["attn"]
        rng = np.random.default_rng(6)
        adapters = jax.tree.map(lambda a: a + 0.2 * rng.normal(size=a.shape).astype(np.float32), adapters)  # b != 0
        variables = {"params": params, "lora": adapters}
        assert not np.allclose(expanded(spec, variables, x, config), expanded(spec, {"params": params}, x))
    want = expanded(spec, variables, x, config, start=0)  # (at the cache's positions: the same RoPE rounding)
    pieces = [4, 5] if case == "two-pieces" else [5] + [1] * (T - 5)
    got = cached_calls(spec, variables, x, pieces, config)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def decoder_of(spec: LatentAttentionSpec, n_layer: int = 2, **changes) -> DecoderConfig:
    """A decoder of `n_layer` latent attention layers (and gated MLPs 48 wide) on `CONFIG`'s widths."""
    return CONFIG.replace(n_layer=n_layer, rope_pairing=spec.rope_pairing, max_seq_len=64,
                          layers=(LayerSpec(spec, GatedMLPSpec(48)),) * n_layer, **changes)


@pytest.mark.parametrize("scanned", [False, True], ids=["layers", "scanned"])
def test_a_decoder_of_latent_layers_decodes_over_its_cache_as_its_full_forward(scanned):
    """A decoder whose layers are latent attention: its cache (`KVCache.create`, each layer's
    entry a latent and a RoPE key a slot) prefilled with a prompt, then a token a step, gives the
    full forward's logits; each layer's RoPE is over its rope channels (`views` keys it so)."""
    spec = spec_of(V3_YARN, Q_RANK, "interleaved")
    config = decoder_of(spec, scan_layers=scanned)
    model = Decoder(config)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    rng = np.random.default_rng(7)  # (numpy's draws: no program compiled per shape) norms' weights around 1
    params = {"params": jax.tree.map(lambda a: jnp.asarray((a.ndim == 1) + 0.3 * rng.normal(size=a.shape),
                                                           jnp.float32), shapes)}
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 64, (2, 10)), jnp.int32)
    want = jit_apply(model, params, tokens)[0]
    cache = model.init_cache(2, 16)
    assert [leaf.shape[-2:] for leaf in jax.tree.leaves(cache.layers)][:2] == [(1, R), (1, ROPE)]
    got = []
    for start, stop in [(0, 6)] + [(t, t + 1) for t in range(6, 10)]:
        logits, cache = jit_apply(model, params, tokens[:, start:stop], cache)
        got.append(logits)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_the_cache_keeps_the_latent_and_the_rope_key_a_token():
    """DeepSeek-V3's layer: 512 + 64 = 576 numbers a token and layer in the latent cache, against
    128 heads x (128 + 64 + 128) = 40,960 for the expanded keys and values (71x)."""
    spec = LatentAttentionSpec(n_head=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                               qk_rope_head_dim=64, v_head_dim=128, rope_theta=1e4, rope_scaling=None)
    config = decoder_of(spec, n_layer=1, n_head=128, n_kv_head=128, d_model=7168, cache_dtype=jnp.bfloat16)
    cache = KVCache.create(config, 1, capacity=32)
    per_token = cache.nbytes // cache.capacity  # one row, one layer
    assert per_token == (512 + 64) * 2
    expanded_heads = spec.n_head * (spec.qk_head_dim + spec.v_head_dim) * 2
    assert expanded_heads == 40960 * 2 and expanded_heads / per_token == pytest.approx(71.1, abs=0.05)


def test_moving_the_rope_pairing_refuses_latent_layers():
    """`with_rope_pairing` permutes GQA's q and k channels: a latent layer's RoPE channels are parts of
    its query's and latent's projections, refused in one line rather than permuted wrong."""
    config = decoder_of(spec_of(None, Q_RANK, "interleaved"))
    with pytest.raises(ValueError, match="a mixer other than attention rotating all of q and k"):
        with_rope_pairing(config, {}, "split_half")


def test_ragged_prompts_and_beams_over_the_latent_cache_decode_as_each_prompt_alone():
    """A decoder of latent layers (a ring of 6 keys, then a full layer): rows of 3 and 12 tokens, the
    shorter padded, decoded greedily and by 3 beams (which reorder the latents and rope keys with the
    rows) give each row's tokens of its prompt decoded alone."""
    spec = spec_of(None, Q_RANK, "split_half")
    config = CONFIG.replace(n_layer=2, max_seq_len=64, layers=(LayerSpec(dataclasses.replace(spec, window=6),
                                                                         GatedMLPSpec(48)),
                                                               LayerSpec(spec, GatedMLPSpec(48))))
    model, params = Decoder(config), random_params_of(config, seed=4, scale=0.5)
    prompts = [np.arange(3) % 64, (np.arange(12) * 7) % 64]
    batch = np.zeros((2, 12), np.int32)
    batch[0, :3], batch[1] = prompts
    for options in (dict(), dict(num_beams=3)):
        out = generate(model, params, batch, prompt_lengths=np.array([3, 12]), max_new_tokens=16, **options)
        for row, prompt in enumerate(prompts):
            alone = generate(model, params, prompt[None], max_new_tokens=16, **options)
            np.testing.assert_array_equal(out[row, 12:], alone[0, len(prompt):], err_msg=str(options))
        assert len(np.unique(np.asarray(out[:, 12:]))) > 5
