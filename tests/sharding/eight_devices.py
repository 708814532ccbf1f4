"""Sharding cases; `tests/test_sharding.py` runs this file on 8 simulated CPU devices."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import REORDERED, float64_config, in_float64
from jax.sharding import NamedSharding, PartitionSpec

from jaxformer import Decoder, DecoderConfig, VanillaConfig, VanillaTransformer, generate, label_smoothed_cross_entropy
from jaxformer.convert import unstack_layers
from jaxformer.decoding import DecodeRequest, advance, start
from jaxformer.deltanet import GatedDeltaNetSpec
from jaxformer.experts import ROUTER_COLLECTION, ExpertsSpec
from jaxformer.feedforward import GatedMLPSpec
from jaxformer.latent_attention import LatentAttentionSpec
from jaxformer.layers import LayerSpec, layer_specs
from jaxformer.quantized import QArray, Quantization, dequantize
from jaxformer.sharding import (
    batch_sharding,
    cache_shardings,
    check_mesh_fits,
    make_mesh,
    param_axes,
    parse_mesh,
    partition_spec,
    tree_shardings,
)
from jaxformer.training import TrainState, make_train_step

jax.config.update("jax_default_matmul_precision", "highest")
assert jax.device_count() == 8, "run through tests/test_sharding.py (8 simulated devices)"

DECODER = DecoderConfig(vocab_size=64, n_layer=2, n_head=8, n_kv_head=2, d_model=64, max_seq_len=32,
                        tie_embeddings=False)
VANILLA = VanillaConfig(src_vocab_size=24, tgt_vocab_size=24, n_layer=1, d_model=64, d_ff=128, n_head=8,
                        dropout=0.1, max_seq_len=16)
MESHES = [("dp", 8, 1), ("fsdp", 8, 1), ("dp", 1, 8), ("dp", 2, 4), ("fsdp", 2, 4)]
BATCH = 8

# The new mixer kinds on meshes: a hybrid (three Gated DeltaNet layers, then a full-attention one; 2 key and 4
# value heads) and a decoder of latent attention layers (8 query heads over one latent).
_LINEAR = GatedDeltaNetSpec(2, 4, 8, 8, chunk=4)
HYBRID = DECODER.replace(n_layer=4, layers=(dataclasses.replace(layer_specs(DECODER)[0], mixer=_LINEAR),) * 3
                         + (layer_specs(DECODER)[0],))
_LATENT = LatentAttentionSpec(n_head=8, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                              v_head_dim=6, rope_theta=10000.0, rope_scaling=None, rope_pairing="split_half")
LATENT = DECODER.replace(layers=(LayerSpec(_LATENT, GatedMLPSpec(48)),) * DECODER.n_layer)
NEW_KINDS = [HYBRID, LATENT]
NEW_MESHES = [("dp", 2, 4), ("fsdp", 4, 2)]


@functools.cache  # each setup is made once, and its one-device steps (below) run once
def _decoder_setup(config=DECODER):
    model = Decoder(config)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]  # (one compile)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, 17), 0, config.vocab_size)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss_fn(params, batch, dropout_key):
        logits, _ = model.apply({"params": params}, batch["tokens"])
        return label_smoothed_cross_entropy(logits, batch["targets"], 0.0), {}

    return params, batch, loss_fn, param_axes(model)


@functools.cache
def _vanilla_setup():
    model = VanillaTransformer(VANILLA)
    src = jax.random.randint(jax.random.key(2), (BATCH, 10), 1, VANILLA.src_vocab_size)
    tgt = jax.random.randint(jax.random.key(3), (BATCH, 11), 1, VANILLA.tgt_vocab_size)
    params = jax.jit(model.init)(jax.random.key(0), src, tgt)["params"]
    batch = {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}

    def loss_fn(params, batch, dropout_key):  # dropout on: its bits must not depend on the sharding
        logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], deterministic=False,
                             rngs={"dropout": dropout_key})
        return label_smoothed_cross_entropy(logits, batch["tgt_out"], 0.1, ignore_id=VANILLA.pad_id), {}

    return params, batch, loss_fn, param_axes(model)


# Adam divides by sqrt(v) + eps, so a gradient component that is float noise (~1e-9, and
# summed in another order on another mesh) becomes an update of about lr * noise / eps.
# eps 1e-3 keeps that near 1e-8, so the comparison below can stay tight.
OPTIMIZER = optax.adam(1e-2, eps=1e-3)


@functools.cache
def _one_device_steps(setup, config=None):
    """`_two_steps` of `setup(...)` on one device: the result every mesh must reproduce."""
    return _two_steps(*(setup() if config is None else setup(config)))


def _two_steps(params, batch, loss_fn, axes, mesh=None, strategy="dp"):
    state = TrainState.create(params, OPTIMIZER)
    state_sharding = None
    if mesh is not None:
        state_sharding = tree_shardings(state, axes, mesh, strategy)
        state = jax.device_put(state, state_sharding)
        batch = jax.device_put(batch, batch_sharding(mesh))
    step = make_train_step(loss_fn, OPTIMIZER, state_sharding)
    losses = []
    for i in range(2):
        state, metrics = step(state, batch, jax.random.key(10 + i))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.mark.parametrize("setup, config", [(_decoder_setup, DECODER), (_vanilla_setup, VANILLA)],
                         ids=["decoder", "vanilla"])
@pytest.mark.parametrize("strategy, data, model", MESHES, ids=[f"{s}-{d}x{m}" for s, d, m in MESHES])
def test_sharded_train_steps_match_one_device(setup, config, strategy, data, model):
    params, batch, loss_fn, axes = setup()
    want_state, want_losses = _one_device_steps(setup)
    mesh = make_mesh(data=data, model=model)
    check_mesh_fits(config, mesh)
    state, losses = _two_steps(params, batch, loss_fn, axes, mesh, strategy)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5), state.params,
                 want_state.params)
    # Parameters and optimizer moments stay where the rules put them.
    for tree in (state.params, state.opt_state):
        for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(tree),
                                          jax.tree.leaves(tree_shardings(tree, axes, mesh, strategy))):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), jax.tree_util.keystr(path)


def test_the_rules_split_what_they_say():
    mesh = make_mesh(data=2, model=4)
    params = _decoder_setup()[0]
    axes = param_axes(Decoder(DECODER))
    specs = {"/".join(k.key for k in path): sharding.spec for path, sharding in
             jax.tree_util.tree_leaves_with_path(tree_shardings(params, axes, mesh, "fsdp"),
                                                 is_leaf=lambda x: isinstance(x, NamedSharding))}
    P = PartitionSpec
    assert specs["block_0/attn/wq"] == P("data", "model", None)  # [d_model, 8 heads, head_dim]: heads on model
    assert specs["block_0/attn/wk"] == P("data", None, None)  # 2 kv heads do not split 4 ways: kept whole
    assert specs["block_0/attn/wo"] == P("model", None, "data")
    assert specs["block_0/mlp/w_gate"] == P("data", "model") and specs["block_0/mlp/w_down"] == P("model", "data")
    assert specs["block_0/attn_norm/weight"] == P("data")
    assert specs["embed"] == P("model", "data") and specs["lm_head"] == P("data", "model")  # vocabulary-parallel
    sharded = jax.device_put(params, tree_shardings(params, axes, mesh, "fsdp"))
    wq = sharded["block_0"]["attn"]["wq"]  # [64, 8, 8] over data 2 x model 4
    assert {shard.data.shape for shard in wq.addressable_shards} == {(32, 2, 8)}
    wq_axes = axes["block_0"]["attn"]["wq"]
    assert partition_spec(wq_axes, (64, 8, 8), mesh, "dp") == P(None, "model", None)
    assert partition_spec(wq_axes, (64, 8, 8), make_mesh(data=8), "dp") == P(None, None, None)


@jax.jit  # one program per tree, not one per leaf
def _sharp(params):
    """Parameters redrawn at a large scale, so that the greedy tokens vary."""
    return jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(x.size), x.shape), params)


@pytest.mark.parametrize("strategy, data, model", [("dp", 2, 4), ("fsdp", 8, 1)])
def test_sharded_generation_matches_one_device(strategy, data, model):
    params = _decoder_setup()[0]
    params = _sharp(params)
    prompt = jax.random.randint(jax.random.key(4), (BATCH, 5), 0, DECODER.vocab_size)
    want = generate(Decoder(DECODER), params, prompt, max_new_tokens=20)
    mesh = make_mesh(data=data, model=model)
    got = generate(Decoder(DECODER), jax.device_put(params, tree_shardings(params, param_axes(Decoder(DECODER)),
                                                                           mesh, strategy)),
                   jax.device_put(prompt, batch_sharding(mesh)), max_new_tokens=20)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(np.asarray(want[:, 5:]))) > 5


@pytest.mark.parametrize("data, model, spec", [
    (2, 4, PartitionSpec("data", None, None, None)),  # 2 kv heads do not split 4 ways: whole on each device
    (4, 2, PartitionSpec("data", None, "model", None)),
])
def test_the_kv_cache_is_sharded_like_the_attention(data, model, spec):
    decoder = Decoder(DECODER)
    params = _decoder_setup()[0]
    mesh = make_mesh(data=data, model=model)
    params = jax.device_put(params, tree_shardings(params, param_axes(decoder), mesh, "dp"))
    prompt = jax.random.randint(jax.random.key(4), (BATCH, 5), 0, DECODER.vocab_size)
    request = DecodeRequest.create(decoder, prompt, max_new_tokens=4)
    state = start(decoder, params, request, mesh)
    for _ in range(2):  # and it stays so through the donated steps
        for array in (state.cache.layers[0].k, state.cache.layers[-1].v):
            assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4), array.sharding
        state, _, _ = advance(decoder, params, request, state)


def test_scanned_decoder_on_a_mesh_matches_one_device():
    """The scanned form on fsdp data 2 x model 4: its stacked parameters split as the
    unrolled ones do, never along the layer axis; a train step equals one device's;
    generation equals the unrolled model's on one device, with the stacked cache's rows
    over `data` and its kv heads (2 of them, not 4) kept whole."""
    config = DECODER.replace(scan_layers=True)
    params, batch, loss_fn, axes = _decoder_setup(config)
    mesh = make_mesh(data=2, model=4)
    specs = tree_shardings(params, axes, mesh, "fsdp")
    P = PartitionSpec
    assert specs["blocks"]["attn"]["wq"].spec == P(None, "data", "model", None)  # [layers, d_model, heads, head_dim]
    assert specs["blocks"]["mlp"]["w_down"].spec == P(None, "model", "data")
    want_state, want_losses = _one_device_steps(_decoder_setup, config)
    state, losses = _two_steps(params, batch, loss_fn, axes, mesh, "fsdp")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5), state.params,
                 want_state.params)

    scanned = Decoder(config)
    params = _sharp(params)
    prompt = jax.random.randint(jax.random.key(4), (BATCH, 5), 0, DECODER.vocab_size)
    want = generate(Decoder(DECODER), unstack_layers(params, config), prompt, max_new_tokens=20)
    placed = jax.device_put(params, specs)
    got = generate(scanned, placed, jax.device_put(prompt, batch_sharding(mesh)), max_new_tokens=20)
    np.testing.assert_array_equal(got, want)
    request = DecodeRequest.create(scanned, prompt, max_new_tokens=4)
    cache = start(scanned, placed, request, mesh).cache
    assert cache.layers.k.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, None, None, None)), 5)


@pytest.mark.parametrize("call, match", [
    (lambda: make_mesh(data=3), r"data \* model must equal the device count 8"),
    (lambda: make_mesh(model=3), "model must be a positive int dividing the device count 8"),
    (lambda: parse_mesh("data=2,pipeline=4"), "each part must be data=N, expert=E or model=M"),
    (lambda: make_mesh(data=2, expert=3), "expert must be a positive int dividing the device count 8"),
    (lambda: make_mesh(data=2, expert=2), r"data \* expert \* model must equal the device count 8, got data=2 x "
                                          "expert=2 x model=1"),
    (lambda: check_mesh_fits(MOE.replace(layers=(MOE.layers[0], dataclasses.replace(
        MOE.layers[1], ffn=ExpertsSpec(6, 2, 32)))), make_mesh(data=2, expert=4)),
     r"DecoderConfig.layers\[1\].ffn.n_experts=6 is not divisible by the mesh's expert axis \(4\)"),
    (lambda: parse_mesh("data=0"), "data must be a positive int"),
    (lambda: check_mesh_fits(DECODER.replace(n_head=4, n_kv_head=2, d_model=64), make_mesh(data=1, model=8)),
     r"DecoderConfig.n_head=4 is not divisible by the mesh's model axis \(8\)"),
    (lambda: partition_spec(("embed",), (4,), make_mesh(), "zero3"), "strategy must be one of"),
])
def test_bad_meshes_are_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_parse_mesh():
    assert parse_mesh("data=4,model=2") == {"data": 4, "model": 2}
    assert parse_mesh("model=8") == {"model": 8}
    assert parse_mesh("data=2,expert=4") == {"data": 2, "expert": 4}
    assert make_mesh(data=2, expert=4).shape == {"data": 2, "expert": 4, "model": 1}


LM_TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--n-kv-head", "1", "--batch-size", "8",
           "--log-every", "2", "--checkpoint-every", "2", "--warmup", "2", "--eval-size", "8"]


def _losses(run_dir):
    from jaxformer.training import read_metrics
    return [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")]


REVERSE_TINY = ["--n-layer", "1", "--d-model", "32", "--d-ff", "32", "--n-head", "2", "--batch-size", "16",
                "--eval-size", "16", "--log-every", "2", "--checkpoint-every", "4"]


def test_train_reverse_on_a_mesh_resumes_on_another(tmp_path):
    """4 steps on a 4 x 2 mesh, then resumed on 8 x 1 with FSDP: the losses of one
    uninterrupted single-device run, step for step (dropout included)."""
    from train import reverse
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    assert reverse.main([*REVERSE_TINY, "--steps", "8", "--run-dir", str(single)]) == 0
    assert reverse.main([*REVERSE_TINY, "--steps", "4", "--run-dir", str(sharded), "--mesh", "data=4,model=2"]) == 0
    assert reverse.main([*REVERSE_TINY, "--steps", "8", "--run-dir", str(sharded), "--mesh", "data=8", "--fsdp",
                         "--resume"]) == 0
    assert len(_losses(single)) == 4
    np.testing.assert_allclose(_losses(sharded), _losses(single), rtol=1e-5)


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "data=3"], r"data \* model must equal the device count 8"),
    (["--mesh", "data=4,model=2", "--n-head", "3", "--d-model", "48"], "n_head=3 is not divisible"),
    (["--mesh", "data=8", "--batch-size", "4"], "--batch-size 4 is not divisible by the mesh's data axis"),
    (["--fsdp"], "--fsdp needs --mesh"),
])
def test_train_lm_refuses_a_mesh_that_does_not_fit(tmp_path, capsys, flags, message):
    from train import lm
    with pytest.raises(SystemExit) as exit_info:
        lm.main([*LM_TINY, "--steps", "2", "--run-dir", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()  # refused before the run directory was made



# (config, targets, mesh): Llama's modules on the dense decoder; on the hybrid, its Gated DeltaNet layers' five
# modules, its attention layer's q and o and every layer's up, on the meshes that split its 4 value heads over
# `model` (its 2 kv heads too on 4 x 2; whole on 2 x 4), with and without FSDP.
LORA_CASES = ([("decoder", DECODER, ("q_proj", "o_proj", "up_proj", "down_proj"), *mesh) for mesh in MESHES[:3]]
              # (the hybrid's layers under FSDP: test_the_new_mixers_train_and_generate_on_a_mesh_as_on_one_device)
              + [("hybrid", HYBRID, ("q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                     "out_proj", "up_proj"), *NEW_MESHES[0])])


@pytest.mark.parametrize("config, targets, strategy, data, model", [case[1:] for case in LORA_CASES],
                         ids=[f"{name}-{s}-{d}x{m}" for name, _, _, s, d, m in LORA_CASES])
def test_lora_gradients_on_a_mesh_match_one_device(config, targets, strategy, data, model):
    """The frozen base placed by the rules, the adapters whole on every device (as
    jaxformer-finetune places them), dropout on: the loss and the adapters' gradients are one
    device's (the same masks drawn; only the reductions' order differs).

    A gradient entry sums 128 positions' terms that cancel, so another order of the float32 sums
    moves it by an amount that depends on the masks drawn (measured over four dropout keys, 2e-5
    to 7e-4 of the largest entry). The bound is the suite's error model (`REORDERED`): each
    program's rounding within REORDERED times the one-device program's, measured against its
    float64 twin; a wrong mask or a mis-split base moves an entry by its own size."""
    from jaxformer.lora import LoraConfig, init_lora

    lora = LoraConfig(rank=4, alpha=8.0, targets=targets, dropout=0.1)
    base, batch, _, axes = _decoder_setup(config)
    adapters = jax.tree.map(lambda x: x + 0.1, init_lora(base, lora, jax.random.key(2)))  # b away from zero

    def loss_and_grads(config, base, adapters, batch):
        def loss(adapters):
            logits, _ = Decoder(config.replace(lora=lora)).apply({"params": base, "lora": adapters}, batch["tokens"],
                                                                 rngs={"dropout": jax.random.key(3)})
            return label_smoothed_cross_entropy(logits, batch["targets"], 0.0)
        return jax.value_and_grad(loss)(adapters)

    program = jax.jit(functools.partial(loss_and_grads, config))
    want_loss, want_grads = program(base, adapters, batch)
    mesh = make_mesh(data=data, model=model)
    placed = jax.device_put(base, tree_shardings(base, axes, mesh, strategy))
    loss, grads = program(placed, adapters, jax.device_put(batch, batch_sharding(mesh)))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)  # the same masks, the same forward
    _, grads64 = in_float64(functools.partial(loss_and_grads, float64_config(config)), base, adapters, batch)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads))
    for got, want, want64 in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), jax.tree.leaves(grads64)):
        bound = 2 * REORDERED * float(np.abs(np.asarray(want, np.float64) - want64).max())
        assert bound <= 1e-2 * scale, bound  # float32's rounding, not another result
        np.testing.assert_allclose(got, want, rtol=0, atol=bound)


def test_train_finetune_on_a_mesh_resumes_on_another(tmp_path):
    """LoRA on a checkpoint folder: 4 steps on a 4 x 2 mesh, then resumed on 8 x 1 with
    FSDP: the losses of one uninterrupted single-device run (dropout on)."""
    import shutil

    from jaxformer.commands import finetune
    from jaxformer.convert import save_hf
    from jaxformer.text import char_tokenizer, save_tokenizer

    words = "the cat sat on a mat and dog log".split()
    tokenizer = char_tokenizer(sorted(set(" ".join(words))))
    config = DECODER.replace(vocab_size=tokenizer.vocab_size, max_seq_len=64)
    save_hf(config, _decoder_setup(config)[0], str(tmp_path / "checkpoint"))
    save_tokenizer(tokenizer, str(tmp_path / "checkpoint"))
    data = tmp_path / "words.txt"
    data.write_text(" ".join(np.random.default_rng(0).choice(words, 600)))
    flags = ["--checkpoint", str(tmp_path / "checkpoint"), "--data", str(data), "--batch-size", "8", "--seq-len", "16",
             "--lora-rank", "4", "--lora-dropout", "0.1", "--lr", "1e-2", "--warmup", "1", "--log-every", "2",
             "--checkpoint-every", "4"]
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    assert finetune.main([*flags, "--steps", "8", "--run-dir", str(single)]) == 0
    assert finetune.main([*flags, "--steps", "8", "--run-dir", str(sharded), "--mesh", "data=4,model=2"]) == 0
    shutil.rmtree(sharded / "checkpoints" / "8")  # stopped after step 4's checkpoint
    assert finetune.main([*flags, "--steps", "8", "--run-dir", str(sharded), "--mesh", "data=8", "--fsdp",
                          "--resume"]) == 0
    assert len(_losses(single)) == 4
    np.testing.assert_allclose(_losses(sharded), _losses(single), rtol=1e-5)


@pytest.mark.parametrize("strategy,data,model", [("fsdp", 8, 1), ("dp", 2, 4), ("fsdp", 4, 2)])
def test_load_hf_places_each_tensor_in_its_sharding_as_it_reads_it(tmp_path, monkeypatch, strategy, data, model):
    """`load_hf(shardings=)` gives the values of a plain load, in the shardings asked for, and
    no device is ever handed more of a tensor than its block (each block cut on its own)."""
    import jaxformer.convert.hf as hf
    from jaxformer.convert import load_hf, save_hf

    save_hf(DECODER, _decoder_setup()[0], str(tmp_path))
    _, want = load_hf(str(tmp_path))
    mesh = make_mesh(data=data, model=model)
    shardings = tree_shardings(want, param_axes(Decoder(DECODER)), mesh, strategy)
    handed = []  # (the tensor's shape, the block a device was given, the block its sharding gives it)
    make = jax.make_array_from_callback

    def watched(shape, sharding, callback):
        def block(index):
            out = callback(index)
            handed.append((shape, out.shape, sharding.shard_shape(shape)))
            return out
        return make(shape, sharding, block)
    monkeypatch.setattr(hf.jax, "make_array_from_callback", watched)
    _, got = load_hf(str(tmp_path), shardings=shardings)
    for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(shardings)):
        np.testing.assert_array_equal(g, w)
        assert g.sharding == s
    assert {shape for shape, _, _ in handed} == {w.shape for w in jax.tree.leaves(want)}  # every tensor so read
    assert all(given == block for _, given, block in handed)
    assert any(given != shape for shape, given, _ in handed)  # and blocks smaller than their tensors


@pytest.mark.parametrize("how, scan_layers", [("int8", False), (Quantization("int4", 32, affine=True), True)],
                         ids=["int8", "int4-affine-scanned"])
def test_a_quantized_model_loads_onto_a_mesh_and_gives_one_devices_logits(tmp_path, how, scan_layers):
    """`load_hf(quantize=, shardings=)` given the float model's shardings (FSDP, data 2 x model 4): every
    array equals one device's load and lies where `tree_shardings` puts the quantized tree: the values as
    the float weights, the scales and zero points so too where they divide, whole where not (int8's one
    scale over the inputs; int4's 6 groups of w_down's 192 inputs over 4 devices). The logits are one
    device's. (The scanned form reads each layer into a stacked buffer, placed at the end.)"""
    from jaxformer.convert import load_hf, save_hf

    save_hf(DECODER, _sharp(_decoder_setup()[0]), str(tmp_path))
    config, want = load_hf(str(tmp_path), quantize=how, scan_layers=scan_layers)
    model, mesh = Decoder(config), make_mesh(data=2, model=4)
    axes = param_axes(model)
    floats = tree_shardings(jax.eval_shape(lambda: model.init(jax.random.key(0), *model.init_inputs())["params"]),
                            axes, mesh, "fsdp")
    _, got = load_hf(str(tmp_path), quantize=how, scan_layers=scan_layers, shardings=floats)
    for g, w, s in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(tree_shardings(
            want, axes, mesh, "fsdp")), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert g.sharding == s, (g.shape, g.sharding, s)
    quantized = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(
        got, is_leaf=lambda x: isinstance(x, QArray)) if isinstance(leaf, QArray)]
    assert len(quantized) == 7 * (1 if scan_layers else DECODER.n_layer)
    P, stack = PartitionSpec, (None,) * scan_layers  # (the layers axis: never split)
    for path, w in quantized:  # each matrix's values split as its float weight, in their stored order (inputs last)
        spec = tuple(_get(floats, path).spec)
        assert w.qvalue.sharding.spec == P(*w.stored_order(spec + (None,) * (w.ndim - len(spec)))), path
    layer = got["blocks"] if scan_layers else got["block_0"]
    wq, w_down = layer["attn"]["wq"], layer["mlp"]["w_down"]  # stored [H, D, d] and [d, F]
    assert {shard.data.shape for shard in wq.qvalue.addressable_shards} == {(2,) * scan_layers + (2, 8, 32)}
    assert w_down.qvalue.sharding.spec == P(*stack, "data", "model")
    if how == "int8":  # scales [8, 8, 1] and [64, 1]
        assert wq.scale.sharding.spec == P(*stack, "model", None, None)
        assert w_down.scale.sharding.spec == P(*stack, "data", None)
    else:  # scales and zero points [8, 8, 2] (64 inputs in groups of 32) and [64, 6]
        for part in (wq.scale, wq.zero_point):
            assert part.sharding.spec == P(*stack, "model", None, "data")
        assert w_down.scale.sharding.spec == w_down.zero_point.sharding.spec == P(*stack, "data", None)
    tokens = jax.random.randint(jax.random.key(4), (BATCH, 8), 0, DECODER.vocab_size)
    apply = jax.jit(lambda params, tokens: model.apply({"params": params}, tokens)[0])
    logits, want_logits = apply(got, jax.device_put(tokens, batch_sharding(mesh))), apply(want, tokens)
    if how == "int8":  # (W8A8: each row's int8 rounding, then exact integer sums)
        np.testing.assert_allclose(logits, want_logits, atol=1e-6, rtol=1e-5)
        return
    # int4 is multiplied as its dequantized matrices, in float32 sums the mesh orders otherwise: within
    # the reordered sums' error model (conftest.REORDERED) of the dequantized model's float64 logits.
    dequantized = jax.tree.map(lambda w: dequantize(w) if isinstance(w, QArray) else w, want,
                               is_leaf=lambda w: isinstance(w, QArray))
    want64 = in_float64(lambda p, t: Decoder(float64_config(config)).apply({"params": p}, t)[0], dequantized, tokens)
    bound = 2 * REORDERED * float(np.abs(np.asarray(want_logits, np.float64) - want64).max())
    assert bound <= 1e-4 * max(float(np.abs(want64).max()), 1.0), bound  # float32's rounding, not another result
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=bound)


