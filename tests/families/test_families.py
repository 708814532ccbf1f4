"""Every checkpoint family against transformers itself, on tiny random checkpoints whose
config.json keeps every architectural field of the one the hub ships (`shipped.tiny`):
saved by transformers as sharded bfloat16, as checkpoints ship, and loaded by jaxformer.

The reference is transformers' float32 forward of the same (bfloat16-valued) weights.
Weights are redrawn far from ties (`shipped.scaled_up`), so that a wrong detail moves the
logits by far more than the float32 tolerance; each prompt is longer
than the shrunk sliding window (8), so a window that were ignored would show.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import greedy_tokens_compared, import_peer, jit_apply, jit_apply_anew, torch_peer, without_modules
from shipped import scaled_up, tiny

from jaxformer import Decoder, KVCache, generate
from jaxformer.convert import load_hf, save_hf, with_scan_layers
from jaxformer.dense_experts import DenseAndExpertsSpec
from jaxformer.experts import ExpertsSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttentionSpec
from jaxformer.layers import layer_specs, shares_kv

torch = torch_peer()
transformers = import_peer("transformers")

pytestmark = pytest.mark.peers

CHECKPOINTS = ["Llama-3.2-1B", "Qwen3-0.6B", "Mistral-7B-v0.1", "gemma-2b", "gemma-2-2b", "gemma-3-1b-it",
               "Phi-3-mini-4k-instruct", "Phi-3 longrope", "Qwen2.5-0.5B", "SmolLM2-135M", "SmolLM3-3B",
               "OLMo-2-1124-7B", "Olmo-3-1025-7B", "Qwen3-30B-A3B", "Mixtral-8x7B-v0.1", "Qwen1.5-MoE-A2.7B",
               "OLMoE-1B-7B-0924", "gpt-oss-20b", "DeepSeek-V3", "Kimi-K2-Instruct", "DeepSeek-V2-Lite",
               "gemma-4-E2B-it", "gemma-4-26B-A4B-it"]
MAX_SEQ_LEN = 64
PROMPT_LEN, NEW_TOKENS = 12, 40
TOLERANCE = 1e-4  # float32, logits of magnitude ~10 (as tests/convert/test_hf_parity.py)

# Each feature a family's config switches on, and the config with it off: without it the
# logits must move (so each test above would fail if the feature were ignored).
FEATURES_OFF = {
    "sliding_window": dict(layer_types=None, sliding_window=None, local_rope_theta=None),
    "local_rope_theta": dict(local_rope_theta=None),
    "rope_scaling": dict(rope_scaling=None),
    "qkv_bias": dict(qkv_bias=False),
    "qk_norm": dict(qk_norm=False),
    "norm_plus_one": dict(norm_plus_one=False),
    "mlp_activation": dict(mlp_activation="silu"),
    "embed_scale": dict(embed_scale=False),
    "query_pre_attn_scalar": dict(query_pre_attn_scalar=None),
    "attn_logit_softcap": dict(attn_logit_softcap=None),
    "final_logit_softcap": dict(final_logit_softcap=None),
    "post_norms": dict(post_norms=False),
    "layer_scalar": dict(layer_scalar=False),
    "per_layer_width": dict(per_layer_width=None, per_layer_vocab_size=None),
}
# What each family's config switches on, as read from its config.json.
SWITCHED_ON = {
    "Llama-3.2-1B": {"rope_scaling"},
    "Qwen3-0.6B": {"qk_norm"},
    "Mistral-7B-v0.1": {"sliding_window"},
    "gemma-2b": {"norm_plus_one", "mlp_activation", "embed_scale"},
    "gemma-2-2b": {"sliding_window", "norm_plus_one", "mlp_activation", "embed_scale", "query_pre_attn_scalar",
                   "attn_logit_softcap", "final_logit_softcap", "post_norms"},
    "gemma-3-1b-it": {"sliding_window", "local_rope_theta", "qk_norm", "norm_plus_one", "mlp_activation",
                      "embed_scale", "query_pre_attn_scalar", "post_norms"},
    "Phi-3-mini-4k-instruct": {"sliding_window"},
    "Phi-3 longrope": {"rope_scaling"},
    "Qwen2.5-0.5B": {"qkv_bias"},
    "SmolLM2-135M": set(),
    "SmolLM3-3B": set(),
    "OLMo-2-1124-7B": {"qk_norm"},
    "Olmo-3-1025-7B": {"sliding_window", "local_rope_theta", "rope_scaling", "qk_norm"},
    "Qwen3-30B-A3B": {"qk_norm"},
    "Mixtral-8x7B-v0.1": set(),
    "Qwen1.5-MoE-A2.7B": {"qkv_bias"},
    "OLMoE-1B-7B-0924": {"qk_norm"},
    "gpt-oss-20b": {"sliding_window", "rope_scaling", "qkv_bias"},
    "DeepSeek-V3": {"rope_scaling"},
    "Kimi-K2-Instruct": {"rope_scaling"},
    "DeepSeek-V2-Lite": {"rope_scaling"},
    # (Gemma 4: rope_scaling is its global layers' proportional RoPE; query_pre_attn_scalar 1, its unscaled scores)
    "gemma-4-E2B-it": {"sliding_window", "local_rope_theta", "rope_scaling", "qk_norm", "mlp_activation",
                       "embed_scale", "query_pre_attn_scalar", "final_logit_softcap", "post_norms", "layer_scalar",
                       "per_layer_width"},
    "gemma-4-26B-A4B-it": {"sliding_window", "local_rope_theta", "rope_scaling", "qk_norm", "mlp_activation",
                           "embed_scale", "query_pre_attn_scalar", "final_logit_softcap", "post_norms",
                           "layer_scalar"},
}
# Each routing feature of a family of experts, its layers' `ExpertsSpec` with the feature switched
# (off, or to its other value), and the families that have it: the logits must move.
EXPERT_FEATURES_OFF = {
    "normalize": lambda spec: dataclasses.replace(spec, normalize=not spec.normalize),
    "top_k": lambda spec: dataclasses.replace(spec, top_k=spec.top_k - 1),
    "shared_gate": lambda spec: dataclasses.replace(spec, shared_gate=False),
    "swiglu_limit": lambda spec: dataclasses.replace(spec, swiglu_limit=1e4),
    "routed_scale": lambda spec: dataclasses.replace(spec, routed_scale=1.0),
    "topk_group": lambda spec: dataclasses.replace(spec, topk_group=spec.n_group),
    "router_norm": lambda spec: dataclasses.replace(spec, router_norm=False),
    "expert_scale": lambda spec: dataclasses.replace(spec, expert_scale=False),
}
# ... and of an attention layer: gpt-oss's sinks, SmolLM3's NoPE layers (made to rotate as the others); a
# latent attention's RoPE pairing (interleaved, as DeepSeek's checkpoints rotate) and its score scale's YaRN
# factor (mscale_all_dim); Gemma 4's norm of the values, the keys' projection as the values (off: a projection
# of their own, drawn for the guard), and the last layers reading earlier ones' keys and values (off: their
# own, from projections drawn for the guard).
MIXER_FEATURES_OFF = {"sinks": lambda spec: dataclasses.replace(spec, sinks=False),
                      "use_rope": lambda spec: dataclasses.replace(spec, use_rope=True),
                      "rope_pairing": lambda spec: dataclasses.replace(spec, rope_pairing="split_half"),
                      "mscale_all_dim": lambda spec: dataclasses.replace(spec, scale=spec.qk_head_dim ** -0.5),
                      "v_norm": lambda spec: dataclasses.replace(spec, v_norm=False),
                      "k_eq_v": lambda spec: dataclasses.replace(spec, k_eq_v=False),
                      "kv_shared": lambda spec: dataclasses.replace(spec, kv_shared=False)}
LATENT = {"rope_pairing", "mscale_all_dim"}
# ... and a latent attention's norms of its latents (DeepSeek's q_a_layernorm, where the query has a latent, and
# kv_a_layernorm), each removed: its module returns its input (`without_modules`).
LATENT_NORMS = {"q_a_norm", "kv_a_norm"}
# ... and of a layer: OLMo's norms after each sublayer, moved before it (the same weights: `norms_before`).
LAYER_FEATURES_OFF = {"norms": lambda spec: dataclasses.replace(spec, norms="pre")}
LAYER_FEATURES = {"SmolLM3-3B": {"use_rope"}, "OLMo-2-1124-7B": {"norms"}, "Olmo-3-1025-7B": {"norms"}}
EXPERT_FEATURES = {"Qwen3-30B-A3B": {"normalize", "top_k"}, "Mixtral-8x7B-v0.1": {"normalize", "top_k"},
                   "Qwen1.5-MoE-A2.7B": {"normalize", "top_k", "shared_gate"},
                   "OLMoE-1B-7B-0924": {"normalize", "top_k"},
                   "gpt-oss-20b": {"top_k", "swiglu_limit", "sinks"},
                   "DeepSeek-V3": {"normalize", "top_k", "routed_scale", "topk_group", *LATENT, *LATENT_NORMS},
                   # (one group: no topk_group)
                   "Kimi-K2-Instruct": {"normalize", "top_k", "routed_scale", *LATENT, *LATENT_NORMS},
                   "DeepSeek-V2-Lite": {"normalize", "top_k", *LATENT, "kv_a_norm"},  # (no query latent)
                   "gemma-4-E2B-it": {"v_norm", "kv_shared"},
                   "gemma-4-26B-A4B-it": {"normalize", "top_k", "router_norm", "expert_scale", "v_norm", "k_eq_v"}}
# A family whose config fields switch on the same features as a sibling's: those fields' guards run on
# the sibling's copy alone (each is one compile), its own features (the experts', its layers') here.
GUARDED_ON = {"gemma-4-26B-A4B-it": "gemma-4-E2B-it"}
# Gemma 2 2B's and Gemma 3 1B's query_pre_attn_scalar is their head_dim, where it changes nothing;
# 27B's (144, head_dim 128) is not: the tiny copies take one apart from head_dim, so its guard can tell.
# Gemma 2's final cap (30) is shrunk as the window is, to where this tiny model's logits reach it.
OVERRIDES = {"gemma-2-2b": dict(query_pre_attn_scalar=24, final_logit_softcapping=3.0),
             "gemma-3-1b-it": dict(query_pre_attn_scalar=24),
             # gpt-oss ships MXFP4 experts (the bfloat16 form is what loads); its SwiGLU clamp (7) shrunk
             # to where this tiny model's products reach it
             "gpt-oss-20b": dict(quantization_config=None, swiglu_limit=1.0),
             # DeepSeek-V3 and Kimi K2 ship FP8 blocks (a bfloat16 copy is what loads); transformers has no
             # `kimi_k2` class (Kimi's checkpoint brings DeepSeek-V3's code): the tiny copy is made as deepseek_v3
             "DeepSeek-V3": dict(quantization_config=None),
             "Kimi-K2-Instruct": dict(quantization_config=None, model_type="deepseek_v3"),
             # Gemma 4's final cap (30) shrunk as Gemma 2's is
             "gemma-4-E2B-it": dict(final_logit_softcapping=3.0),
             "gemma-4-26B-A4B-it": dict(final_logit_softcapping=3.0)}
# Phi-3's long-context form as its 128k checkpoint states it (an older `rope_scaling` of type
# "longrope" with a factor per RoPE pair, the trained context at config.json's top level), the
# trained context shrunk to 16 so that a test's calls cross it; the factors are made up here.
VARIANTS = {"Phi-3 longrope": ("Phi-3-mini-4k-instruct", dict(
    max_position_embeddings=64, original_max_position_embeddings=16, sliding_window=None,
    rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                  "long_factor": [1.0 + 2.5 * i for i in range(8)]}))}
PLAIN = dict(sliding_window=None, local_rope_theta=None, rope_scaling=None, qkv_bias=False, qk_norm=False,
             norm_plus_one=False, mlp_activation="silu", embed_scale=False, query_pre_attn_scalar=None,
             attn_logit_softcap=None, final_logit_softcap=None, post_norms=False, layer_scalar=False,
             per_layer_width=None)


@pytest.fixture(scope="module", params=CHECKPOINTS)
def family(request, tmp_path_factory):
    """(name, hf_model float32, config, params, path): a tiny shipped-config checkpoint saved by
    transformers as sharded bfloat16, transformers' float32 model of its weights, and jaxformer's load."""
    base, overrides = VARIANTS.get(request.param, (request.param, OVERRIDES.get(request.param, {})))
    hf_config = transformers.AutoConfig.for_model(**tiny(base, **overrides))
    hf_model = scaled_up(transformers.AutoModelForCausalLM.from_config(hf_config), seed=0).to(torch.bfloat16)
    path = tmp_path_factory.mktemp(request.param.replace(" ", "-"))
    hf_model.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()  # sharded, as real checkpoints ship
    config, params = load_hf(str(path), max_seq_len=MAX_SEQ_LEN)
    # Reopened in float32 (not `hf_model.float()`, whose RoPE frequencies stayed rounded to bfloat16).
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, reference, config, params, path


def _tokens(config, shape, seed):
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers_and_each_feature_counts(family):
    name, hf_model, config, params, _ = family
    tokens = _tokens(config, (2, 24), 2)  # longer than the window
    with torch.no_grad():
        want = hf_model(tokens).logits.numpy()
    got, _ = jit_apply(Decoder(config), {"params": params}, tokens.numpy())
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    switched_on = {f for f, plain in PLAIN.items() if getattr(config, f) != plain}
    assert switched_on == SWITCHED_ON[name]
    # Scanned, the same model computes the same logits (and each guard below runs scanned:
    # the same math in a program a fraction the size to compile), where its layers can be
    # scanned: not where they share keys and values (Gemma 4's E2B).
    scan = not shares_kv(layer_specs(config))
    if scan:
        scanned_config, scanned_params = with_scan_layers(config, params, True)
        scanned, _ = jit_apply(Decoder(scanned_config), {"params": scanned_params}, tokens.numpy())
        np.testing.assert_allclose(scanned, want, atol=TOLERANCE, rtol=0)
    guarded = SWITCHED_ON.get(GUARDED_ON.get(name), set())  # (the same code's guards, run on a sibling)
    for feature in sorted((switched_on - guarded) | EXPERT_FEATURES.get(name, set()) | LAYER_FEATURES.get(name, set())):
        moved = norms_before(params) if feature in LAYER_FEATURES_OFF else params
        off_config = config if feature in LATENT_NORMS else switched_off(config, feature)
        # (Layers that compute what they read otherwise need projections of their own: Gemma 4's.)
        off_params = drawn_for(off_config, moved) if feature in ("k_eq_v", "kv_shared") or not scan else moved
        off_config, off_params = with_scan_layers(off_config, off_params, scan)
        if feature in LATENT_NORMS:
            with without_modules((feature,)):
                off, _ = jit_apply_anew(Decoder(off_config), {"params": off_params}, tokens.numpy())
        else:
            off, _ = jit_apply(Decoder(off_config), {"params": off_params}, tokens.numpy())
        assert np.abs(off - want).max() > 100 * TOLERANCE, f"{name}: {feature} off leaves the logits as they were"


def drawn_for(config, params):
    """`params` with each parameter `config` declares and `params` lacks drawn at random (a guard's
    layers that compute what they read otherwise: Gemma 4's values' or shared layers' own projections)."""
    shapes = jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    flat = {path: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(shapes))))
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: flat[path] if path in flat else 0.25 * jax.random.normal(next(keys), leaf.shape), shapes)


