"""The experts' layer: each routing rule and the layer whole against transformers' own modules,
the grouped product against a per-expert loop, the load-balancing loss against transformers'."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import DecoderConfig
from jaxformer.experts import ROUTER_COLLECTION, Experts, ExpertsSpec, load_balancing_loss, route
from jaxformer.grouped import KERNEL_PRODUCTS, PRODUCTS, block_size, dispatch, grouped_product
from jaxformer.sharding import make_mesh
from tests.conftest import import_peer

D, E, F, SHARED = 16, 8, 12, 20  # d_model, experts, expert width, shared expert width
CONFIG = DecoderConfig(vocab_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=D, max_seq_len=32)
# The products in jnp (the Pallas kernels' are tests/kernels/test_grouped_matmul.py's, interpreted, at the blocks
# they take).
JNP_PRODUCTS = sorted(set(PRODUCTS) - set(KERNEL_PRODUCTS))


def per_expert_loop(x, w, ids):
    """`[N, k, F]`: every (token, choice) pair's product, one expert at a time (the slow path)."""
    out = np.zeros((*ids.shape, w.shape[-1]), np.float64)
    for e in range(w.shape[0]):
        token, choice = np.nonzero(np.asarray(ids) == e)
        out[token, choice] = np.asarray(x, np.float64)[token] @ np.asarray(w[e], np.float64)
    return out


@pytest.mark.parametrize("how", JNP_PRODUCTS)
@pytest.mark.parametrize("block", [1, 4, 16])
def test_grouped_product_equals_a_loop_over_experts(how, block):
    k = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(k[0], (37, 8)), jax.random.normal(k[1], (5, 8, 6))
    ids = jax.random.randint(k[2], (37, 3), 0, 5).at[:, 0].set(4)  # expert 4 crowded, others fewer
    np.testing.assert_allclose(grouped_product(x, w, ids, block=block, how=how), per_expert_loop(x, w, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", JNP_PRODUCTS)
def test_grouped_product_gradients_equal_the_dense_formula(how):
    # The gradient of the blocked product is written by hand (its weight gradient adds each block
    # into its expert's rows): against autodiff of `x[n] @ w[ids[n, c]]` built per pair.
    k = jax.random.split(jax.random.key(1), 4)
    x, w = jax.random.normal(k[0], (29, 8)), jax.random.normal(k[1], (5, 8, 6))
    ids = jax.random.randint(k[2], (29, 2), 0, 4)  # expert 4 chosen by nobody: a zero gradient
    cotangent = jax.random.normal(k[3], (29, 2, 6))

    def loss(f, x, w):
        return jnp.sum(f(x, w) * cotangent)

    got = jax.grad(functools.partial(loss, lambda x, w: grouped_product(x, w, ids, block=4, how=how)),
                   argnums=(0, 1))(x, w)
    want = jax.grad(functools.partial(loss, lambda x, w: jnp.einsum("nd,nkdf->nkf", x, w[ids])), argnums=(0, 1))(x, w)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)
    assert not np.any(got[1][4])


def test_capacity_drops_the_pairs_past_it_in_token_order():
    x, w = jnp.arange(6.0)[:, None] + 1, jnp.ones((2, 1, 1))
    ids = jnp.array([[0], [0], [0], [1], [0], [1]])  # expert 0 chosen 4 times, expert 1 twice
    got = grouped_product(x, w, ids, capacity=3)[:, 0, 0]
    np.testing.assert_array_equal(got, [1, 2, 3, 4, 0, 6])  # token 4, expert 0's fourth, dropped


@pytest.mark.parametrize("how", JNP_PRODUCTS)
def test_an_id_past_the_experts_is_a_pair_not_run_nor_dropped(how):
    # Expert parallelism's pairs of another device's experts: no row, zeros, not counted as dropped.
    x, w = jnp.arange(6.0)[:, None] + 1, jnp.ones((2, 1, 1))
    ids = jnp.array([[0], [2], [0], [1], [2], [1]])  # experts 0 and 1 here; 2 elsewhere
    np.testing.assert_array_equal(grouped_product(x, w, ids, block=2, how=how)[:, 0, 0], [1, 0, 3, 4, 0, 6])
    np.testing.assert_array_equal(grouped_product(x, w, ids, capacity=1, how=how)[:, 0, 0], [1, 0, 0, 4, 0, 0])
    assert dispatch(ids, 2, 1, capacity=1).dropped == 2  # tokens 2 and 5, past expert 0's and 1's one row
    layout = dispatch(ids, 2, 2)  # 2 pairs in each expert's block of 2, the other 2 past the end
    assert sorted(np.asarray(layout.dest).tolist()) == [0, 1, 2, 3, layout.rows, layout.rows]


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_expert_parallel_on_a_one_device_mesh_is_the_plain_layer(capacity_factor):
    """With a mesh of one device as the context's, its `expert` axis 1, the layer takes the
    expert-parallel path (`expert_parallel`: a shard_map that gathers the tokens, runs its
    experts' pairs and sums the shares back) and gives the plain path's outputs, drops and
    gradients. (On 8 devices: tests/sharding/eight_devices.py.)"""
    spec = ExpertsSpec(E, 3, F, capacity_factor=capacity_factor, expert_bias=True)
    x = jax.random.normal(jax.random.key(5), (2, 5, D))
    model = Experts(CONFIG, spec)
    params = jax.tree.map(lambda w: w + 0.05, model.init(jax.random.key(0), x)["params"])  # biases not zero

    def run(params, x):
        def loss(params, x):
            y, sown = model.apply({"params": params}, x, mutable=[ROUTER_COLLECTION])
            return jnp.sum(jnp.sin(y)), (y, sown[ROUTER_COLLECTION].get("dropped"))
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    mesh = make_mesh(devices=jax.devices()[:1])
    assert mesh.shape == {"data": 1, "expert": 1, "model": 1}
    assert "shard_map" not in str(jax.make_jaxpr(run)(params, x))
    want = jax.jit(run)(params, x)
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(run)(params, x))
        got = jax.jit(run)(params, x)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), got, want)
    assert (capacity_factor is None) == (want[0][1][1] is None)