def _get(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_a_train_state_is_born_in_its_sharding():
    """`TrainState.create(..., sharding)` makes the optimizer's moments in their blocks, equal
    to the state made on one device and moved there."""
    model = Decoder(DECODER)
    params = _decoder_setup()[0]
    optimizer = optax.adamw(1e-3)
    mesh = make_mesh(data=4, model=2)
    shapes = jax.eval_shape(lambda p: TrainState.create(p, optimizer), params)
    sharding = tree_shardings(shapes, param_axes(model), mesh, "fsdp")
    born = TrainState.create(jax.device_put(params, sharding.params), optimizer, sharding)
    moved = jax.device_put(TrainState.create(params, optimizer), sharding)
    for b, m, s in zip(jax.tree.leaves(born), jax.tree.leaves(moved), jax.tree.leaves(sharding)):
        np.testing.assert_array_equal(b, m)
        assert b.sharding == s
    mu = born.opt_state[0].mu["block_0"]["mlp"]["w_up"]
    assert mu.addressable_shards[0].data.size == mu.size // 8  # split over data and model


# Expert parallelism: a decoder whose every feed-forward is a mixture of 8 experts, top 2.
MOE = DECODER.replace(layers=tuple(dataclasses.replace(spec, ffn=ExpertsSpec(8, 2, 32))
                                   for spec in layer_specs(DECODER)))
EP_MESHES = [("dp", dict(expert=8)), ("fsdp", dict(expert=8)), ("dp", dict(data=2, expert=4)),
             ("fsdp", dict(data=2, expert=4)), ("dp", dict(data=2, expert=2, model=2)),
             ("fsdp", dict(data=2, expert=2, model=2))]
EP_IDS = [f"{strategy}-" + ",".join(f"{k}={v}" for k, v in sizes.items()) for strategy, sizes in EP_MESHES]


def _experts_split(params, mesh, n_expert):
    """Every experts' weight is split over `expert`: its first axis, E / n experts a device."""
    for name in ("w_gate", "w_up", "w_down"):
        leaf = params["block_0"]["mlp"][name]
        assert leaf.sharding.spec[0] == "expert", (name, leaf.sharding.spec)
        assert {shard.data.shape[0] for shard in leaf.addressable_shards} == {8 // n_expert}


@functools.cache
def _moe_logits(config):
    """One device's logits and router drops for `config` (MOE, or MOE with a capacity)."""
    params, batch, _, _ = _decoder_setup(config)
    return _apply_moe(config)(params, batch["tokens"])


@functools.cache
def _apply_moe(config):
    def apply(params, tokens):
        (logits, _), sown = Decoder(config).apply({"params": params}, tokens, mutable=[ROUTER_COLLECTION])
        return logits, [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(sown) if "dropped" in str(path)]
    return jax.jit(apply)


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
@pytest.mark.parametrize("strategy, sizes", EP_MESHES, ids=EP_IDS)
def test_expert_parallel_logits_match_one_device(strategy, sizes, capacity_factor):
    """On a mesh with an `expert` axis (set as the context's mesh), each device holds its share
    of the experts, the tokens are gathered to them and their outputs summed back
    (`expert_parallel`, a `shard_map` in the program): the logits, and with a capacity the pairs
    each layer dropped (pooled over the whole call, as on one device), are one device's."""
    config = MOE if capacity_factor is None else MOE.replace(layers=tuple(
        dataclasses.replace(spec, ffn=dataclasses.replace(spec.ffn, capacity_factor=capacity_factor))
        for spec in MOE.layers))
    params, batch, _, axes = _decoder_setup(config)
    want, want_dropped = _moe_logits(config)
    mesh = make_mesh(**sizes)
    check_mesh_fits(config, mesh)
    placed = jax.device_put(params, tree_shardings(params, axes, mesh, strategy))
    _experts_split(placed, mesh, sizes["expert"])
    tokens = jax.device_put(batch["tokens"], batch_sharding(mesh))
    assert tokens.sharding.spec == PartitionSpec(("data", "expert"))  # rows over data x expert
    apply = _apply_moe(config)
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(apply)(placed, tokens))
        got, dropped = apply(placed, tokens)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    np.testing.assert_array_equal(dropped, want_dropped)
    assert (capacity_factor is None) == (not want_dropped) and all(d > 0 for d in want_dropped)


@pytest.mark.parametrize("strategy, sizes", EP_MESHES, ids=EP_IDS)
def test_expert_parallel_train_steps_match_one_device(strategy, sizes):
    """`make_train_step` traces on the state's mesh, so its step runs the experts split: two
    steps give one device's losses and parameters, and the experts' weights and their Adam
    moments stay split over `expert`."""
    params, batch, loss_fn, axes = _decoder_setup(MOE)
    want_state, want_losses = _one_device_steps(_decoder_setup, MOE)
    mesh = make_mesh(**sizes)
    check_mesh_fits(MOE, mesh)
    shapes = jax.eval_shape(lambda params: TrainState.create(params, OPTIMIZER), params)
    step = make_train_step(loss_fn, OPTIMIZER, tree_shardings(shapes, axes, mesh, strategy))
    assert "shard_map" in str(jax.make_jaxpr(step)(shapes, batch, jax.random.key(0)))  # the experts' path taken
    state, losses = _two_steps(params, batch, loss_fn, axes, mesh, strategy)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5), state.params,
                 want_state.params)
    _experts_split(state.params, mesh, sizes["expert"])
    _experts_split(state.opt_state[0].mu, mesh, sizes["expert"])
    for tree in (state.params, state.opt_state):
        for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(tree),
                                          jax.tree.leaves(tree_shardings(tree, axes, mesh, strategy))):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), jax.tree_util.keystr(path)