def switched_off(config, feature: str):
    """`config` with `feature` switched off: a field of `FEATURES_OFF` (each filled layer's spec made
    again from the fields, its feed-forward and norm placement kept), a routing feature of its layers
    of experts, or a feature of its filled layers' attention or placement."""
    if feature in LAYER_FEATURES_OFF:
        return config.replace(layers=tuple(map(LAYER_FEATURES_OFF[feature], config.layers)))
    if feature in EXPERT_FEATURES_OFF:
        def experts_off(ffn):  # (Gemma 4's experts sit beside a dense MLP)
            if isinstance(ffn, DenseAndExpertsSpec):
                return dataclasses.replace(ffn, experts=EXPERT_FEATURES_OFF[feature](ffn.experts))
            return EXPERT_FEATURES_OFF[feature](ffn) if isinstance(ffn, ExpertsSpec) else ffn

        return config.replace(layers=tuple(dataclasses.replace(spec, ffn=experts_off(spec.ffn))
                                           for spec in config.layers))
    if feature in MIXER_FEATURES_OFF:  # (the config's pairing follows its layers': one for the model)
        layers = tuple(dataclasses.replace(spec, mixer=MIXER_FEATURES_OFF[feature](spec.mixer))
                       for spec in config.layers)
        return config.replace(layers=layers, rope_pairing=layers[0].mixer.rope_pairing)
    if isinstance(config.layers[0].mixer if config.layers else None, LatentAttentionSpec):  # (its RoPE is its spec's)
        return config.replace(**FEATURES_OFF[feature], layers=tuple(dataclasses.replace(spec, mixer=dataclasses.replace(
            spec.mixer, **FEATURES_OFF[feature])) for spec in config.layers))
    off = config.replace(layers=(), **FEATURES_OFF[feature])
    if not config.layers:
        return off
    kept = ("sinks", "o_bias", "qk_norm_over", "use_rope", "n_kv_head", "head_dim", "v_norm", "k_eq_v", "kv_shared")
    if feature == "sliding_window":  # (every layer full, a shared layer would read one of other heads: its own, then)
        kept = kept[:-1]
    return off.replace(layers=tuple(  # (the fields' attention, with what its filled spec adds: gpt-oss's sinks,
        # Gemma 4's heads of each layer, norm of the values, k = v and shared keys and values; its feed-forward,
        # and its norms' placement: OLMo's)
        dataclasses.replace(spec, ffn=with_activation(filled.ffn, off.mlp_activation),
                            norms=spec.norms if feature == "post_norms" else filled.norms,
                            mixer=dataclasses.replace(spec.mixer, **{field: getattr(filled.mixer, field)
                                                                     for field in kept}))
        for spec, filled in zip(layer_specs(off), config.layers)))


