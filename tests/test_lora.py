"""LoRA: the merge against the formula through an independent forward; the unmerged path the
training runs (`DecoderConfig.lora`) against the merge, its dropout against torch's rule, and
against HF peft on torch on a tiny Llama and a tiny Gemma (logits, one step's loss and adapter
gradients with masked targets, both ways of the adapter files)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    REORDERED,
    float64_config,
    import_peer,
    in_float64,
    jit_apply,
    numpy_decoder_logits,
    random_params,
    torch_peer,
)
from families.shipped import scaled_up, tiny

from jaxformer import Decoder, DecoderConfig, generate, label_smoothed_cross_entropy
from jaxformer.config import LORA_TARGETS
from jaxformer.convert import load_hf
from jaxformer.convert.peft import all_targets, check_targets, load_peft, save_peft
from jaxformer.experts import ExpertsSpec, route, routed
from jaxformer.grouped import KERNEL_PRODUCTS, PRODUCTS
from jaxformer.layers import layer_specs
from jaxformer.lora import Adapted, LoraConfig, init_lora, merge, project
from jaxformer.quantized import QArray, Quantization, dequantize, quantize_params
from jaxformer.sharding import param_axes
from jaxformer.training import TrainState, make_train_step

CONFIG = DecoderConfig(vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=32)
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"))
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 12))


def trained_looking(adapters, seed: int = 1):
    """`adapters` with `b` drawn too (a new adapter's `b` is zero: nothing to compare)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


@pytest.fixture(scope="module")
def base():
    return random_params(CONFIG, seed=0)


def logits(params, tokens=TOKENS):
    return np.asarray(jit_apply(Decoder(CONFIG), {"params": params}, jnp.asarray(tokens))[0])


def test_a_new_adapter_changes_nothing(base):
    adapters = init_lora(base, LORA, jax.random.key(0))
    a = adapters["block_0"]["attn"]["wq"]["a"]
    assert a.shape == (4, 32) and float(jnp.abs(a).max()) <= 1 / np.sqrt(32)
    merged = merge(base, adapters, LORA)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(base)):
        np.testing.assert_array_equal(x, y)


def test_the_merge_is_w_plus_scaled_a_b_in_an_independent_forward(base):
    adapters = trained_looking(init_lora(base, LORA, jax.random.key(0)))
    want = jax.tree.map(lambda x: np.asarray(x, np.float64), base)
    for block in ("block_0", "block_1"):
        for part, name, _ in (("attn", "wq", 1), ("attn", "wk", 1), ("attn", "wv", 1), ("attn", "wo", 2),
                                 ("mlp", "w_gate", 1), ("mlp", "w_up", 1), ("mlp", "w_down", 1)):
            w = want[block][part][name]
            ab = adapters[block][part][name]
            delta = np.asarray(ab["a"], np.float64).T @ np.asarray(ab["b"], np.float64) * (8.0 / 4)
            want[block][part][name] = w + delta.reshape(w.shape)
    np.testing.assert_allclose(logits(merge(base, adapters, LORA)), numpy_decoder_logits(want, TOKENS, CONFIG),
                               rtol=1e-4, atol=1e-4)


def test_training_moves_only_the_adapters(base):
    adapters = init_lora(base, LORA, jax.random.key(0))
    optimizer = optax.adam(1e-2)
    state = optimizer.init(adapters)
    frozen = jax.tree.map(np.array, base)

    # (Jitted: one program for the steps, where run eagerly each operation compiles on its own.)
    @jax.jit
    def loss_and_grads(adapters):
        def loss(adapters):
            out = Decoder(CONFIG).apply({"params": merge(base, adapters, LORA)}, jnp.asarray(TOKENS[:, :-1]))[0]
            return label_smoothed_cross_entropy(out, jnp.asarray(TOKENS[:, 1:]), 0.0)
        return jax.value_and_grad(loss)(adapters)

    before, grads = loss_and_grads(adapters)
    for _ in range(5):
        updates, state = optimizer.update(grads, state)
        adapters = optax.apply_updates(adapters, updates)
        after, grads = loss_and_grads(adapters)
    assert float(after) < float(before)
    # The optimizer holds the adapters' moments only: Adam's two per adapter value, and its count.
    assert jax.tree.structure(state[0].mu) == jax.tree.structure(adapters)
    assert sum(x.size for x in jax.tree.leaves(state)) == 2 * sum(x.size for x in jax.tree.leaves(adapters)) + 1
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(frozen)):
        np.testing.assert_array_equal(x, y)  # the base, bit for bit