@pytest.mark.parametrize("strategy, sizes", [EP_MESHES[1], EP_MESHES[5]], ids=[EP_IDS[1], EP_IDS[5]])
def test_expert_parallel_rows_that_do_not_split_stay_whole(strategy, sizes):
    """3 rows (one prompt of 3 tokens) do not split over data x expert: every device keeps them
    whole and the experts' shares are summed by a psum; the logits and their gradients are one
    device's."""
    params, batch, _, axes = _decoder_setup(MOE)
    tokens = batch["tokens"][:1, :3]

    def program(params, tokens):
        return jax.value_and_grad(lambda p: jnp.sum(jnp.sin(Decoder(MOE).apply({"params": p}, tokens)[0])))(params)

    want = jax.jit(program)(params, tokens)
    mesh = make_mesh(**sizes)
    placed = jax.device_put(params, tree_shardings(params, axes, mesh, strategy))
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(program)(placed, tokens))
        got = jax.jit(program)(placed, tokens)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    # A gradient entry sums many terms, in another order on another mesh (tensor parallelism's
    # sums): float32's rounding of sums of the largest entry's size, against a wrong share (a
    # factor, a missing expert) of that size.
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want[1]))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-6 * scale, rtol=1e-5), got[1], want[1])


def test_generation_on_an_expert_mesh_matches_one_device():
    """Greedy generation with the experts split over `expert` (the layer run as on one device:
    no mesh in the context) and the cache's rows over data x expert: one device's tokens."""
    params = _sharp(_decoder_setup(MOE)[0])
    prompt = jax.random.randint(jax.random.key(4), (BATCH, 5), 0, MOE.vocab_size)
    want = generate(Decoder(MOE), params, prompt, max_new_tokens=12)
    mesh = make_mesh(data=2, expert=4)
    placed = jax.device_put(params, tree_shardings(params, param_axes(Decoder(MOE)), mesh, "fsdp"))
    got = generate(Decoder(MOE), placed, jax.device_put(prompt, batch_sharding(mesh)), max_new_tokens=12)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(np.asarray(want[:, 5:]))) > 5
    request = DecodeRequest.create(Decoder(MOE), prompt, max_new_tokens=4)
    cache = start(Decoder(MOE), placed, request, mesh).cache
    assert cache.layers[0].k.sharding.is_equivalent_to(
        NamedSharding(mesh, PartitionSpec(("data", "expert"), None, None, None)), 4)




