"""Scanned layers (`DecoderConfig.scan_layers`): the same model as one block per layer.

The scanned model's parameters are the per-layer ones stacked (`with_scan_layers`), so
every comparison below is between the two forms of one set of weights, and must agree
to float32 rounding: logits, cached decoding, ragged batches, sampling, beam search,
checkpoints in and out, transformers itself. What differs is the program: one block in a
loop, whatever the depth, with the stacked cache updated in place.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL, filled_layers, import_peer, init_params, random_params, torch_peer

from jaxformer import Decoder, KVCache, decoding, generate, stream
from jaxformer.convert import load_hf, save_hf, stack_layers, unstack_layers, with_rope_pairing, with_scan_layers
from jaxformer.decoder import sown_attention_weights
from jaxformer.experts import ExpertsSpec
from jaxformer.layers import layer_specs
from jaxformer.sharding import EMBED, LAYERS, MLP, make_mesh, param_axes, tree_shardings

CONFIGS = {
    "gqa-tied": SMALL,
    "mha-untied-bias": SMALL.replace(n_kv_head=4, tie_embeddings=False, qkv_bias=True),
    "mqa-interleaved": SMALL.replace(n_kv_head=1, rope_pairing="interleaved"),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    """(unrolled model, its params, scanned model, the same params stacked)."""
    config = CONFIGS[request.param]
    params = random_params(config, seed=1)
    scanned_config, stacked = with_scan_layers(config, params, True)
    return Decoder(config), params, Decoder(scanned_config), stacked


# One compiled program per (model, shapes) instead of hundreds of small eager ones.
forward = jax.jit(lambda model, params, tokens, cache=None: model.apply({"params": params}, tokens, cache),
                  static_argnums=0)


def _prompts(seed=0, batch=3, length=7):
    return np.random.RandomState(seed).randint(0, SMALL.vocab_size, (batch, length))


def test_scanned_parameters_are_the_blocks_stacked():
    config = SMALL.replace(scan_layers=True)
    params = init_params(config)
    assert set(params) == {"blocks", "embed", "final_norm"}
    shapes = jax.tree.map(lambda leaf: leaf.shape, params["blocks"])
    assert shapes["attn"]["wq"] == (SMALL.n_layer, SMALL.d_model, SMALL.n_head, SMALL.head_dim)
    assert shapes["mlp_norm"]["weight"] == (SMALL.n_layer, SMALL.d_model)
    # Each block draws its own init: stacking copies of one block would make them equal.
    wq = params["blocks"]["attn"]["wq"]
    assert not np.allclose(wq[0], wq[1])
    # (Shapes only, and not through conftest's init_params: it would cache the tracers.)
    unrolled = jax.eval_shape(lambda: Decoder(SMALL).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
    unrolled = unrolled["params"]
    assert jax.tree.map(lambda x: x.shape, unstack_layers(params, config)) == jax.tree.map(lambda x: x.shape, unrolled)


def test_stack_and_unstack_are_inverse():
    params = random_params(SMALL, seed=1)  # (any weights, the gqa-tied pair's: no init to compile)
    stacked = stack_layers(params, SMALL)
    for i in range(SMALL.n_layer):
        np.testing.assert_array_equal(stacked["blocks"]["mlp"]["w_up"][i], params[f"block_{i}"]["mlp"]["w_up"])
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(stacked, SMALL), params)
    assert with_scan_layers(SMALL, params, False) == (SMALL, params)
    with pytest.raises(ValueError, match="no block_3 to stack"):
        stack_layers(params, SMALL.replace(n_layer=4))
    with pytest.raises(ValueError, match=r"\['block_2'\] besides block_0 .. block_1: not a 2-layer model"):
        stack_layers(params, SMALL.replace(n_layer=2))
    with pytest.raises(ValueError, match="no 'blocks' subtree"):
        unstack_layers(params, SMALL)


def test_logits_equal_the_unrolled_model(pair):
    model, params, scanned, stacked = pair
    tokens = _prompts(length=12)
    want, _ = forward(model, params, tokens)
    got, _ = forward(scanned, stacked, tokens)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_cached_decoding_equals_the_unrolled_cache(pair):
    """Prefill then single steps through the stacked cache: the same logits, and each
    layer's slice of the stacked cache holds that layer's per-layer keys and values."""
    model, params, scanned, stacked = pair
    tokens = _prompts(length=10)
    caches = {"unrolled": KVCache.create(model.config, 3, 16), "scanned": KVCache.create(scanned.config, 3, 16)}
    logits = {name: [] for name in caches}
    for start, end in ((0, 6), (6, 7), (7, 10)):  # a prefill, one step, three more at once
        for name, (m, p) in (("unrolled", (model, params)), ("scanned", (scanned, stacked))):
            out, caches[name] = forward(m, p, tokens[:, start:end], caches[name])
            logits[name].append(out)
    np.testing.assert_allclose(np.concatenate(logits["scanned"], 1), np.concatenate(logits["unrolled"], 1),
                               atol=2e-5, rtol=1e-5)
    per_layer, stacked_cache = caches["unrolled"], caches["scanned"]
    assert stacked_cache.layers.k.shape == (3, SMALL.n_layer, 16, model.config.n_kv_head, SMALL.head_dim)
    assert stacked_cache.pos.tolist() == per_layer.pos.tolist() == [10] * 3  # one position per row
    for i, layer in enumerate(per_layer.layers):
        np.testing.assert_allclose(stacked_cache.layers.k[:, i], layer.k, atol=2e-5)
        np.testing.assert_allclose(stacked_cache.layers.v[:, i], layer.v, atol=2e-5)
    assert stacked_cache.bytes_per_token == per_layer.bytes_per_token
    assert (stacked_cache.n_layer, stacked_cache.capacity, stacked_cache.batch_size) == (SMALL.n_layer, 16, 3)


# Each config decodes one way (each pair compiles two loops): ragged greedy, ragged
# sampling with one seed, and beam search, which reorders the stacked cache's rows.
DECODING = {"mqa-interleaved": dict(), "mha-untied-bias": dict(temperature=0.8, top_k=20),
            "gqa-tied": dict(num_beams=3)}


def test_generate_gives_the_same_tokens(pair, request):
    model, params, scanned, stacked = pair
    options = DECODING[request.node.callspec.id]
    prompts = _prompts(seed=2, length=6)
    lengths = np.array([6, 3, 5])  # rows 1 and 2 left-padded
    kwargs = dict(max_new_tokens=9, prompt_lengths=lengths, key=jax.random.key(3), **options)
    np.testing.assert_array_equal(generate(scanned, stacked, prompts, **kwargs),
                                  generate(model, params, prompts, **kwargs))


def test_stream_gives_generate_tokens():
    config = SMALL.replace(scan_layers=True)
    # (Any weights: the gqa-tied pair's, stacked, whose eager programs the tests above made; no init to compile.)
    model, params = Decoder(config), stack_layers(random_params(SMALL, seed=1), config)
    prompt = _prompts(seed=5, batch=2, length=5)
    streamed = np.stack(list(stream(model, params, prompt, max_new_tokens=6)), axis=1)
    np.testing.assert_array_equal(streamed, generate(model, params, prompt, max_new_tokens=6)[:, 5:])


def test_a_cache_of_the_other_form_is_refused():
    scanned = Decoder(SMALL.replace(scan_layers=True))
    params = init_params(scanned.config)
    with pytest.raises(ValueError, match=r"cache does not fit this model: .* stacked .*scan_layers=True.*"
                                         r"got a per-layer cache"):
        scanned.apply({"params": params}, _prompts(), KVCache.create(SMALL, 3))
    with pytest.raises(ValueError, match=r"scan_layers=False.*got a stacked cache"):
        Decoder(SMALL).apply({"params": random_params(SMALL, seed=1)}, _prompts(), KVCache.create(scanned.config, 3))


def test_the_layer_axis_is_named_and_never_split():
    """`nn.scan` adds the LAYERS name in front of each block parameter's names; the
    sharding rules then split what they split in the unrolled model, never the layers."""
    config = SMALL.replace(scan_layers=True)
    axes = param_axes(Decoder(config))
    unrolled_axes = param_axes(Decoder(SMALL))
    for path, names in jax.tree_util.tree_flatten_with_path(axes["blocks"], is_leaf=lambda x: isinstance(x, tuple))[0]:
        block_names = jax.tree_util.tree_flatten_with_path(
            unrolled_axes["block_0"], is_leaf=lambda x: isinstance(x, tuple))[0]
        assert names == (LAYERS, *dict(block_names)[path])
    assert axes["blocks"]["mlp"]["w_up"] == (LAYERS, EMBED, MLP)
    params = init_params(config)
    mesh = make_mesh(devices=jax.devices()[:1])
    shardings = tree_shardings(params, axes, mesh, "fsdp")
    assert shardings["blocks"]["mlp"]["w_up"].spec[0] is None


def test_hf_checkpoints_load_and_save_in_either_form(tmp_path):
    config = SMALL.replace(tie_embeddings=False, rope_pairing="interleaved")
    params = random_params(config, seed=6)
    scanned_config, stacked = with_scan_layers(config, params, True)
    save_hf(scanned_config, stacked, str(tmp_path))  # saved per layer, split-half pairing
    loaded_config, loaded = load_hf(str(tmp_path), scan_layers=True)
    assert loaded_config.scan_layers and set(loaded) == {"blocks", "embed", "final_norm", "lm_head"}
    _, expected = with_rope_pairing(scanned_config, stacked, "split_half")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=0), loaded, expected)
    unrolled_config, unrolled = load_hf(str(tmp_path))
    tokens = _prompts(length=9)
    np.testing.assert_allclose(forward(Decoder(loaded_config), loaded, tokens)[0],
                               forward(Decoder(unrolled_config), unrolled, tokens)[0], atol=2e-5)


@pytest.mark.peers
def test_scanned_model_matches_transformers(tmp_path):
    torch = torch_peer()
    transformers = import_peer("transformers")
    hf_config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.copy_(1 + 0.5 * torch.randn_like(p) if name.endswith("norm.weight") else 0.25 * torch.randn_like(p))
    hf_model.save_pretrained(tmp_path)
    config, params = load_hf(str(tmp_path), scan_layers=True)
    tokens = np.random.RandomState(7).randint(0, 96, (2, 11))
    with torch.no_grad():
        want = hf_model(torch.tensor(tokens)).logits.numpy()
    got, _ = forward(Decoder(config), params, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    prompt = tokens[:, :4]
    with torch.no_grad():
        hf_tokens = hf_model.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False).numpy()
    np.testing.assert_array_equal(generate(Decoder(config), params, prompt, max_new_tokens=8), hf_tokens)


def _decode_step_hlo(n_layer: int) -> str:
    """The optimised program of one donated decode step of a scanned model."""
    config = SMALL.replace(n_layer=n_layer, scan_layers=True)
    model = Decoder(config)
    # (Not conftest's init_params: it caches what it returns, and here that would be tracers.)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    cache = jax.eval_shape(lambda: KVCache.create(config, 2, 32))
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c), donate_argnums=2)
    return step.lower(params, jax.ShapeDtypeStruct((2, 1), jnp.int32), cache).compile().as_text()


def test_the_program_does_not_grow_with_depth_and_writes_the_cache_in_place():
    """One block in a loop: 2 and 6 layers compile to the same program but for the
    sizes. The stacked cache is the loop's carry: no instruction copies all of it (a
    scanned-over cache would be rebuilt, a copy of every layer, at every step), and the
    output cache reuses the donated input buffer."""
    small, deep = _decode_step_hlo(2), _decode_step_hlo(6)
    # The depth (2, 6) and the last layer's index (1, 5: the bound of the per-row cache write's
    # layer index) are the sizes that differ.
    # (And each instruction's metadata, its source location, is left out: the ids of its stack
    # frames depend on what the process traced before, not on the program.)
    def sizes_out(line: str) -> str:
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        return re.sub(r"\b[15]\b", "L-1", re.sub(r"\b[26]\b", "L", line))
    assert len(small.splitlines()) == len(deep.splitlines())
    assert [sizes_out(line) for line in small.splitlines() if "while" in line] == \
        [sizes_out(line) for line in deep.splitlines() if "while" in line]
    whole_cache = f"f32[2,6,32,{SMALL.n_kv_head},{SMALL.head_dim}]"
    copies = [line for line in deep.splitlines() if whole_cache in line and re.search(r"\bcopy(-start)?\(", line)]
    assert copies == []
    assert "input_output_alias" in deep


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="how XLA:CPU slices a bfloat16 array")
def test_a_scanned_bfloat16_prefill_holds_no_copy_of_the_stacked_weights():
    """`jaxformer-generate --scan-layers`'s prefill (`start`) with bf16 weights, the layers'
    attention and experts stacked: each turn of the loop over the layers slices its layer out
    of the stacked weights, which XLA:CPU does through a float32 copy of the whole stack.
    Lifted out of the loop, that copy held every stacked weight at twice its bytes (OLMoE-1B-7B
    ran out of memory); kept in it (`NO_LOOP_HOISTING`), only the layer's slice is copied.
    XLA's temporary memory stays below the stack's own bf16 bytes (it was 2.25x them)."""
    config = SMALL.replace(n_layer=4, dtype="bfloat16", param_dtype="bfloat16", scan_layers=True)
    config = config.replace(layers=tuple(dataclasses.replace(spec, ffn=ExpertsSpec(4, 1, 64))
                                         for spec in layer_specs(config)))
    model = Decoder(config)
    # (Shapes only, and not through conftest's init_params: it would cache the tracers.)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))["params"]
    stacked = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params["blocks"]))
    request = decoding.DecodeRequest.create(model, np.ones((1, 1), np.int32), max_new_tokens=2)
    memory = decoding.start.lower(model, params, request).compile().memory_analysis()
    assert memory.temp_size_in_bytes < stacked, (memory.temp_size_in_bytes, stacked)


def test_remat_in_a_scan_recomputes_the_same_gradients():
    """`DecoderConfig.remat` wraps the scanned block too: the same loss, the same gradients."""
    from jaxformer import DecoderConfig, label_smoothed_cross_entropy

    config = DecoderConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=32,
                           scan_layers=True)
    params = stack_layers(random_params(config.replace(scan_layers=False), seed=0), config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)))

    def loss(params, remat):
        logits, _ = Decoder(config.replace(remat=remat)).apply({"params": params}, tokens[:, :-1])
        return label_smoothed_cross_entropy(logits, tokens[:, 1:], 0.0)

    kept, recomputed = (jax.value_and_grad(loss)(params, remat) for remat in (False, True))
    assert float(kept[0]) == float(recomputed[0])
    for x, y in zip(jax.tree.leaves(kept[1]), jax.tree.leaves(recomputed[1])):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


# Layers whose parameters differ in shape, from filled specs: each run of repeated specs one scan.
BLOCK = ["attn", "attn_norm", "mlp", "mlp_norm"]  # a segment of one body holds a block's parameters
SEGMENTED = {
    # dense then wider: two segments of one body, `blocks` and `blocks_1`
    "widths": (filled_layers(SMALL.replace(n_layer=4), widths=[32, 32, 96, 96]), {"blocks": BLOCK, "blocks_1": BLOCK}),
    # a period of two bodies, the first full or sliding (its flag picks), three times, then a sliding tail
    "periodic": (filled_layers(SMALL.replace(n_layer=7), widths=[32, 96] * 3 + [32],
                               windows=[None, None, 5, None, None, None, 5]),
                 {"blocks": ["block_0", "block_1"], "blocks_1": BLOCK}),
}


@pytest.mark.parametrize("name", sorted(SEGMENTED))
def test_segments_of_differing_layers_compute_the_unrolled_model(name):
    """Logits, sown attention weights, cached decoding (a prefill, then steps; with rings in two
    stacks for "periodic") and greedy tokens of the scanned form equal the unrolled model's."""
    config, names = SEGMENTED[name]
    params = random_params(config, seed=8)
    scanned_config, stacked = with_scan_layers(config, params, True)
    assert {k: sorted(v) for k, v in stacked.items() if k.startswith("blocks")} == names
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(stacked, scanned_config), params)
    model, scanned = Decoder(config), Decoder(scanned_config)
    axes = param_axes(scanned)  # each segment's leading axis is the layers'
    assert {names[0] for k in names for names in jax.tree.leaves(axes[k], is_leaf=lambda x: isinstance(x, tuple))} \
        == {LAYERS}
    tokens = _prompts(length=10)
    sown = jax.jit(lambda model, params: model.apply({"params": params}, tokens, mutable=["intermediates"]),
                   static_argnums=0)
    (want, _), want_sown = sown(model, params)
    (got, _), got_sown = sown(scanned, stacked)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(sown_attention_weights(got_sown, scanned_config),
                               sown_attention_weights(want_sown, config), atol=2e-6)
    caches = {"unrolled": KVCache.create(config, 3, 16), "scanned": KVCache.create(scanned_config, 3, 16)}
    for start, end in ((0, 6), *((t, t + 1) for t in range(6, 10))):  # a prefill, then steps: two programs a model
        want, caches["unrolled"] = forward(model, params, tokens[:, start:end], caches["unrolled"])
        got, caches["scanned"] = forward(scanned, stacked, tokens[:, start:end], caches["scanned"])
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # Greedy: the scanned form's `generate` against the unrolled model's argmax through the steps above (their
    # programs: the batch, the capacity, a prefill of 6 and single steps).
    prompt = _prompts(seed=2, length=6)
    logits, cache = forward(model, params, prompt, KVCache.create(config, 3, 16))
    want = [np.argmax(logits[:, -1], -1)]
    for _ in range(4):
        logits, cache = forward(model, params, want[-1][:, None], cache)
        want.append(np.argmax(logits[:, -1], -1))
    np.testing.assert_array_equal(generate(scanned, stacked, prompt, max_new_tokens=5)[:, 6:], np.stack(want, 1))