def test_block_size_follows_the_rows_per_expert():
    assert [block_size(rows, 64) for rows in (8, 64, 512, 4096, 10 ** 6)] == [1, 1, 8, 64, 128]


def test_a_decoding_step_unrolls_its_blocks_and_a_prompt_loops_over_them():
    """On a CPU the layer's loop over its blocks is unrolled for one position a row (a decoding step) and
    left a loop for more (a prompt, a training batch): read from the scans of the layer's program."""
    spec = ExpertsSpec(E, 3, F)
    model = Experts(CONFIG, spec)
    params = model.init(jax.random.key(0), jnp.zeros((1, 1, D)))["params"]

    def unrolls(x):  # the `unroll` of each scan in the layer's program (its three products' loops over the blocks)
        return re.findall(r"unroll=(\w+)", str(jax.make_jaxpr(lambda p, x: model.apply({"params": p}, x))(params, x)))

    blocks = 4 * spec.top_k  # 4 tokens' 12 pairs over 8 experts: blocks of one row (`block_size`)
    assert sorted(unrolls(jnp.ones((4, 1, D))), key=int)[-3:] == [str(blocks)] * 3  # each loop unrolled whole
    assert set(unrolls(jnp.ones((1, 4, D)))) == {"1"}

# Each family's MoE block in transformers, its config's fields and our spec of the same layer.
PEERS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock", dict(moe_intermediate_size=F, num_experts=E,
                                                                   norm_topk_prob=True),
                  ExpertsSpec(E, 3, F, normalize=True)),
    "olmoe": ("OlmoeConfig", "OlmoeSparseMoeBlock", dict(intermediate_size=F, num_experts=E, norm_topk_prob=False),
              ExpertsSpec(E, 3, F, normalize=False)),
    "mixtral": ("MixtralConfig", "MixtralSparseMoeBlock", dict(intermediate_size=F, num_local_experts=E),
                ExpertsSpec(E, 3, F, normalize=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock",
                  dict(moe_intermediate_size=F, num_experts=E, shared_expert_intermediate_size=SHARED,
                       norm_topk_prob=False),
                  ExpertsSpec(E, 3, F, normalize=False, shared_width=SHARED, shared_gate=True)),
    "gpt_oss": ("GptOssConfig", "GptOssMLP", dict(intermediate_size=F, num_local_experts=E, swiglu_limit=1.5),
                ExpertsSpec(E, 3, F, activation="clamped_swiglu", routing="topk_softmax", router_bias=True,
                            expert_bias=True, swiglu_limit=1.5, swiglu_alpha=1.702)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3MoE",
                    dict(moe_intermediate_size=F, n_routed_experts=E, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True),
                    ExpertsSpec(E, 3, F, routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scale=2.5,
                                shared_width=F)),
}