def _cache_specs(config: DecoderConfig, data: int, model: int) -> list:
    """The specs `cache_shardings` must give each cache array: rows over `data`; a slot's kv heads, and a
    state's value heads with its conv inputs' channels, over `model` where they divide it (a latent slot's
    one "head": rows only)."""
    P, rows = PartitionSpec, "data" if data > 1 else None
    if config is LATENT:  # each layer's latent [batch, slots, 1, r] and rope key [batch, slots, 1, rope]
        return [P(rows, None, "model" if model == 1 else None, None)] * 2 * config.n_layer
    kv = "model" if 2 % model == 0 else None
    state = "model" if 4 % model == 0 else None  # 4 value heads; 2 * 2 * 8 + 4 * 8 = 64 conv channels
    return [P(rows, None, state), P(rows, state, None, None)] * 3 + [P(rows, None, kv, None)] * 2


def _two_steps_params(config, axes, params, batch):
    """`_two_steps`' parameters on one device, traceable (no losses read out): for `in_float64`."""
    model = Decoder(config.replace(dtype=params["embed"].dtype, param_dtype=params["embed"].dtype))

    def loss_fn(params, batch, dropout_key):
        logits, _ = model.apply({"params": params}, batch["tokens"])
        return label_smoothed_cross_entropy(logits, batch["targets"], 0.0), {}

    state, step = TrainState.create(params, OPTIMIZER), make_train_step(loss_fn, OPTIMIZER)
    for i in range(2):
        state, _ = step(state, batch, jax.random.key(10 + i))
    return state.params