def norms_before(params: dict) -> dict:
    """`params` with each layer's norms after its sublayers ("post") named as the norms before them ("pre")."""
    before = {"attn_post_norm": "attn_norm", "mlp_post_norm": "mlp_norm"}
    return {key: {before.get(name, name): leaf for name, leaf in block.items()} if key.startswith("block_") else block
            for key, block in params.items()}


def with_activation(ffn, activation: str):
    """`ffn` with its dense MLP's gate `activation` (and its experts' beside it: Gemma 4's); a mixture of experts as
    it was (its activation is its own, `EXPERT_FEATURES_OFF`'s)."""
    if isinstance(ffn, DenseAndExpertsSpec):
        return dataclasses.replace(ffn, dense=dataclasses.replace(ffn.dense, activation=activation),
                                   experts=dataclasses.replace(ffn.experts, activation=activation))
    return dataclasses.replace(ffn, activation=activation) if isinstance(ffn, GatedMLPSpec) else ffn


@pytest.fixture(scope="module")
def hf_greedy(family):
    """transformers' greedy continuation of a prompt longer than the window, and the logits
    of each of its steps (its own cached decoding)."""
    _, hf_model, config, _, _ = family
    prompt = _tokens(config, (2, PROMPT_LEN), 1)
    new = NEW_TOKENS if not _longrope(config) else config.rope_scaling.original_max_position_embeddings - PROMPT_LEN + 1
    out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                            max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return prompt.numpy(), out.sequences.numpy(), torch.stack(out.logits, dim=1).numpy()