def test_lora_config_is_checked():
    with pytest.raises(ValueError, match="targets must be distinct names among q_proj"):
        LoraConfig(targets=("qkv",))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        LoraConfig(rank=0)


def adapted_logits(config, params, adapters, lora, tokens=TOKENS):
    """The logits of the unmerged path, as jaxformer-finetune's loss computes them (jitted: run
    eagerly, each operation would compile on its own)."""
    return jit_apply(Decoder(config.replace(lora=lora)), {"params": params, "lora": adapters}, jnp.asarray(tokens))[0]


def test_the_unmerged_path_computes_what_the_merge_does(base):
    """In float64, where the two ways of summing (x W + x A B against x (W + A B)) differ by rounding
    alone: float32's, carried through this random model's layers, reaches 2e-4 of a logit in one
    order of the products' sums and 4e-5 in another, the difference the test would measure."""
    adapters = trained_looking(init_lora(base, LORA, jax.random.key(0)))
    wide, tokens = float64_config(CONFIG), jnp.asarray(TOKENS)
    unmerged = in_float64(lambda p, a: Decoder(wide.replace(lora=LORA)).apply({"params": p, "lora": a}, tokens)[0],
                          base, adapters)
    merged = in_float64(lambda p, a: Decoder(wide).apply({"params": merge(p, a, LORA)}, tokens)[0], base, adapters)
    np.testing.assert_allclose(unmerged, merged, rtol=1e-10, atol=1e-10)
    # A model with config.lora but no adapters given refuses, naming the collection.
    with pytest.raises(ValueError, match="config.lora adapts wq, but apply\\(\\) was given no 'lora' variables"):
        Decoder(CONFIG.replace(lora=LORA)).apply({"params": base}, jnp.asarray(TOKENS))



def test_decoding_with_the_adapters_unmerged_gives_the_merged_models_tokens(base):
    """`Adapted`: greedy and sampled decoding with the adapters beside the base equal the
    merged model's, and differ from the base's (the adapters are really read)."""
    adapters = trained_looking(init_lora(base, LORA, jax.random.key(0)))
    adapted = Adapted(Decoder(CONFIG.replace(lora=LORA)))
    prompt = np.asarray(TOKENS[:, :4], np.int32)
    for options in ({}, {"temperature": 0.8, "top_k": 20, "key": jax.random.key(3)}):
        got = generate(adapted, {"base": base, "lora": adapters}, prompt, max_new_tokens=8, **options)
        want = generate(Decoder(CONFIG), merge(base, adapters, LORA), prompt, max_new_tokens=8, **options)
        np.testing.assert_array_equal(got, want)
        assert not np.array_equal(got, generate(Decoder(CONFIG), base, prompt, max_new_tokens=8, **options))


def test_remat_recomputes_the_same_gradients(base):
    adapters = trained_looking(init_lora(base, LORA, jax.random.key(0)))

    # (Eager, as a step of the unmerged path: compiled, the recomputation may round apart in the last bits.)
    def loss(adapters, remat):
        model = Decoder(CONFIG.replace(lora=LORA, remat=remat))
        out = model.apply({"params": base, "lora": adapters}, jnp.asarray(TOKENS[:, :-1]))[0]
        return label_smoothed_cross_entropy(out, jnp.asarray(TOKENS[:, 1:]), 0.0)

    kept, recomputed = (jax.value_and_grad(loss)(adapters, remat) for remat in (False, True))
    assert float(kept[0]) == float(recomputed[0])
    for x, y in zip(jax.tree.leaves(kept[1]), jax.tree.leaves(recomputed[1])):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