@pytest.mark.parametrize("config", NEW_KINDS, ids=["hybrid", "latent"])
@pytest.mark.parametrize("strategy, data, model", NEW_MESHES, ids=[f"{s}-{d}x{m}" for s, d, m in NEW_MESHES])
def test_the_new_mixers_train_and_generate_on_a_mesh_as_on_one_device(config, strategy, data, model):
    """A train step (each new weight's logical axes split by `RULES`) and greedy generation on the mesh give
    one device's; the cache's arrays lie where `cache_shardings` says and stay there through the steps."""
    params, batch, loss_fn, axes = _decoder_setup(config)
    want_state, want_losses = _one_device_steps(_decoder_setup, config)
    mesh = make_mesh(data=data, model=model)
    state, losses = _two_steps(params, batch, loss_fn, axes, mesh, strategy)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    # The mesh sums the gradients in another order; Adam turns each component's float noise into
    # an update of up to lr * noise / eps. Held to the suite's error model (`REORDERED`): within
    # REORDERED times the one-device steps' own rounding, measured against their float64 twin.
    want64 = in_float64(functools.partial(_two_steps_params, config, axes), params, batch)
    for got, want, wide in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_state.params),
                               jax.tree.leaves(want64), strict=True):
        bound = 2 * REORDERED * float(np.abs(np.asarray(want, np.float64) - wide).max())
        assert bound <= 1e-3, bound  # float32's rounding: a tenth of one Adam step's move (lr 1e-2), not another result
        np.testing.assert_allclose(got, want, rtol=0, atol=bound)

    decoder, params = Decoder(config), _sharp(params)
    prompt = jax.random.randint(jax.random.key(4), (BATCH, 5), 0, config.vocab_size)
    want = generate(decoder, params, prompt, max_new_tokens=12)
    placed = jax.device_put(params, tree_shardings(params, axes, mesh, strategy))
    got = generate(decoder, placed, jax.device_put(prompt, batch_sharding(mesh)), max_new_tokens=12)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(np.asarray(want[:, 5:]))) > 5
    request = DecodeRequest.create(decoder, prompt, max_new_tokens=4)
    state = start(decoder, placed, request, mesh)
    for _ in range(2):
        arrays = jax.tree.leaves(state.cache.layers)
        specs = _cache_specs(config, data, model)
        assert len(arrays) == len(specs)
        for array, spec in zip(arrays, specs):
            assert array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim), (array.shape, spec,
                                                                                           array.sharding)
        state, _, _ = advance(decoder, placed, request, state)