def _longrope(config) -> bool:
    return config.rope_scaling is not None and config.rope_scaling.kind == "longrope"


def test_greedy_tokens_equal_transformers(family, hf_greedy):
    """40 tokens (LongRoPE: as many as its trained context holds, then a clear refusal:
    past it transformers recomputes every cached position, which a cache cannot)."""
    _, _, config, params, _ = family
    prompt, want, logits = hf_greedy
    got = generate(Decoder(config), params, jnp.asarray(prompt), max_new_tokens=want.shape[1] - PROMPT_LEN)
    assert len(np.unique(want[:, PROMPT_LEN:])) > min(5, want.shape[1] - PROMPT_LEN)  # a varied continuation
    # Token for token wherever transformers' choice is no near-tie: every step's float32 logits are
    # within TOLERANCE of transformers' step's (the next test holds them there; `generate` runs the
    # same steps in one program, rounded alike), so the argmaxes can differ only where transformers'
    # top two are within 2 * TOLERANCE; a choice that close is not compared, nor the row's tokens after it.
    np.testing.assert_array_equal(got[:, :PROMPT_LEN], prompt)
    compared = greedy_tokens_compared(got[:, PROMPT_LEN:], want[:, PROMPT_LEN:], logits, bound=2 * TOLERANCE)
    assert compared >= want[:, PROMPT_LEN:].size // 2  # (weights far from ties: near-ties are rare)
    if _longrope(config):
        with pytest.raises(ValueError, match="past rope_scaling.original_max_position_embeddings=16"):
            generate(Decoder(config), params, jnp.asarray(prompt), max_new_tokens=NEW_TOKENS)
        longer = KVCache.zeros(2, 32, n_layer=config.n_layer, n_kv_head=config.n_kv_head, head_dim=config.head_dim,
                               max_seq_len=config.max_seq_len, dtype=jnp.float32)  # (not through create)
        with pytest.raises(ValueError, match="cache: capacity=32 is past"):
            Decoder(config).apply({"params": params}, jnp.asarray(prompt), longer)


