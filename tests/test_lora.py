"""LoRA on the parameter tree: the merge against the formula through an independent forward,
and against HF peft on torch (logits, one step's loss and adapter gradients, both ways of the
adapter files)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import import_peer, numpy_decoder_logits, random_params

from jaxformer import Decoder, DecoderConfig, label_smoothed_cross_entropy
from jaxformer.convert import save_hf
from jaxformer.lora import LoraConfig, init_lora, load_peft, merge, save_peft

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
    return np.asarray(Decoder(CONFIG).apply({"params": params}, jnp.asarray(tokens))[0])


def test_a_new_adapter_changes_nothing(base):
    adapters = init_lora(base, LORA, jax.random.key(0))
    a = adapters["block_0"]["attn"]["wq"]["a"]
    assert a.shape == (32, 4) and float(jnp.abs(a).max()) <= 1 / np.sqrt(32)
    merged = merge(base, adapters, LORA)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(base)):
        np.testing.assert_array_equal(x, y)


def test_the_merge_is_w_plus_scaled_a_b_in_an_independent_forward(base):
    adapters = trained_looking(init_lora(base, LORA, jax.random.key(0)))
    want = jax.tree.map(lambda x: np.asarray(x, np.float64), base)
    for block in ("block_0", "block_1"):
        for part, name, n_in in (("attn", "wq", 1), ("attn", "wk", 1), ("attn", "wv", 1), ("attn", "wo", 2),
                                 ("mlp", "w_gate", 1), ("mlp", "w_up", 1), ("mlp", "w_down", 1)):
            w = want[block][part][name]
            ab = adapters[block][part][name]
            delta = np.asarray(ab["a"], np.float64) @ np.asarray(ab["b"], np.float64) * (8.0 / 4)
            want[block][part][name] = w + delta.reshape(w.shape)
    np.testing.assert_allclose(logits(merge(base, adapters, LORA)), numpy_decoder_logits(want, TOKENS, CONFIG),
                               rtol=1e-4, atol=1e-4)


def test_training_moves_only_the_adapters(base):
    adapters = init_lora(base, LORA, jax.random.key(0))
    optimizer = optax.adam(1e-2)
    state = optimizer.init(adapters)
    frozen = jax.tree.map(np.array, base)

    def loss(adapters):
        out = Decoder(CONFIG).apply({"params": merge(base, adapters, LORA)}, jnp.asarray(TOKENS[:, :-1]))[0]
        return label_smoothed_cross_entropy(out, jnp.asarray(TOKENS[:, 1:]), 0.0)

    before = float(loss(adapters))
    for _ in range(5):
        grads = jax.grad(loss)(adapters)
        updates, state = optimizer.update(grads, state)
        adapters = optax.apply_updates(adapters, updates)
    assert float(loss(adapters)) < before
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


@pytest.mark.peers
def test_peft_opens_our_adapters_and_we_open_its_with_the_same_logits_and_gradients(base, tmp_path):
    torch = import_peer("torch")
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    save_hf(CONFIG, base, str(tmp_path / "base"))
    adapters = trained_looking(init_lora(base, LORA, jax.random.key(0)))
    save_peft(CONFIG, adapters, LORA, str(tmp_path / "ours"))

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    peer = peft.PeftModel.from_pretrained(model, str(tmp_path / "ours"), is_trainable=True)
    tokens = torch.tensor(TOKENS)
    out = peer(input_ids=tokens[:, :-1], labels=tokens[:, :-1].clone())  # (labels: next-token loss, shifted inside)
    np.testing.assert_allclose(out.logits.detach().numpy(), logits(merge(base, adapters, LORA), TOKENS[:, :-1]),
                               rtol=1e-4, atol=1e-4)

    # One step's loss and the adapters' gradients, masking included (the last position has no target).
    def loss(adapters):
        out = Decoder(CONFIG).apply({"params": merge(base, adapters, LORA)}, jnp.asarray(TOKENS[:, :-1]))[0]
        return label_smoothed_cross_entropy(out[:, :-1], jnp.asarray(TOKENS[:, 1:-1]), 0.0)

    value, grads = jax.value_and_grad(loss)(adapters)
    out.loss.backward()
    np.testing.assert_allclose(float(value), out.loss.item(), rtol=1e-5)
    named = dict(peer.named_parameters())
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads))
    for i in range(CONFIG.n_layer):
        for target, (part, name) in (("q_proj", ("attn", "wq")), ("o_proj", ("attn", "wo")),
                                     ("down_proj", ("mlp", "w_down"))):
            module = "self_attn" if part == "attn" else "mlp"
            stem = f"base_model.model.model.layers.{i}.{module}.{target}"
            for letter in ("a", "b"):
                got = named[f"{stem}.lora_{letter.upper()}.default.weight"].grad.numpy().T
                # float32 through two sharp layers: agreement to 1e-4 of the largest gradient
                np.testing.assert_allclose(np.asarray(grads[f"block_{i}"][part][name][letter]), got,
                                           rtol=1e-3, atol=1e-4 * scale)

    # peft's own adapters (drawn by peft, saved by peft) into jaxformer.
    fresh = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    theirs = peft.get_peft_model(fresh, peft.LoraConfig(r=3, lora_alpha=5, target_modules=["v_proj", "up_proj"],
                                                        lora_dropout=0.0, init_lora_weights="gaussian"))
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # (peft starts B at zero even for "gaussian")
    theirs.save_pretrained(str(tmp_path / "theirs"))
    loaded, lora = load_peft(CONFIG, str(tmp_path / "theirs"))
    assert (lora.rank, lora.alpha, set(lora.targets)) == (3, 5, {"v_proj", "up_proj"})
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits.numpy()
    np.testing.assert_allclose(logits(merge(base, loaded, lora)), want, rtol=1e-4, atol=1e-4)