@pytest.mark.parametrize("data, model, conv", [(2, 4, PartitionSpec("data", None, "model")),
                                               (1, 8, PartitionSpec(None, None, None))])
def test_a_hybrids_cache_after_the_prefill_lies_where_cache_shardings_says(data, model, conv):
    """The prefill's cache, every array of it, where `cache_shardings` says: a Gated DeltaNet layer's conv inputs
    `[rows, 3, 64 channels]` over `model` by their channels where its 4 value heads split (2 x 4), whole where they
    do not (1 x 8, though 64 channels would split 8 ways: the layer runs whole there)."""
    decoder, params = Decoder(HYBRID), _decoder_setup(HYBRID)[0]
    mesh = make_mesh(data=data, model=model)
    placed = jax.device_put(params, tree_shardings(params, param_axes(decoder), mesh, "dp"))
    prompt = jax.random.randint(jax.random.key(4), (BATCH, 5), 0, HYBRID.vocab_size)
    cache = start(decoder, placed, DecodeRequest.create(decoder, prompt, max_new_tokens=4), mesh).cache
    for array, sharding in zip(jax.tree.leaves(cache), jax.tree.leaves(cache_shardings(cache, mesh))):
        assert array.sharding.is_equivalent_to(sharding, array.ndim), (array.shape, array.sharding, sharding)
    assert cache.layers[0].conv.sharding.is_equivalent_to(NamedSharding(mesh, conv), 3), cache.layers[0].conv.sharding


