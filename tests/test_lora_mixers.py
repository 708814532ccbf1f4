"""LoRA on the newer mixers against HF peft on torch: a tiny Qwen3.5 (Gated DeltaNet layers and gated
attention layers: a hybrid's `q_proj` adapts its attention layers alone, `in_proj_qkv` its linear
ones), a tiny Qwen3.5-MoE (Qwen3.6's image-text checkpoint: its text model's modules, and peft's names
of them, under `model.language_model`), a tiny Qwen3-Next (`in_proj_qkvz`, `in_proj_ba`: rows grouped
per key head, as peft's `lora_B` keeps them), a tiny DeepSeek-V3 and Kimi K2 (multi-head latent
attention's five modules; Kimi's checkpoint states `kimi_k2` and brings DeepSeek-V3's code) and a tiny
DeepSeek-V2-Lite (no query latent: `q_proj` beside the key-value latent's two): logits with random
adapters, one step's gradients, and the adapter files both ways.

The bases keep transformers' own initialisation (std 0.02): small weights, whose float32 logits lie
within the suite's tolerance of each other (`tests/families/test_hybrids.py` says why the hybrids'
float32 error grows with large ones).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GEMMA4, float64_config, import_peer, in_float64, jit_apply, torch_peer
from families.shipped import tiny

from jaxformer import Decoder, label_smoothed_cross_entropy
from jaxformer.config import LoraConfig
from jaxformer.convert import load_hf
from jaxformer.convert.hf import config_from_hf
from jaxformer.convert.peft import all_targets, check_targets, load_peft, peft_tensors, save_peft
from jaxformer.lora import init_lora, merge

TOLERANCE = 1e-5  # float32 logits of magnitude ~0.5 (the small bases: measured within 6e-7)
LATENT_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
IMAGE_TEXT = "image-text"  # a checkpoint of transformers' image-text class: adapters under model.language_model
# name -> (config.json as transformers builds the model, targets, how the checkpoint differs: None; IMAGE_TEXT;
# or the model_type its config.json states, whose code is the one transformers builds it with)
MODELS = {
    "qwen3_5": (tiny("Qwen3.5-9B")["text_config"], ("q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"), None),
    "qwen3_5_moe": (tiny("Qwen3.6-35B-A3B"), ("q_proj", "v_proj", "in_proj_qkv", "in_proj_b", "in_proj_a",
                                              "out_proj"), IMAGE_TEXT),
    "qwen3_next": (tiny("Qwen3-Next-80B-A3B-Instruct"), ("q_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"), None),
    "deepseek_v3": (tiny("DeepSeek-V3", quantization_config=None), LATENT_TARGETS, None),  # (bfloat16, not its FP8)
    "kimi_k2": (tiny("Kimi-K2-Instruct", quantization_config=None, model_type="deepseek_v3"), LATENT_TARGETS,
                "kimi_k2"),
    "deepseek_v2_lite": (tiny("DeepSeek-V2-Lite"), ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"), None),
}

def trained_looking(adapters, seed: int):
    """`adapters` with `b` drawn too (a new adapter's `b` is zero: nothing to compare), gently."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def adapted_logits(config, params, adapters, lora, tokens):
    """The unmerged path's logits, as jaxformer-finetune's loss computes them."""
    return np.asarray(jit_apply(Decoder(config.replace(lora=lora)), {"params": params, "lora": adapters},
                                jnp.asarray(tokens))[0])


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory):
    """(name, a function giving transformers' float32 model of the base, config, params, path of the
    saved base)."""
    torch = torch_peer()
    transformers = import_peer("transformers")
    hf, _, layout = MODELS[request.param]
    hf_config = transformers.AutoConfig.for_model(**hf)
    cls = (transformers.Qwen3_5MoeForConditionalGeneration if layout == IMAGE_TEXT
           else transformers.AutoModelForCausalLM)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    (cls(hf_config) if layout == IMAGE_TEXT else cls.from_config(hf_config)).save_pretrained(path / "base")
    stated = layout not in (None, IMAGE_TEXT)
    if stated:  # the model_type the checkpoint states (transformers has no class of it)
        written = json.loads((path / "base" / "config.json").read_text())
        (path / "base" / "config.json").write_text(json.dumps({**written, "model_type": layout}))
    config, params = load_hf(str(path / "base"), max_seq_len=32)
    assert not stated or config.hf_model_type == layout  # (so the adapters are read and written as its)

    def peer_base():  # (read with the config it was built from: the code the checkpoint brings)
        return cls.from_pretrained(str(path / "base"), config=hf_config, dtype=torch.float32)

    return request.param, peer_base, config, params, path