def torch_block(name: str, seed: int = 0):
    """transformers' MoE block of family `name`, float32, its parameters drawn at random (the
    correction bias too), in eval mode."""
    torch, transformers = import_peer("torch"), import_peer("transformers")
    config_class, block_class, fields, _ = PEERS[name]
    config = getattr(transformers, config_class)(hidden_size=D, num_experts_per_tok=3, hidden_act="silu", **fields)
    module = getattr(transformers.models, name, None) or getattr(transformers.models, name.replace("_", ""))
    block = getattr(getattr(module, f"modeling_{name}"), block_class)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*block.parameters(), *block.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    return block


def our_params(block) -> dict:
    """The block's parameters as `Experts`' tree."""
    t = {key: value.detach().numpy() for key, value in block.state_dict().items()}
    router = "router" if "router.weight" in t else "gate"
    params = {"router": t[f"{router}.weight"].T}
    if "router.bias" in t:
        params["router_bias"] = t["router.bias"]
    if "gate.e_score_correction_bias" in t:
        params["correction_bias"] = t["gate.e_score_correction_bias"]
    gate_up, down = t["experts.gate_up_proj"], t["experts.down_proj"]
    if "experts.gate_up_proj_bias" in t:  # gpt-oss: [E, d, 2F], gate at even columns, up at odd
        params.update(w_gate=gate_up[..., ::2], w_up=gate_up[..., 1::2], w_down=down,
                      b_gate=t["experts.gate_up_proj_bias"][:, ::2], b_up=t["experts.gate_up_proj_bias"][:, 1::2],
                      b_down=t["experts.down_proj_bias"])
    else:  # [E, 2F, d] (out, in), gate's rows first; down [E, d, F]
        params.update(w_gate=gate_up[:, :F].transpose(0, 2, 1), w_up=gate_up[:, F:].transpose(0, 2, 1),
                      w_down=down.transpose(0, 2, 1))
    shared = next((p for p in ("shared_expert", "shared_experts") if f"{p}.gate_proj.weight" in t), None)
    if shared:
        params["shared"] = {w: t[f"{shared}.{p}_proj.weight"].T for w, p in
                            (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down"))}
    if "shared_expert_gate.weight" in t:
        params["shared_gate"] = t["shared_expert_gate.weight"].T
    return params


def torch_forward(block, x: np.ndarray) -> np.ndarray:
    torch = import_peer("torch")
    with torch.no_grad():
        out = block(torch.from_numpy(x))
    return (out[0] if isinstance(out, tuple) else out).numpy()


def ours(spec: ExpertsSpec, params: dict, x: np.ndarray, config: DecoderConfig = CONFIG) -> np.ndarray:
    return np.asarray(Experts(config, spec).apply({"params": params}, jnp.asarray(x)))


@pytest.mark.peers
@pytest.mark.parametrize("name", sorted(PEERS))
def test_the_layer_equals_transformers(name):
    block, spec = torch_block(name), PEERS[name][3]
    x = np.random.default_rng(0).normal(size=(2, 9, D)).astype(np.float32)
    want = torch_forward(block, x)
    np.testing.assert_allclose(ours(spec, our_params(block), x), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def tie(name: str) -> tuple[int, int]:
    """Two experts made to score alike: in one group of DeepSeek's (groups of two), apart elsewhere."""
    return (4, 5) if name == "deepseek_v3" else (1, 6)


def tied_params(name: str):
    """transformers' block and our parameters with experts `tie(name)` scoring alike for every
    token (equal router rows and biases)."""
    torch = import_peer("torch")
    block = torch_block(name, seed=1)
    low, high = tie(name)
    router = block.router if hasattr(block, "router") else block.gate
    with torch.no_grad():
        for tensor in (router.weight, getattr(router, "bias", None), getattr(router, "e_score_correction_bias", None)):
            if tensor is not None:
                tensor[high] = tensor[low]
    return block, router, our_params(block)


@pytest.mark.peers
@pytest.mark.parametrize("name", sorted(PEERS))
def test_ties_take_the_lower_index(name):
    # Equal scores resolve as jax.lax.top_k does: the lower index first. torch's topk on a CPU
    # follows no fixed rule (of 7 tied tokens, 4 took the higher index), so the layer is compared
    # with transformers on the tokens whose experts torch chose as we do, and the others are
    # checked to differ by the tie alone.
    torch = import_peer("torch")
    block, router, params = tied_params(name)
    spec, (low, high) = PEERS[name][3], tie(name)
    x = np.random.default_rng(1).normal(size=(3, 16, D)).astype(np.float32)
    tokens = x.reshape(-1, D)
    logits = jnp.asarray(tokens) @ params["router"] + params.get("router_bias", 0)
    ids = np.asarray(route(logits, spec, params.get("correction_bias"))[1])
    alone = (ids == low).any(-1) != (ids == high).any(-1)  # the tie split: one of the two taken
    assert alone.any(), "no token took one of the tied experts alone"
    assert not (ids == high).any(-1)[alone].any(), "a tie went to the higher index"
    with torch.no_grad():
        theirs = router(torch.from_numpy(tokens))[2].numpy()
    same = np.array([set(a) == set(b) for a, b in zip(ids, theirs)])
    swapped = np.where(theirs == high, low, theirs)  # torch's choice, the tie taken our way
    assert all(set(a) == set(b) for a, b in zip(ids[~same], swapped[~same])), "a choice differs by more than the tie"
    want = torch_forward(block, x).reshape(-1, D)
    got = ours(spec, params, x).reshape(-1, D)
    np.testing.assert_allclose(got[same], want[same], rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.peers
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_equals_transformers(masked):
    torch = import_peer("torch")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rng = np.random.default_rng(2)
    logits = [rng.normal(size=(3, 7, E)).astype(np.float32) * 2 for _ in range(4)]  # four layers
    mask = rng.random((3, 7)) < 0.7 if masked else None
    want = load_balancing_loss_func(tuple(torch.from_numpy(x.reshape(-1, E)) for x in logits), E, 3,
                                    None if mask is None else torch.from_numpy(mask.astype(np.int64)))
    got = load_balancing_loss([jnp.asarray(x) for x in logits], 3, None if mask is None else jnp.asarray(mask))
    np.testing.assert_allclose(got, want.item(), rtol=1e-6)


def test_load_balancing_loss_is_k_when_the_load_is_even():
    # Every expert chosen as often and given the same mean probability: f_e = k/E, P_e = 1/E.
    logits = jnp.log(jnp.array([[[4.0, 3, 2, 1], [1, 4, 3, 2], [2, 1, 4, 3], [3, 2, 1, 4]]]))
    np.testing.assert_allclose(load_balancing_loss([logits], 2), 2.0, rtol=1e-6)


def test_the_layer_sows_its_router_logits_and_its_drops():
    spec = ExpertsSpec(E, 3, F, capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(3), (2, 5, D))
    model = Experts(CONFIG, spec)
    params = model.init(jax.random.key(0), x)["params"]
    y, sown = model.apply({"params": params}, x, mutable=[ROUTER_COLLECTION])
    logits = sown[ROUTER_COLLECTION]["logits"][0]
    np.testing.assert_allclose(logits, np.einsum("btd,de->bte", x, params["router"]), rtol=1e-5, atol=1e-6)
    # capacity ceil(0.5 * 10 * 3 / 8) = 2 rows an expert: 16 of the 30 pairs at most, 14 or more dropped
    ids = np.asarray(route(logits.reshape(-1, E), spec)[1])
    dropped = sum(max(0, n - 2) for n in np.bincount(ids.ravel(), minlength=E))
    assert sown[ROUTER_COLLECTION]["dropped"][0] == dropped >= 14
    dropless = Experts(CONFIG, ExpertsSpec(E, 3, F)).apply({"params": params}, x)
    assert not np.allclose(y, dropless)


# Each feature's spec, and the spec or parameters without it: (spec, changed fields, changed parameters).
FEATURES = {
    "normalize": (ExpertsSpec(E, 3, F, normalize=True), dict(normalize=False), {}),
    "top_k": (ExpertsSpec(E, 3, F), dict(top_k=2), {}),
    "swiglu_limit": (ExpertsSpec(E, 3, F, activation="clamped_swiglu", routing="topk_softmax", swiglu_limit=0.3,
                                 swiglu_alpha=1.702), dict(swiglu_limit=30.0), {}),
    "shared_gate": (ExpertsSpec(E, 3, F, shared_width=SHARED, shared_gate=True), {},
                    dict(shared_gate=np.full((D, 1), 50.0, np.float32))),  # a sigmoid of ~1: ungated
    "routed_scale": (ExpertsSpec(E, 3, F, routing="sigmoid_grouped", n_group=4, topk_group=2, routed_scale=2.5),
                     dict(routed_scale=1.0), {}),
    "correction_bias": (ExpertsSpec(E, 3, F, routing="sigmoid_grouped", n_group=4, topk_group=2), {},
                        dict(correction_bias=np.linspace(-1, 1, E).astype(np.float32))),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_each_routing_feature_moves_the_output(feature):
    # A guard per feature: the layer without it gives other outputs, so a family that loses it on
    # the way through a config fails its comparison with transformers.
    spec, fields, changed = FEATURES[feature]
    x = jax.random.normal(jax.random.key(4), (2, 5, D))
    params = jax.tree.map(np.asarray, Experts(CONFIG, spec).init(jax.random.key(0), x)["params"])
    params = jax.tree.map(lambda w: w * 50, params)  # pre-activations of a few units, outputs of ~1
    without = ours(dataclasses.replace(spec, **fields), {**params, **changed}, x)
    assert np.abs(ours(spec, params, x) - without).max() > 1e-2


def test_expert_load_counts_each_layers_own_routing_in_model_order():
    """`decoder.expert_load`: each layer of experts' pairs per expert, by its own rule (here the
    grouped sigmoid, whose correction bias, a parameter of each layer, shifts the choice), over the
    tokens a mask keeps: what `route` chooses from the logits that layer sows, counted here one layer
    at a time. The same counts from the scanned model, whose layers of experts are row 0 and row 1
    of one stack."""
    from jaxformer import Decoder
    from jaxformer.convert import with_scan_layers
    from jaxformer.decoder import expert_load
    from jaxformer.layers import layer_specs

    spec = ExpertsSpec(E, 3, F, routing="sigmoid_grouped", n_group=4, topk_group=2)
    config = CONFIG.replace(n_layer=4)
    config = config.replace(layers=tuple(dataclasses.replace(s, ffn=spec) if i % 2 == 0 else s
                                         for i, s in enumerate(layer_specs(config))))  # experts, dense, experts, dense
    tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, 32)
    mask = np.arange(7)[None, :] < np.array([[7], [2], [5]])  # ragged rows: the positions past each one's length out
    params = jax.jit(Decoder(config).init)(jax.random.key(0), tokens)["params"]
    for i in (0, 2):  # each layer its own bias, large enough to move the choice
        params[f"block_{i}"]["mlp"]["correction_bias"] = jax.random.normal(jax.random.key(10 + i), (E,))
    _, sown = jax.jit(functools.partial(Decoder(config).apply, mutable=[ROUTER_COLLECTION]))({"params": params}, tokens)
    want = {}
    for i in (0, 2):
        logits = sown[ROUTER_COLLECTION][f"block_{i}"]["mlp"]["logits"][0]  # [3, 7, E]
        ids = np.asarray(route(logits.reshape(-1, E), spec, params[f"block_{i}"]["mlp"]["correction_bias"])[1])
        want[i] = np.bincount(ids[mask.reshape(-1)].reshape(-1), minlength=E)
        unbiased = np.asarray(route(logits.reshape(-1, E), spec, jnp.zeros(E))[1])
        assert not np.array_equal(np.bincount(unbiased[mask.reshape(-1)].reshape(-1), minlength=E), want[i])
    assert not np.array_equal(want[0], want[2])
    got = jax.jit(functools.partial(expert_load, Decoder(config)))({"params": params}, tokens, mask)
    assert sorted(got) == [0, 2] and all(np.array_equal(got[i], want[i]) for i in got)
    assert all(int(got[i].sum()) == 3 * mask.sum() for i in got)
    scanned, stacked = with_scan_layers(config, params, True)
    got = jax.jit(functools.partial(expert_load, Decoder(scanned)))({"params": stacked}, tokens, mask)
    assert sorted(got) == [0, 2] and all(np.array_equal(got[i], want[i]) for i in got)
    dense = jax.eval_shape(Decoder(CONFIG).init, jax.random.key(0), tokens)  # (traced: no compile)
    assert jax.eval_shape(functools.partial(expert_load, Decoder(CONFIG)), dense, tokens) == {}