class OneProjection(nn.Module):
    """`project` alone: `x W` and its adapter's term, for the dropout test."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x, w):
        return project(self, x, ("wq", "btd,dhk->bthk", w))[0]


def test_dropout_drops_the_adapter_input_as_torch_does():
    # a = I and b = I at scale 1: the adapter's term is dropout(x) itself, so each entry is
    # 0 or x / (1 - p) (torch's inverted dropout), kept with probability 1 - p, and the base
    # product x W is untouched.
    d, p = 16, 0.25
    lora = LoraConfig(rank=d, alpha=d, targets=("q_proj",), dropout=p)
    module = OneProjection(DecoderConfig(n_head=1, n_kv_head=1, d_model=d, lora=lora))
    x = jax.random.normal(jax.random.key(0), (4, 64, d)) + 3.0  # [batch, T, d], no zeros
    w = jax.random.normal(jax.random.key(1), (d, 1, d))
    adapters = {"wq": {"a": jnp.eye(d), "b": jnp.eye(d)}}
    plain = np.einsum("btd,dhk->bthk", x, w)
    without = module.apply({"lora": adapters}, x, w)  # no dropout rng: no dropout (evaluation)
    np.testing.assert_allclose(without - plain, np.asarray(x)[:, :, None], rtol=1e-5, atol=1e-5)
    dropped = np.asarray(module.apply({"lora": adapters}, x, w, rngs={"dropout": jax.random.key(2)}) - plain)[:, :, 0]
    kept = np.isclose(dropped, np.asarray(x) / (1 - p), rtol=1e-5, atol=1e-5)
    assert np.all(kept | (np.abs(dropped) < 1e-5))  # each entry: x / (1 - p), or 0
    assert abs(kept.mean() - (1 - p)) < 0.03  # 4096 draws: 5 standard deviations
    again = module.apply({"lora": adapters}, x, w, rngs={"dropout": jax.random.key(3)})
    assert not np.allclose(np.asarray(again - plain)[:, :, 0], dropped)  # a new key, a new mask


# The families the peft comparison runs on, each a random transformers model saved and loaded,
# with every target its format has: a tiny Llama; a tiny Gemma (GeGLU, norms that scale by
# 1 + w, scaled embeddings); a tiny OLMo 2 (q and k normalised over the whole projection after
# their adapters, the norms after each sublayer); a tiny Phi-3, whose fused qkv_proj and
# gate_up_proj take one adapter each over the matrices jaxformer keeps apart.
PEFT_MODELS = {"llama": ("Llama-3.2-1B", LORA), "gemma": ("gemma-2b", LORA), "olmo2": ("OLMo-2-1124-7B", LORA),
               "phi3": ("Phi-3-mini-4k-instruct", LORA.replace(targets=("qkv_proj", "o_proj", "gate_up_proj",
                                                                         "down_proj")))}
TARGET_OF = {adapter: target for target, adapter in LORA_TARGETS.items()}


@pytest.mark.peers
@pytest.mark.parametrize("family", sorted(PEFT_MODELS))
def test_one_lora_step_equals_peft_and_the_adapter_files_go_both_ways(family, tmp_path):
    torch = torch_peer()
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    name, lora = PEFT_MODELS[family]
    hf_config = transformers.AutoConfig.for_model(**tiny(name))
    scaled_up(transformers.AutoModelForCausalLM.from_config(hf_config), seed=0).save_pretrained(tmp_path / "base")
    config, base = load_hf(str(tmp_path / "base"), max_seq_len=32)
    frozen = jax.tree.map(np.array, base)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    adapters = trained_looking(init_lora(base, lora, jax.random.key(0)), seed=2)
    adapters = jax.tree.map(lambda x: x / 4, adapters)  # (gentler: the scaled-up base is sharp already)
    save_peft(config, adapters, lora, str(tmp_path / "ours"))

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    peer = peft.PeftModel.from_pretrained(model, str(tmp_path / "ours"), is_trainable=True)
    labels = torch.tensor(tokens)
    labels[0, :5] = -100  # a masked prompt: its positions carry no loss
    out = peer(input_ids=torch.tensor(tokens), labels=labels)  # (shifted inside: position t predicts t + 1)
    np.testing.assert_allclose(out.logits.detach().numpy(), adapted_logits(config, base, adapters, lora, tokens),
                               rtol=1e-4, atol=1e-4)

    # One step's loss and the adapters' gradients, through jaxformer-finetune's path (unmerged, no dropout key).
    targets = np.where(labels.numpy() == -100, -100, tokens)[:, 1:]

    def loss(adapters, batch, dropout_key):
        out = adapted_logits(config, base, adapters, lora, batch["tokens"])
        return label_smoothed_cross_entropy(out, batch["targets"], 0.0, ignore_id=-100), {}

    batch = {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(targets)}
    value, grads = jax.jit(jax.value_and_grad(lambda a: loss(a, batch, None)[0]))(adapters)  # (one compile)
    out.loss.backward()
    np.testing.assert_allclose(float(value), out.loss.item(), rtol=1e-5)
    named = dict(peer.named_parameters())
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
    # The gradients' bound, from the suite's error model (`REORDERED`): float32 through two sharp
    # layers, each side's rounding within REORDERED times ours against its float64 twin (measured
    # here, on the backend that runs it: a GPU's other kernels and summation orders are in it).
    wide = float64_config(config)
    grads64 = in_float64(lambda a, b: jax.grad(lambda a: label_smoothed_cross_entropy(
        Decoder(wide.replace(lora=lora)).apply({"params": b, "lora": a}, batch["tokens"])[0], batch["targets"], 0.0,
        ignore_id=-100))(a), adapters, base)
    compared = 0
    for i in range(config.n_layer):
        for part, module in (("attn", "self_attn"), ("mlp", "mlp")):
            for adapter, pair in grads[f"block_{i}"][part].items():
                stem = f"base_model.model.model.layers.{i}.{module}.{TARGET_OF[adapter]}"
                for letter in ("a", "b"):
                    got = named[f"{stem}.lora_{letter.upper()}.default.weight"].grad.numpy()
                    got = got if letter == "a" else got.T  # peft's A is [r, n_in] as ours; its B [n_out, r]
                    want64 = grads64[f"block_{i}"][part][adapter][letter]
                    bound = 2 * REORDERED * float(np.abs(np.asarray(pair[letter], np.float64) - want64).max())
                    assert bound <= 1e-2 * scale, bound  # float32's rounding, not another result
                    np.testing.assert_allclose(np.asarray(pair[letter]), got, rtol=0, atol=bound)
                    compared += 1
    assert compared == 2 * config.n_layer * len(lora.targets)

    # The step itself moves the adapters and leaves the base as it was, bit for bit.
    optimizer = optax.adam(1e-2)
    step = make_train_step(loss, optimizer)
    state, _ = step(TrainState.create(adapters, optimizer), batch, jax.random.key(0))
    assert not np.allclose(state.params["block_0"]["attn"]["wo"]["b"], adapters["block_0"]["attn"]["wo"]["b"])
    for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(frozen)):
        np.testing.assert_array_equal(x, y)

    # peft's own adapters (drawn by peft, saved by peft) into jaxformer.
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    their_targets = sorted(lora.targets)[:2]
    theirs = peft.get_peft_model(fresh, peft.LoraConfig(r=3, lora_alpha=5, target_modules=their_targets,
                                                        lora_dropout=0.1, init_lora_weights="gaussian"))
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # (peft starts B at zero even for "gaussian")
    theirs.save_pretrained(str(tmp_path / "theirs"))
    loaded, lora = load_peft(config, str(tmp_path / "theirs"))
    assert (lora.rank, lora.alpha, sorted(lora.targets), lora.dropout) == (3, 5, their_targets, 0.1)
    theirs.eval()  # (dropout off, as ours without a dropout key)
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(adapted_logits(config, base, loaded, lora, tokens), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jit_apply(Decoder(config), {"params": merge(base, loaded, lora)},
                                                    jnp.asarray(tokens))[0]), want, rtol=1e-4, atol=1e-4)




def test_each_family_takes_the_targets_its_format_has():
    assert all_targets(CONFIG) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    phi3 = CONFIG.replace(hf_model_type="phi3")
    assert all_targets(phi3) == ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")
    with pytest.raises(ValueError, match="q_proj is not a module of a phi3 checkpoint \\(layer 0's attn/wq is in "
                                         "model.layers.0.self_attn.qkv_proj.weight\\); its targets: o_proj"):
        check_targets(phi3, LoraConfig(targets=("q_proj",)))
    with pytest.raises(ValueError, match="qkv_proj is not a module of a llama checkpoint"):
        check_targets(CONFIG, LoraConfig(targets=("qkv_proj",)))
    with pytest.raises(ValueError, match="kv_b_proj is not a module of a llama checkpoint \\(no layer's attn has "
                                         "wkv_b\\)"):
        check_targets(CONFIG, LoraConfig(targets=("kv_b_proj",)))
    with pytest.raises(ValueError, match="names of distinct matrices"):
        LoraConfig(targets=("qkv_proj", "k_proj"))


# LoRA on a layer of experts: a Qwen3-MoE-shaped model, 4 experts of 16, 2 a token; its second layer
# dense (as Qwen2-MoE's `mlp_only_layers`): the experts' adapters are in each layer of experts alone.
MOE_SPEC = ExpertsSpec(4, 2, 16)
MOE = CONFIG.replace(qk_norm=True, layers=tuple(dataclasses.replace(spec, ffn=MOE_SPEC) if i == 0 else spec
                                                for i, spec in enumerate(layer_specs(CONFIG.replace(qk_norm=True)))))
MOE_LORA = LoraConfig(rank=3, alpha=6.0, targets=("q_proj", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


@pytest.fixture(scope="module")
def moe_base():
    return random_params(MOE, seed=0)


def test_the_experts_take_an_adapter_per_expert_and_a_new_one_changes_nothing(moe_base):
    adapters = init_lora(moe_base, MOE_LORA, jax.random.key(0))
    shapes = jax.tree.map(lambda x: x.shape, adapters)
    assert shapes["block_0"]["mlp"] == {"experts_gate_up": {"a": (4, 3, 32), "b": (4, 3, 32)},  # gate's 16, up's 16
                                        "experts_down": {"a": (4, 3, 16), "b": (4, 3, 32)}}
    assert "mlp" not in shapes["block_1"]  # the dense layer: no experts, no experts' adapters
    a = adapters["block_0"]["mlp"]["experts_down"]["a"]
    assert float(jnp.abs(a).max()) <= 1 / np.sqrt(16) and not np.allclose(a[0], a[1])  # peft's bound; each its own
    for x, y in zip(jax.tree.leaves(merge(moe_base, adapters, MOE_LORA)), jax.tree.leaves(moe_base)):
        np.testing.assert_array_equal(x, y)


def test_the_experts_merge_is_each_experts_w_plus_scaled_a_b_and_the_unmerged_path_computes_it(moe_base):
    adapters = trained_looking(init_lora(moe_base, MOE_LORA, jax.random.key(0)))
    merged = merge(moe_base, adapters, MOE_LORA)
    mlp, ours = moe_base["block_0"]["mlp"], adapters["block_0"]["mlp"]
    for name, adapter, columns in (("w_gate", "experts_gate_up", slice(0, 16)), ("w_up", "experts_gate_up",
                                   slice(16, 32)), ("w_down", "experts_down", slice(0, 32))):
        a, b = (np.asarray(ours[adapter][x], np.float64) for x in ("a", "b"))
        for e in range(4):
            want = np.asarray(mlp[name][e], np.float64) + (6.0 / 3) * a[e].T @ b[e][:, columns]
            np.testing.assert_allclose(merged["block_0"]["mlp"][name][e], want, rtol=1e-5, atol=1e-5)
    plain = np.asarray(jit_apply(Decoder(MOE), {"params": merged}, jnp.asarray(TOKENS))[0])
    np.testing.assert_allclose(adapted_logits(MOE, moe_base, adapters, MOE_LORA), plain, rtol=1e-4, atol=1e-4)
    base_logits = np.asarray(jit_apply(Decoder(MOE), {"params": moe_base}, jnp.asarray(TOKENS))[0])
    assert np.abs(plain - base_logits).max() > 0.1  # the experts' adapters are read
    with pytest.raises(ValueError, match="config.lora adapts experts_gate_up, but apply\\(\\) was given no 'lora'"):
        attention_only = {block: {"attn": adapters[block]["attn"]} for block in adapters}
        Decoder(MOE.replace(lora=MOE_LORA)).apply({"params": moe_base, "lora": attention_only}, jnp.asarray(TOKENS))


@pytest.mark.parametrize("capacity", [None, 5])
def test_routed_adds_each_experts_adapter_in_both_grouped_products(capacity):
    """`routed` with adapters against `routed` on the merged matrices, each way of multiplying
    (the CPU's blocks and the GPU's and TPU's ragged_dot), and so are the adapters' gradients."""
    spec, n, d, r = MOE_SPEC, 13, 8, 3
    k = jax.random.split(jax.random.key(0), 9)
    tokens = jax.random.normal(k[0], (n, d))
    gates, ids = route(jax.random.normal(k[1], (n, spec.n_experts)), spec)
    w = {"w_gate": jax.random.normal(k[2], (4, d, 16)), "w_up": jax.random.normal(k[3], (4, d, 16)),
         "w_down": jax.random.normal(k[4], (4, 16, d))}
    ab = {"gate_up": (jax.random.normal(k[5], (4, d, r)), jax.random.normal(k[6], (4, r, 32))),
          "down": (jax.random.normal(k[7], (4, 16, r)), jax.random.normal(k[8], (4, r, d)))}
    cotangent = jax.random.normal(jax.random.key(1), (n, d))

    def merged(ab):  # W[e] + a[e] b[e], b's columns the gate's then up's
        gate_up = jnp.einsum("eir,ero->eio", *ab["gate_up"])
        return {"w_gate": w["w_gate"] + gate_up[..., :16], "w_up": w["w_up"] + gate_up[..., 16:],
                "w_down": w["w_down"] + jnp.einsum("eir,ero->eio", *ab["down"])}

    def loss(ab, how, unmerged):
        args = (w, ab) if unmerged else (merged(ab),)
        y, _ = routed(spec, tokens, ids, gates, *args, how=how, block=4 if capacity is None else capacity,
                      capacity=capacity)
        return jnp.sum(y * cotangent), y

    (_, want), want_grads = jax.value_and_grad(loss, has_aux=True)(ab, "in_blocks", False)
    for how in sorted(set(PRODUCTS) - set(KERNEL_PRODUCTS)):  # (the kernels': tests/kernels)
        (_, got), grads = jax.value_and_grad(loss, has_aux=True)(ab, how, True)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
        for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-4 * float(jnp.abs(ref).max()))


def test_a_model_of_experts_takes_the_attentions_and_its_experts_targets():
    qwen3_moe = MOE.replace(hf_model_type="qwen3_moe", layers=tuple(
        dataclasses.replace(spec, ffn=MOE_SPEC) for spec in MOE.layers))
    assert all_targets(qwen3_moe) == ("q_proj", "k_proj", "v_proj", "o_proj")  # (--lora-targets all)
    assert all_targets(qwen3_moe, parameters=True) == ("q_proj", "k_proj", "v_proj", "o_proj",
                                                       "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    check_targets(qwen3_moe, MOE_LORA)
    with pytest.raises(ValueError, match="gate_proj is not a module of a qwen3_moe checkpoint \\(layer 0's MLP is its "
                                         "experts, whose matrices are parameters: mlp.experts.gate_up_proj"):
        check_targets(qwen3_moe, LoraConfig(targets=("gate_proj",)))
    with pytest.raises(ValueError, match="mlp.experts.down_proj is not a parameter of a llama checkpoint \\(it has no "
                                         "layer of experts\\); its targets: q_proj, k_proj, v_proj, o_proj, gate_proj"):
        check_targets(CONFIG, LoraConfig(targets=("mlp.experts.down_proj",)))
    with pytest.raises(ValueError, match="block_0's MLP is a layer of experts; adapt its matrices with"):
        init_lora(random_params(MOE, seed=0), LoraConfig(targets=("up_proj",)), jax.random.key(0))
    with pytest.raises(ValueError, match="dropout must be 0 with the experts' targets \\(mlp.experts.gate_up_proj\\)"):
        LoraConfig(targets=("q_proj", "mlp.experts.gate_up_proj"), dropout=0.1)


# peft's LoRA on transformers 5's fused experts (`target_parameters`), one `ParamWrapper` a parameter
# holding every expert's adapter: lora_A `[E * r, n_in]` (rows e * r + j), lora_B `[n_out, r * E]`
# (columns j * E + e); the two wrappers of one module nested in its order, so gate_up_proj's is the inner
# (`base_layer.`) one. A tiny Qwen3-MoE (`gate_up_proj` `[E, 2F, d]`, the gate's rows first) and a tiny
# gpt-oss (`[E, d, 2F]`, gate and up by turns, `is_transposed`).
PEFT_EXPERTS = {"qwen3_moe": ("Qwen3-30B-A3B", {}),
                "gpt_oss": ("gpt-oss-20b", dict(quantization_config=None, swiglu_limit=1.0))}
EXPERTS_LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "mlp.experts.gate_up_proj",
                                                      "mlp.experts.down_proj"))


def peft_expert_names(i: int, adapter: str) -> str:
    """peft's stem of layer i's experts' adapter, both parameters targeted (the test's own statement of it)."""
    return f"base_model.model.model.layers.{i}.mlp.experts" + (".base_layer" if adapter == "experts_gate_up" else "")


def from_peft_experts(letter: str, value: np.ndarray, n_experts: int, interleaved: bool) -> np.ndarray:
    """peft's lora_A `[E * r, n_in]` or lora_B `[n_out, r * E]` of the experts as ours, `[E, r, n]`,
    b's columns the gate's then up's (gpt-oss's gate_up_proj: `interleaved`, by turns)."""
    if letter == "a":
        return value.reshape(n_experts, -1, value.shape[-1])
    b = value.reshape(value.shape[0], -1, n_experts).transpose(2, 1, 0)
    return np.concatenate([b[..., 0::2], b[..., 1::2]], axis=-1) if interleaved else b


@pytest.mark.peers
@pytest.mark.parametrize("family", sorted(PEFT_EXPERTS))
def test_lora_on_the_experts_equals_peft_one_step_and_the_adapter_files_go_both_ways(family, tmp_path):
    torch = torch_peer()
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    if not hasattr(peft.LoraConfig(), "target_parameters"):
        pytest.skip(f"peft {peft.__version__} adapts no parameters (target_parameters: peft 0.17 and later, as the "
                    f"peers extra pins it)")
    name, overrides = PEFT_EXPERTS[family]
    hf_config = transformers.AutoConfig.for_model(**tiny(name, **overrides))
    scaled_up(transformers.AutoModelForCausalLM.from_config(hf_config), seed=0).save_pretrained(tmp_path / "base")
    config, base = load_hf(str(tmp_path / "base"), max_seq_len=32)
    lora, n_experts, interleaved = EXPERTS_LORA, hf_config.num_local_experts, family == "gpt_oss"
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    adapters = jax.tree.map(lambda x: x / 4, trained_looking(init_lora(base, lora, jax.random.key(0)), seed=2))
    save_peft(config, adapters, lora, str(tmp_path / "ours"))

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    with torch.no_grad():
        plain = model(input_ids=torch.tensor(tokens)).logits.numpy()
    peer = peft.PeftModel.from_pretrained(model, str(tmp_path / "ours"), is_trainable=True)
    labels = torch.tensor(tokens)
    labels[0, :5] = -100
    out = peer(input_ids=torch.tensor(tokens), labels=labels)
    ours = adapted_logits(config, base, adapters, lora, tokens)
    np.testing.assert_allclose(out.logits.detach().numpy(), ours, rtol=1e-4, atol=1e-4)
    assert np.abs(out.logits.detach().numpy() - plain).max() > 0.1  # peft read the adapters

    # One step's loss and the adapters' gradients (the experts' per expert), bounded as the test above's.
    targets = np.where(labels.numpy() == -100, -100, tokens)[:, 1:]
    batch = {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(targets)}

    def loss(adapters, batch, dropout_key):
        out = adapted_logits(config, base, adapters, lora, batch["tokens"])
        return label_smoothed_cross_entropy(out, batch["targets"], 0.0, ignore_id=-100), {}

    value, grads = jax.jit(jax.value_and_grad(lambda a: loss(a, batch, None)[0]))(adapters)  # (one compile)
    out.loss.backward()
    np.testing.assert_allclose(float(value), out.loss.item(), rtol=1e-5)
    named = dict(peer.named_parameters())
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
    wide = float64_config(config)
    grads64 = in_float64(lambda a, b: jax.grad(lambda a: label_smoothed_cross_entropy(
        Decoder(wide.replace(lora=lora)).apply({"params": b, "lora": a}, batch["tokens"])[0], batch["targets"], 0.0,
        ignore_id=-100))(a), adapters, base)
    compared = 0
    for i in range(config.n_layer):
        for part, adapter in (("attn", "wq"), ("attn", "wv"), ("mlp", "experts_gate_up"), ("mlp", "experts_down")):
            pair = grads[f"block_{i}"][part][adapter]
            stem = (f"base_model.model.model.layers.{i}.self_attn.{TARGET_OF[adapter]}" if part == "attn"
                    else peft_expert_names(i, adapter))
            for letter in ("a", "b"):
                got = named[f"{stem}.lora_{letter.upper()}.default.weight"].grad.numpy()
                if part == "attn":
                    got = got if letter == "a" else got.T
                else:
                    got = from_peft_experts(letter, got, n_experts, interleaved and adapter == "experts_gate_up")
                want64 = grads64[f"block_{i}"][part][adapter][letter]
                assert got.shape == want64.shape
                bound = 2 * REORDERED * float(np.abs(np.asarray(pair[letter], np.float64) - want64).max())
                assert bound <= 1e-2 * scale, bound  # float32's rounding, not another result
                np.testing.assert_allclose(np.asarray(pair[letter]), got, rtol=0, atol=bound)
                assert np.abs(got).max() > 10 * bound  # (a gradient, not zeros within the bound)
                compared += 1
    assert compared == 2 * config.n_layer * len(lora.targets)

    # The step moves the experts' adapters, every expert's that was routed to.
    optimizer = optax.adam(1e-2)
    state, _ = make_train_step(loss, optimizer)(TrainState.create(adapters, optimizer), batch, jax.random.key(0))
    moved = state.params["block_0"]["mlp"]["experts_down"]["b"] - adapters["block_0"]["mlp"]["experts_down"]["b"]
    assert (np.abs(np.asarray(moved)).max(axis=(1, 2)) > 0).sum() >= 2

    # peft's own adapters (drawn by peft, its target_parameters as a dotted tail, saved by peft) into jaxformer.
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    theirs = peft.get_peft_model(fresh, peft.LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj"],
                                                        target_parameters=["experts.gate_up_proj",
                                                                           "mlp.experts.down_proj"]))
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # (peft starts B at zero)
    theirs.save_pretrained(str(tmp_path / "theirs"))
    loaded, lora = load_peft(config, str(tmp_path / "theirs"))
    assert (lora.rank, lora.alpha, sorted(lora.targets)) == (3, 5, ["k_proj", "mlp.experts.down_proj",
                                                                    "mlp.experts.gate_up_proj"])
    theirs.eval()
    with torch.no_grad():
        want = theirs(input_ids=torch.tensor(tokens)).logits.numpy()
    assert np.abs(want - plain).max() > 0.1
    np.testing.assert_allclose(adapted_logits(config, base, loaded, lora, tokens), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jit_apply(Decoder(config), {"params": merge(base, loaded, lora)},
                                                    jnp.asarray(tokens))[0]), want, rtol=1e-4, atol=1e-4)


# QLoRA: LoRA over a quantized frozen base (`jaxformer.quantized`). With a format multiplied as its
# dequantized matrix (int4, NF4), a step is LoRA's step on that dequantized base: the same loss and
# adapter gradients, to float32 rounding; the merge is the float merge of the dequantized base.
QLORA_MOE = CONFIG.replace(qk_norm=True, layers=tuple(
    dataclasses.replace(spec, ffn=ExpertsSpec(4, 2, 32)) if i == 0 else spec
    for i, spec in enumerate(layer_specs(CONFIG.replace(qk_norm=True)))))


def dequantized(params):
    return jax.tree.map(lambda w: dequantize(w) if isinstance(w, QArray) else w, params,
                        is_leaf=lambda w: isinstance(w, QArray))


@pytest.mark.parametrize("how", [Quantization("nf4", 32), Quantization("int4", 32, affine=True)], ids=str)
@pytest.mark.parametrize("config,lora", [(CONFIG, LORA), (QLORA_MOE, MOE_LORA)], ids=["dense", "experts"])
def test_a_qlora_step_is_loras_step_on_the_dequantized_base(config, lora, how):
    float_base = random_params(config, seed=0)
    base = quantize_params(float_base, param_axes(Decoder(config)), how)
    assert any(isinstance(w, QArray) for w in jax.tree.leaves(base, is_leaf=lambda w: isinstance(w, QArray)))
    adapters = trained_looking(init_lora(base, lora, jax.random.key(0)))
    model = Decoder(config.replace(lora=lora))

    @jax.jit
    def loss_and_grads(base, adapters):  # the base an argument, as jaxformer-finetune's step takes it
        def loss(adapters):
            out = model.apply({"params": base, "lora": adapters}, jnp.asarray(TOKENS[:, :-1]))[0]
            return label_smoothed_cross_entropy(out, jnp.asarray(TOKENS[:, 1:]), 0.0)
        return jax.value_and_grad(loss)(adapters)

    got, grads = loss_and_grads(base, adapters)
    want, want_grads = loss_and_grads(dequantized(base), adapters)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.abs(w).max()))
    assert float(np.abs(jax.tree.leaves(grads)[0]).max()) > 0  # the adapters learn through the quantized base
    merged = merge(base, adapters, lora)  # float where adapted; the other quantized matrices as they were
    for m, w in zip(jax.tree.leaves(dequantized(merged)), jax.tree.leaves(merge(dequantized(base), adapters, lora))):
        np.testing.assert_allclose(m, w, rtol=1e-6, atol=1e-6)