@pytest.mark.peers
def test_one_lora_step_equals_peft_and_the_adapter_files_go_both_ways(saved):
    torch = torch_peer()
    peft = import_peer("peft")
    name, peer_base, config, base, path = saved
    image_text = MODELS[name][2] == IMAGE_TEXT
    lora = LoraConfig(rank=4, alpha=8.0, targets=MODELS[name][1])
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    adapters = trained_looking(init_lora(base, lora, jax.random.key(0)), seed=2)
    save_peft(config, adapters, lora, str(path / "ours"), image_text=image_text)

    peer = peft.PeftModel.from_pretrained(peer_base(), str(path / "ours"), is_trainable=True)
    labels = torch.tensor(tokens)
    labels[0, :5] = -100  # a masked prompt: its positions carry no loss
    out = peer(input_ids=torch.tensor(tokens), labels=labels)
    ours = adapted_logits(config, base, adapters, lora, tokens)
    plain = jit_apply(Decoder(config), {"params": base}, jnp.asarray(tokens))[0]
    assert np.abs(ours - np.asarray(plain)).max() > 100 * TOLERANCE  # the adapters count
    np.testing.assert_allclose(out.logits.detach().numpy(), ours, rtol=TOLERANCE, atol=TOLERANCE)

    # One step's loss and the adapters' gradients, unmerged, as jaxformer-finetune's step takes them.
    targets = jnp.asarray(np.where(labels.numpy() == -100, -100, tokens)[:, 1:])

    def loss(adapters):
        logits = Decoder(config.replace(lora=lora)).apply({"params": base, "lora": adapters},
                                                           jnp.asarray(tokens[:, :-1]))[0]
        return label_smoothed_cross_entropy(logits, targets, 0.0, ignore_id=-100)

    value, grads = jax.jit(jax.value_and_grad(loss))(adapters)
    out.loss.backward()
    np.testing.assert_allclose(float(value), out.loss.item(), rtol=1e-5)
    named = {n.replace(".default.", "."): p for n, p in peer.named_parameters()}
    ours = peft_tensors(config, grads, lora, image_text=image_text)
    assert set(ours) == {n for n, p in named.items() if p.requires_grad}
    scale = max(float(np.abs(g).max()) for g in ours.values())
    for key, got in ours.items():
        np.testing.assert_allclose(got, named[key].grad.numpy(), rtol=0, atol=1e-5 * scale, err_msg=key)

    # peft's own adapters (drawn by peft, saved by peft) into jaxformer, unmerged and merged.
    theirs = save_peft_drawn(peft, peer_base(), lora, path / "theirs")
    loaded, lora = load_peft(config, str(path / "theirs"))
    assert (lora.rank, lora.alpha, sorted(lora.targets)) == (3, 5, sorted(MODELS[name][1]))
    theirs.eval()
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(adapted_logits(config, base, loaded, lora, tokens), want, rtol=TOLERANCE,
                               atol=TOLERANCE)
    merged = jit_apply(Decoder(config), {"params": merge(base, loaded, lora)}, jnp.asarray(tokens))[0]
    np.testing.assert_allclose(np.asarray(merged), want, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_target_adapts_the_layers_whose_module_it_names(tmp_path):
    """A hybrid's `q_proj` is its attention layers' `self_attn.q_proj`, not the Gated DeltaNet's q
    (part of `in_proj_qkv`); a target no layer has is refused, naming those it has; Qwen3-Next's
    `in_proj_qkvz` adapter's `b` goes to peft's `lora_B` in the checkpoint's rows, each key head's q,
    k, then its value heads' v and z, and comes back. (From the configs alone: no model is run.)"""
    config = config_from_hf(MODELS["qwen3_5"][0], max_seq_len=32)
    base = jax.eval_shape(lambda: Decoder(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    lora = LoraConfig(targets=("q_proj", "in_proj_qkv", "out_proj"))
    adapters = jax.eval_shape(lambda: init_lora(base, lora, jax.random.key(0)))  # (shapes: nothing compiled)
    assert {block: sorted(adapters[block]["attn"]) for block in adapters} == {
        "block_0": ["linear_o", "linear_qkv"], "block_1": ["linear_o", "linear_qkv"],
        "block_2": ["linear_o", "linear_qkv"], "block_3": ["wq"]}
    assert all_targets(config) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                   "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    with pytest.raises(ValueError, match="in_proj_qkvz is not a module of a qwen3_5_text checkpoint \\(layer 0's "
                                         "attn/wq is in model.layers.0.linear_attn.in_proj_qkv.weight\\); its "
                                         "targets: q_proj, k_proj"):
        check_targets(config, lora.replace(targets=("in_proj_qkvz",)))
    with pytest.raises(ValueError, match="q_a_proj is not a module of a qwen3_5_text checkpoint \\(no layer's attn "
                                         "has wq_a\\)"):
        check_targets(config, lora.replace(targets=("q_a_proj",)))

    hf = MODELS["qwen3_next"][0]
    config = config_from_hf(hf, max_seq_len=32)
    Hk, Dk, Dv = hf["linear_num_key_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"]
    r = hf["linear_num_value_heads"] // Hk
    lora = LoraConfig(rank=2, targets=("in_proj_qkvz", "in_proj_ba"))
    with pytest.raises(ValueError, match="in_proj_qkv is not a module of a qwen3_next checkpoint \\(layer 0's "
                                         "attn/wq is in model.layers.0.linear_attn.in_proj_qkvz.weight\\)"):
        check_targets(config, lora.replace(targets=("in_proj_qkv",)))
    adapters = {f"block_{i}": {"attn": {
        "linear_qkvz": {"a": np.zeros((2, 64)), "b": np.tile(np.arange(2 * Hk * Dk + 2 * r * Hk * Dv), (2, 1))},
        "linear_ba": {"a": np.zeros((2, 64)), "b": np.tile(np.arange(2 * r * Hk), (2, 1))}}} for i in range(3)}
    q, k = np.arange(Hk * Dk).reshape(Hk, Dk), Hk * Dk + np.arange(Hk * Dk).reshape(Hk, Dk)  # our columns
    v = 2 * Hk * Dk + np.arange(r * Hk * Dv).reshape(Hk, r * Dv)  # value head h's channels: key head h // r's
    z = v + r * Hk * Dv
    b_, a_ = np.arange(r * Hk).reshape(Hk, r), r * Hk + np.arange(r * Hk).reshape(Hk, r)
    tensors = peft_tensors(config, adapters, lora)
    stem = "base_model.model.model.layers.0.linear_attn."
    np.testing.assert_array_equal(tensors[stem + "in_proj_qkvz.lora_B.weight"][:, 0],
                                  np.concatenate([q, k, v, z], axis=1).reshape(-1))
    np.testing.assert_array_equal(tensors[stem + "in_proj_ba.lora_B.weight"][:, 0],
                                  np.concatenate([b_, a_], axis=1).reshape(-1))
    save_peft(config, adapters, lora, str(tmp_path))
    loaded, _ = load_peft(config, str(tmp_path))
    np.testing.assert_array_equal(loaded["block_0"]["attn"]["linear_qkvz"]["b"], adapters["block_0"]["attn"]
                                  ["linear_qkvz"]["b"])


# Gemma 4's targets: the E2B's seven (its layers that read earlier ones' keys and values have no k_proj or
# v_proj to adapt), the 26B-A4B's seven too (its global layers have no v_proj: their keys' projection is the
# values'; gate_proj, up_proj and down_proj are its MLP's, beside the experts) and its experts' two parameters,
# peft's target_parameters by the tail of transformers' name, model.layers.i.experts.* (not mlp.experts.*).
GEMMA4_TARGETS = {"gemma-4-E2B-it": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                  "gemma-4-26B-A4B-it": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                         "experts.gate_up_proj", "experts.down_proj")}


@pytest.mark.peers
@pytest.mark.parametrize("name", sorted(GEMMA4))
def test_lora_on_gemma_4_equals_peft_in_float64(name, tmp_path):
    """LoRA on Gemma 4's tiny E2B and 26B-A4B (conftest.GEMMA4, transformers' initialisation) against peft:
    the logits with random adapters saved by `save_peft`, one step's loss and gradients, and peft's own
    adapters loaded by `load_peft`, unmerged and merged. The 26B-A4B's adapters: its MLP's three modules
    beside the experts (peft's `mlp.gate_proj`, ...; ours `mlp/dense`) and each expert's own on the experts'
    two parameters (peft's `ParamWrapper`s of `experts.gate_up_proj`, `experts.down_proj`; ours `mlp/experts`).
    In float64 on both sides: at this initialisation Gemma 4's unscaled scores (q and k normed, scale 1)
    make a few logits and the first layer's gradients as far from their float64 values in float32 as the
    tolerance, in transformers' float32 as in ours (measured: 1.2e-5 of logits of 0.55). (transformers' Gemma 4
    norms compute in float32 whatever the dtype: its float64 logits lie 2e-6 from ours.)"""
    torch = torch_peer()
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**tiny(name, **GEMMA4[name]))
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "base")
    config, base = load_hf(str(tmp_path / "base"), max_seq_len=32)
    wide = float64_config(config)

    def peer(adapters: str, **options):  # (the experts' eager loop: torch's grouped product takes no float64)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float64,
                                                                  experts_implementation="eager")
        return peft.PeftModel.from_pretrained(model, str(tmp_path / adapters), **options).to(torch.float64)

    def logits(config, params, adapters, lora, tokens):
        return in_float64(lambda params, adapters: Decoder(float64_config(config).replace(lora=lora)).apply(
            {"params": params, "lora": adapters}, jnp.asarray(tokens))[0], params, adapters)

    lora = LoraConfig(rank=4, alpha=8.0, targets=GEMMA4_TARGETS[name])
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    adapters = trained_looking(init_lora(base, lora, jax.random.key(0)), seed=2)
    save_peft(config, adapters, lora, str(tmp_path / "ours"))
    labels = torch.tensor(tokens)
    labels[0, :5] = -100  # a masked prompt: its positions carry no loss
    ours = peer("ours", is_trainable=True)
    out = ours(input_ids=torch.tensor(tokens), labels=labels)
    got = logits(config, base, adapters, lora, tokens)
    plain = in_float64(lambda params: Decoder(wide).apply({"params": params}, jnp.asarray(tokens))[0], base)
    assert np.abs(got - plain).max() > 100 * TOLERANCE  # the adapters count
    np.testing.assert_allclose(out.logits.detach().numpy(), got, rtol=TOLERANCE, atol=TOLERANCE)

    targets = jnp.asarray(np.where(labels.numpy() == -100, -100, tokens)[:, 1:])

    def loss(params, adapters):
        logits = Decoder(wide.replace(lora=lora)).apply({"params": params, "lora": adapters},
                                                        jnp.asarray(tokens[:, :-1]))[0]
        return label_smoothed_cross_entropy(logits, targets, 0.0, ignore_id=-100)

    value, grads = in_float64(lambda params, adapters: jax.value_and_grad(loss, argnums=1)(params, adapters), base,
                              adapters)
    out.loss.backward()
    np.testing.assert_allclose(float(value), out.loss.item(), rtol=1e-5)
    named = {n.replace(".default.", "."): p for n, p in ours.named_parameters()}
    mine = peft_tensors(config, grads, lora)
    assert set(mine) == {n for n, p in named.items() if p.requires_grad}
    scale = max(float(np.abs(g).max()) for g in mine.values())
    for key, grad in mine.items():
        np.testing.assert_allclose(grad, named[key].grad.numpy(), rtol=0, atol=1e-5 * scale, err_msg=key)

    # peft's own adapters (drawn by peft, saved by peft) into jaxformer, unmerged and merged. B gently, as
    # trained_looking's changes (peft's A, std 1/r, is 3x theirs): with B at 0.1 the 26B-A4B has a position whose
    # float32 logits lie 1e-5 from its float64 ones in ours (1.8e-5 in transformers', whose norms, rope and
    # router softmax stay float32), and there ours and peft's differ by 1.5e-5, 3e-7 or less elsewhere (measured).
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    save_peft_drawn(peft, fresh, lora, tmp_path / "theirs", b_std=0.03)
    loaded, lora = load_peft(config, str(tmp_path / "theirs"))
    assert (lora.rank, lora.alpha, sorted(lora.targets)) == (3, 5, sorted(GEMMA4_TARGETS[name]))
    with torch.no_grad():
        want = peer("theirs").eval()(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(logits(config, base, loaded, lora, tokens), want, rtol=TOLERANCE, atol=TOLERANCE)
    merged = in_float64(lambda params: Decoder(wide).apply({"params": params}, jnp.asarray(tokens))[0],
                        merge(base, loaded, lora))
    np.testing.assert_allclose(merged, want, rtol=TOLERANCE, atol=TOLERANCE)


def test_gemma_4s_targets_are_its_modules_and_its_experts_parameters_by_transformers_names():
    """The 26B-A4B takes its MLP's targets (beside the experts) and its experts' parameters by the names peft
    matches in transformers' Gemma 4, `model.layers.i.experts.gate_up_proj` (no `mlp.` before `experts`): the
    `mlp.experts.*` of the other families of experts is refused in one line naming the parameter and the
    targets it takes; the E2B, without experts, takes no parameter; both spellings of one parameter are one
    target. (From the configs alone: no model is run.)"""
    config = config_from_hf(tiny("gemma-4-26B-A4B-it", **GEMMA4["gemma-4-26B-A4B-it"]), max_seq_len=32)
    assert all_targets(config, parameters=True) == GEMMA4_TARGETS["gemma-4-26B-A4B-it"]
    with pytest.raises(ValueError, match="^mlp.experts.gate_up_proj is not a parameter of a gemma4_text checkpoint "
                                         "\\(layer 0's experts hold model.layers.0.experts.gate_up_proj\\); its "
                                         "targets: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
                                         "experts.gate_up_proj, experts.down_proj$"):
        check_targets(config, LoraConfig(targets=("q_proj", "mlp.experts.gate_up_proj")))
    e2b = config_from_hf(tiny("gemma-4-E2B-it", **GEMMA4["gemma-4-E2B-it"]), max_seq_len=32)
    assert all_targets(e2b, parameters=True) == GEMMA4_TARGETS["gemma-4-E2B-it"]
    with pytest.raises(ValueError, match="^experts.down_proj is not a parameter of a gemma4_text checkpoint \\(it "
                                         "has no layer of experts\\); its targets: q_proj"):
        check_targets(e2b, LoraConfig(targets=("experts.down_proj",)))
    with pytest.raises(ValueError, match="targets must be names of distinct parameters \\(experts.gate_up_proj is a "
                                         "tail of mlp.experts.gate_up_proj: one parameter\\)"):
        LoraConfig(targets=("experts.down_proj", "mlp.experts.down_proj"))


@pytest.mark.peers
def test_an_image_text_checkpoints_adapters_go_both_ways(tmp_path):
    """Qwen3.5 ships as an image-text model, whose text model's modules peft names under
    `model.language_model`: adapters saved for it (`image_text`) load in peft on transformers'
    image-text class and compute what ours do; peft's load in ours."""
    torch = torch_peer()
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**tiny("Qwen3.5-9B"))
    transformers.Qwen3_5ForConditionalGeneration(hf_config).save_pretrained(tmp_path / "base")
    config, base = load_hf(str(tmp_path / "base"), max_seq_len=32)
    lora = LoraConfig(rank=4, alpha=8.0, targets=MODELS["qwen3_5"][1])
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    adapters = trained_looking(init_lora(base, lora, jax.random.key(0)), seed=2)
    save_peft(config, adapters, lora, str(tmp_path / "ours"), image_text=True)

    def model():
        return transformers.Qwen3_5ForConditionalGeneration.from_pretrained(str(tmp_path / "base"),
                                                                            dtype=torch.float32)

    peer = peft.PeftModel.from_pretrained(model(), str(tmp_path / "ours")).eval()
    with torch.no_grad():
        want = peer(input_ids=torch.tensor(tokens)).logits.numpy()
    ours = adapted_logits(config, base, adapters, lora, tokens)
    plain = jit_apply(Decoder(config), {"params": base}, jnp.asarray(tokens))[0]
    assert np.abs(ours - np.asarray(plain)).max() > 100 * TOLERANCE  # peft read them: they count
    np.testing.assert_allclose(ours, want, rtol=TOLERANCE, atol=TOLERANCE)
    loaded, again = load_peft(config, str(tmp_path / "ours"))
    assert sorted(again.targets) == sorted(lora.targets)
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(adapters)):
        np.testing.assert_array_equal(x, y)

    theirs = peft.get_peft_model(model(), peft.LoraConfig(r=3, lora_alpha=5, target_modules=list(lora.targets),
                                                          init_lora_weights="gaussian"))
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    theirs.save_pretrained(str(tmp_path / "theirs"))
    loaded, lora = load_peft(config, str(tmp_path / "theirs"))
    theirs.eval()
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(adapted_logits(config, base, loaded, lora, tokens), want, rtol=TOLERANCE,
                               atol=TOLERANCE)


def save_peft_drawn(peft, base, lora, path, b_std: float = 0.1):
    """peft's own adapters of rank 3, alpha 5 on `base`'s targets of `lora` (its modules, and the experts'
    parameters), drawn by peft (B too, normal with std `b_std`: peft starts it at zero even for "gaussian") and
    saved by peft in `path`: the peft model."""
    import torch

    theirs = peft.get_peft_model(base, peft.LoraConfig(r=3, lora_alpha=5, target_modules=list(lora.module_targets),
                                                       target_parameters=list(lora.parameter_targets) or None,
                                                       init_lora_weights="gaussian"))
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.normal_(0, b_std)
    theirs.save_pretrained(str(path))
    return theirs