def test_cached_decoding_equals_transformers_and_the_full_forward(family, hf_greedy):
    """Prefill the prompt, then one token a step through the cache (its rings past the
    window): each step's logits are transformers' own step's, and the full forward's."""
    _, _, config, params, _ = family
    _, sequences, hf_steps = hf_greedy
    model = Decoder(config)
    step = jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache))
    fed = sequences[:, :-1]  # (the last token is never fed back)
    logits, cache = step(jnp.asarray(fed[:, :PROMPT_LEN]), KVCache.create(config, 2, fed.shape[1]))
    got = [logits]
    for t in range(PROMPT_LEN, fed.shape[1]):
        logits, cache = step(jnp.asarray(fed[:, t:t + 1]), cache)
        got.append(logits)
    got = np.concatenate(got, axis=1)  # [batch, len - 1, vocab]
    np.testing.assert_allclose(got[:, PROMPT_LEN - 1:], hf_steps, atol=TOLERANCE, rtol=0)
    full, _ = jit_apply(model, {"params": params}, fed)
    np.testing.assert_allclose(got, full, atol=TOLERANCE, rtol=0)


def test_save_hf_writes_the_family_that_transformers_reopens(family, tmp_path):
    name, hf_model, config, params, path = family
    save_hf(config, params, str(tmp_path))
    reopened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reopened).__name__ == type(hf_model).__name__
    assert reopened.config.model_type == hf_model.config.model_type
    tokens = _tokens(config, (2, 20), 3)
    with torch.no_grad():
        want = hf_model(tokens).logits.numpy()
        again = reopened(tokens).logits.numpy()
    np.testing.assert_allclose(again, want, atol=TOLERANCE, rtol=0)
    loaded_config, loaded = load_hf(str(tmp_path), max_seq_len=MAX_SEQ_LEN)
    assert loaded_config == config
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