@pytest.mark.parametrize("method", ["dpo", "grpo"])
def test_dpo_and_grpo_on_a_mesh_have_one_devices_steps(tmp_path, method):
    """`jaxformer-finetune --method dpo|grpo`, LoRA and full, on a 4 x 2 mesh (FSDP too): the
    losses of one device, and GRPO's completions (their rewards and lengths) the same: the engine
    samples with the split weights as with whole ones."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
    from checkpoints import save_random_checkpoint

    from jaxformer.commands import finetune
    from jaxformer.training import read_metrics

    save_random_checkpoint(tmp_path / "checkpoint")
    data = tmp_path / "data.jsonl"
    if method == "dpo":
        records = [{"prompt": f"The {w} sat on the", "chosen": " mat.", "rejected": f" {w}."}
                   for w in ("cat", "dog", "sun", "sky", "log") * 4]
        extra = ["--batch-size", "4"]
    else:
        records = [{"prompt": f"The {w} sat on the"} for w in ("cat", "dog", "sun", "sky", "log") * 4]
        extra = ["--batch-size", "4", "--num-generations", "4", "--max-completion-length", "6", "--reward", "regex",
                 "--reward-pattern", ".*a.*", "--beta", "0.04", "--iterations", "2"]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    flags = ["--checkpoint", str(tmp_path / "checkpoint"), "--data", str(data), "--method", method, "--steps", "4",
             "--lr", "3e-3", "--seq-len", "24", "--lora-rank", "4", "--warmup", "2", "--log-every", "1",
             "--checkpoint-every", "4", *extra]
    logged = ["loss"] if method == "dpo" else ["loss", "kl"]
    for full in ([], ["--full"]):
        runs = {}
        for name, mesh in (("one", []), ("dp", ["--mesh", "data=4,model=2"]), ("fsdp", ["--mesh", "data=4,model=2",
                                                                                        "--fsdp"])):
            assert finetune.main([*flags, *full, *mesh, "--run-dir", str(tmp_path / f"{name}{full}")]) == 0
            runs[name] = read_metrics(tmp_path / f"{name}{full}" / "metrics.jsonl")
        for name in ("dp", "fsdp"):
            for key in logged:
                np.testing.assert_allclose([m[key] for m in runs[name]], [m[key] for m in runs["one"]], rtol=1e-5,
                                           atol=1e-7)
            if method == "grpo":  # the same completions sampled
                assert [(m["reward"], m["completion_length"]) for m in runs[name]] == \
                       [(m["reward"], m["completion_length"]) for m in runs["one"]]
