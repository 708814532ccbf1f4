import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    SMALL,
    assert_reordered_equal,
    count_compiles,
    float64_config,
    in_float64,
    init_params,
    jit_apply,
    numpy_decoder_logits,
    random_params,
)
from jax.flatten_util import ravel_pytree

from jaxformer import Decoder, DecoderConfig, KVCache, label_smoothed_cross_entropy
from jaxformer.config import LoraConfig
from jaxformer.convert import with_scan_layers
from jaxformer.decoder import sown_attention_weights
from jaxformer.lora import LORA_COLLECTION, init_lora
from jaxformer.losses import chunked_cross_entropy


def _tokens(seed, shape, vocab=SMALL.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab)


def _init_shapes(config: DecoderConfig):
    """The shapes and dtypes of `config`'s initialised parameters, traced, not compiled: for a
    check of shapes or dtypes alone (an init compiles in seconds)."""
    return jax.eval_shape(Decoder(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]


class DecoderVariantsTest(chex.TestCase):
    """The forward and the cached step, traced and untraced."""

    def setUp(self):
        super().setUp()
        self.model = Decoder(SMALL)
        self.params = init_params(SMALL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_shapes_and_causality(self):
        forward = self.variant(lambda tokens: self.model.apply({"params": self.params}, tokens)[0])
        tokens = _tokens(0, (2, 16))
        logits = forward(tokens)
        chex.assert_shape(logits, (2, 16, SMALL.vocab_size))
        chex.assert_tree_all_finite(logits)
        changed = forward(tokens.at[:, 9].set((tokens[:, 9] + 1) % SMALL.vocab_size))
        assert float(jnp.abs(logits[:, :9] - changed[:, :9]).max()) == 0.0
        assert float(jnp.abs(logits[:, 9:] - changed[:, 9:]).max()) > 1e-4

    @chex.variants(with_jit=True, without_jit=True)
    def test_prefill_then_steps_equals_full_forward(self):
        step = self.variant(lambda tokens, cache: self.model.apply({"params": self.params}, tokens, cache))
        # (A prefill of 16 tokens, as the forward test's: untraced, its operations reuse that test's programs.)
        tokens = _tokens(1, (2, 23))
        full, none = jit_apply(self.model, {"params": self.params}, tokens)
        assert none is None
        cache = KVCache.create(SMALL, batch_size=2)
        logits, cache = step(tokens[:, :16], cache)
        pieces = [logits]
        for t in range(16, 23):
            logits, cache = step(tokens[:, t:t + 1], cache)
            chex.assert_shape(logits, (2, 1, SMALL.vocab_size))
            pieces.append(logits)
        chex.assert_tree_shape_prefix(cache.layers, (2, SMALL.max_seq_len, SMALL.n_kv_head, SMALL.head_dim))
        np.testing.assert_array_equal(cache.pos, [23, 23])
        assert float(jnp.abs(full - jnp.concatenate(pieces, axis=1)).max()) < 1e-5


def test_one_compiled_step_serves_every_position(small):
    config, model, params = small
    step = functools.partial(jit_apply, model, {"params": params})
    cache = KVCache.create(config, batch_size=2, capacity=16)
    _, cache = step(jnp.ones((2, 4), jnp.int32), cache)  # prefill compiles once
    _, cache = step(jnp.ones((2, 1), jnp.int32), cache)  # the one-token step compiles once
    token = jnp.ones((2, 1), jnp.int32)
    with count_compiles() as compiles:
        for _ in range(8):  # positions 5 .. 12: same shapes, traced pos
            _, cache = step(token, cache)
    assert compiles == [] and cache.pos.tolist() == [13, 13]


def test_rows_at_their_own_positions_match_their_own_forwards():
    """A right-padded prefill, each row's `pos` set back to its length: in one batched
    step each row reads and writes at its own position, as its own uncached forward."""
    config = SMALL
    model = Decoder(config)
    params = random_params(config, seed=4)
    short = _tokens(7, (1, 6))
    full = _tokens(8, (1, 10))
    padded = jnp.concatenate([short, jnp.full((1, 4), 13)], axis=1)  # 4 slots of padding, any id
    cache = KVCache.create(config, batch_size=2, capacity=12)
    step = functools.partial(jit_apply, model, {"params": params})
    logits, cache = step(jnp.concatenate([padded, full], axis=0), cache)  # one prefill for both rows
    cache = cache.replace(pos=jnp.array([6, 10], jnp.int32))
    nxt = jnp.array([[5, 2], [9, 3]])
    last, cache = step(nxt, cache)
    want_short, _ = jit_apply(model, {"params": params}, jnp.concatenate([short, nxt[:1]], axis=1))
    want_full, _ = jit_apply(model, {"params": params}, jnp.concatenate([full, nxt[1:]], axis=1))
    np.testing.assert_allclose(logits[0, :6], want_short[0, :6], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(last[0], want_short[0, 6:], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[1], want_full[0, :10], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(last[1], want_full[0, 10:], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(cache.pos, [8, 12])


def test_chunked_prefill_equals_full_forward(small):
    config, model, params = small
    tokens = _tokens(2, (2, 16))
    full, _ = jit_apply(model, {"params": params}, tokens)
    step = functools.partial(jit_apply, model, {"params": params})
    # (test_one_compiled_step_serves_every_position's batch and capacity: its programs for chunks of 4 and 1.)
    cache = KVCache.create(config, batch_size=2, capacity=16)
    pieces, start = [], 0
    for size in (3, 4, 1, 4, 1, 3):  # chunks at 6 offsets, of 3 sizes (a program each)
        logits, cache = step(tokens[:, start:start + size], cache)
        pieces.append(logits)
        start += size
    np.testing.assert_array_equal(cache.pos, [16] * 2)
    assert float(jnp.abs(full - jnp.concatenate(pieces, axis=1)).max()) < 1e-5


@pytest.mark.parametrize("changes", [
    dict(),  # GQA, split-half, tied
    dict(rope_pairing="interleaved"),
    dict(tie_embeddings=False),
    dict(n_kv_head=4),  # plain multi-head attention
    dict(n_kv_head=1),  # multi-query attention
    dict(qkv_bias=True),  # Qwen2
    dict(head_dim_override=24),  # heads wider than d_model // n_head
])
def test_matches_independent_numpy_forward(changes):
    """Weights at a large scale, so a wrong pairing, grouping or layout cannot hide."""
    config = SMALL.replace(**changes)
    model = Decoder(config)
    params = random_params(config, seed=3)
    tokens = _tokens(4, (2, 24))
    want = numpy_decoder_logits(params, tokens, config)
    assert np.abs(want).max() > 1.0  # the check has teeth: logits far from uniform
    logits, _ = jit_apply(model, {"params": params}, tokens)
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)
    # ... and one cached step at a time gives the same numbers.
    cache = KVCache.create(config, batch_size=2, capacity=24)
    step = functools.partial(jit_apply, model, {"params": params})
    steps = []
    for t in range(24):
        out, cache = step(tokens[:, t:t + 1], cache)
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_sown_attention_weights_match_the_numpy_forward(scan_layers):
    """What the report page draws: every layer's weights, from the unrolled blocks or the
    scanned stack, equal the independent forward's."""
    config = SMALL.replace(n_kv_head=2)
    params = random_params(config, seed=3)
    tokens = _tokens(4, (2, 24))
    want, sizes = [], []
    numpy_decoder_logits(params, tokens, config, attention=want, score_sizes=sizes)  # n_layer x [B, n_head, T, T]
    model_config, model_params = with_scan_layers(config, params, scan_layers)
    _, sown = jit_apply(Decoder(model_config), {"params": model_params}, tokens, mutable="intermediates")
    got = np.asarray(sown_attention_weights(sown, model_config), np.float64)
    chex.assert_shape(got, (config.n_layer, 2, config.n_head, 24, 24))
    want = np.stack(want)
    assert np.max(want) > 0.9  # sharp heads: a layer or head out of place shows
    # The error model. Softmax: scores off by at most ds move weight p_j by at most 2 p_j ds (to
    # first order, dp_j = p_j (ds_j - sum_k p_k ds_k)). Scores: float32 rounding adds up as
    # independent errors, a sum of n terms off by about sqrt(n) eps32 times its terms'
    # magnitudes; a score is a sum of D products q_d k_d whose q and k are each a sum of d_model
    # terms, and layer l's residual stream carries the l - 1 below it, so layer l's scores are
    # off by l (sqrt(D) + 2 sqrt(d_model)) eps32 times the largest sum_d |q_d k_d| / sqrt(D) of
    # the row (`score_sizes`, from the float64 forward). Any backend's order of those sums (a
    # GPU's, its exp within its few ulps) keeps to it: on a CPU the weights keep within a
    # third of it (0.33), and the GPU's largest error was 1.1 times the CPU's.
    eps = float(np.finfo(np.float32).eps)
    layer = np.arange(1, config.n_layer + 1)[:, None, None, None]
    score_error = layer * (np.sqrt(config.head_dim) + 2 * np.sqrt(config.d_model)) * eps * np.stack(sizes)
    bound = 2 * want * score_error[..., None] + eps * want  # (and the weight's own rounding)
    assert bound.max() < 0.01  # far below what a head or layer out of place moves
    excess = np.abs(got - want) - bound
    assert excess.max() <= 0, (excess.max(), np.unravel_index(excess.argmax(), excess.shape))


@pytest.mark.parametrize("changes", [
    dict(),  # tied
    dict(tie_embeddings=False, final_logit_softcap=3.0),  # Gemma 2's cap, on its own head
    dict(scan_layers=True),
    dict(lora=LoraConfig(rank=2, targets=("q_proj", "v_proj", "down_proj"))),
])
def test_hidden_states_and_output_head_give_the_logits_and_the_loss(changes):
    """`apply(..., hidden=True)` and `output_head(params)` are the logits taken apart: their
    logits equal the model's, and the chunked loss of them equals, with its gradients w.r.t.
    what is trained (the parameters, or LoRA's adapters), the whole-logits loss, in float32:
    the loss at 1e-5, the gradients within 1e-5 of the largest (LoRA's scale 8 makes them up to
    ~9, and a one-chunk run, the same math summed in another order, differs by ~5e-5 there).
    With LoRA the head is the base's: adapters never change it."""
    config = SMALL.replace(**changes)
    model = Decoder(config)
    params = random_params(config, seed=3)
    variables = {"params": params}
    if config.lora is not None:  # adapters with b drawn too (a new one's b is zero: it would change nothing)
        adapters = init_lora(params, config.lora, jax.random.key(1))
        variables[LORA_COLLECTION] = jax.tree.map(lambda a: 0.3 * jax.random.normal(jax.random.key(2), a.shape),
                                                  adapters)
    tokens = _tokens(4, (2, 24))
    targets = jnp.where(_tokens(5, (2, 24)) % 5 == 0, -100, _tokens(6, (2, 24)))  # some positions ignored
    trained = "params" if config.lora is None else LORA_COLLECTION

    def loss(chunked, weights):
        """The loss, and what `apply` gave it: the logits, or the hidden states (with the cache, None)."""
        v = {**variables, trained: weights}
        if not chunked:
            logits, none = model.apply(v, tokens)
            return label_smoothed_cross_entropy(logits, targets, 0.1, -100), (logits, none)
        hidden, none = model.apply(v, tokens, hidden=True)
        head = model.output_head(v["params"])
        return chunked_cross_entropy(hidden, targets, head, 0.1, -100, chunk_size=7), (hidden, none)

    # (The forwards' outputs come out of the loss's programs: no forward compiled on its own.)
    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=0)
    (want, (logits, _)), want_grads = value_and_grad(False, variables[trained])
    (got, (hidden, none)), grads = value_and_grad(True, variables[trained])
    assert none is None
    chex.assert_shape(hidden, (2, 24, config.d_model))
    head = model.output_head(params)
    assert head.tied == config.tie_embeddings and head.softcap == config.final_logit_softcap
    np.testing.assert_allclose(jax.jit(head.logits)(hidden), logits, rtol=1e-6, atol=1e-6)
    if config.final_logit_softcap is not None:
        assert np.abs(logits).max() > 2.0  # the cap bends the logits it is compared on

    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-5)
    largest = float(jnp.abs(ravel_pytree(want_grads)[0]).max())
    assert largest > 1e-3  # gradients to compare
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * largest), grads, want_grads)


def test_parameter_tree_and_reference_init():
    config = DecoderConfig(vocab_size=512, n_layer=4, n_head=8, n_kv_head=2, d_model=256, max_seq_len=32)
    params = init_params(config)
    attn, mlp = params["block_0"]["attn"], params["block_0"]["mlp"]
    chex.assert_shape([attn["wq"], attn["wk"], attn["wv"], attn["wo"]],
                      [(256, 8, 32), (256, 2, 32), (256, 2, 32), (8, 32, 256)])
    chex.assert_shape([mlp["w_gate"], mlp["w_up"], mlp["w_down"]], [(256, 704), (256, 704), (704, 256)])
    assert set(params) == {"embed", "final_norm", *(f"block_{i}" for i in range(4))}
    residual_std = 0.02 / np.sqrt(2 * config.n_layer)
    for leaf, std in [(params["embed"], 0.02), (attn["wq"], 0.02), (mlp["w_up"], 0.02),
                      (attn["wo"], residual_std), (mlp["w_down"], residual_std)]:
        leaf = np.asarray(leaf, np.float64)
        assert abs(np.std(leaf) / std - 1) < 0.03
        assert abs(np.mean(leaf)) < 0.1 * std
    np.testing.assert_array_equal(params["final_norm"]["weight"], np.ones(256))
    untied = _init_shapes(config.replace(tie_embeddings=False))
    chex.assert_shape(untied["lm_head"], (256, 512))


def test_tied_head_is_the_embedding(small):
    """Logits are the final hidden state times the embedding matrix, transposed."""
    config, model, params = small
    tokens = _tokens(5, (2, 7))
    logits, _ = jit_apply(model, {"params": params}, tokens)
    # Moving one embedding row moves that token's logit column at every position.
    bumped = jax.tree.map(lambda x: x, params)
    bumped["embed"] = params["embed"].at[7].set(params["embed"][7] * 0 + 1.0)
    tokens_without_7 = jnp.where(tokens == 7, 8, tokens)
    before, _ = jit_apply(model, {"params": params}, tokens_without_7)
    after, _ = jit_apply(model, {"params": bumped}, tokens_without_7)
    changed_columns = np.flatnonzero(np.abs(np.asarray(after - before)).max(axis=(0, 1)) > 0)
    assert changed_columns.tolist() == [7]
    chex.assert_shape(logits, (2, 7, config.vocab_size))


def test_bfloat16_compute():
    config = SMALL.replace(dtype="bfloat16")
    model = Decoder(config)
    assert jax.tree.leaves(_init_shapes(config))[0].dtype == jnp.float32  # parameters stay float32
    params = init_params(SMALL)  # (their values: the compute dtype does not enter the init)
    cache = KVCache.create(config, batch_size=2)
    assert cache.layers[0].k.dtype == jnp.bfloat16
    logits, cache = jit_apply(model, {"params": params}, _tokens(6, (2, 5)), cache)
    assert logits.dtype == jnp.float32  # the head's float32 sums, unrounded (docs/precision.md)
    chex.assert_tree_all_finite(logits)


class TestBadInput:
    def test_token_ids_outside_vocab(self, small):
        config, model, params = small
        for bad in (config.vocab_size, -1):
            with pytest.raises(ValueError, match=r"tokens holds ids outside \[0, vocab_size=64\)"):
                model.apply({"params": params}, jnp.array([[1, 2, bad]]))

    def test_longer_than_max_seq_len(self, small):
        config, model, params = small
        with pytest.raises(ValueError, match="exceed max_seq_len=64"):
            model.apply({"params": params}, jnp.zeros((1, 65), jnp.int32))

    def test_writing_past_the_cache(self, small):
        config, model, params = small
        cache = KVCache.create(config, batch_size=1, capacity=8)
        _, cache = jit_apply(model, {"params": params}, jnp.zeros((1, 6), jnp.int32), cache)
        with pytest.raises(ValueError, match=r"cache.pos\[0\] \+ tokens: 6 \+ 3 = 9 .*cache capacity=8"):
            model.apply({"params": params}, jnp.zeros((1, 3), jnp.int32), cache)
        with pytest.raises(ValueError, match="cache capacity=8"):
            model.apply({"params": params}, jnp.zeros((1, 9), jnp.int32), KVCache.create(config, 1, capacity=8))

    def test_cache_pos_per_row(self, small):
        """Each row's position is checked: the row that would write past the capacity is named."""
        config, model, params = small
        cache = KVCache.create(config, batch_size=2, capacity=8).replace(pos=jnp.array([0, 6], jnp.int32))
        with pytest.raises(ValueError, match=r"cache.pos\[1\] \+ tokens: 6 \+ 3 = 9 .*cache capacity=8"):
            model.apply({"params": params}, jnp.zeros((2, 3), jnp.int32), cache)
        with pytest.raises(ValueError, match=r"cache.pos must be >= 0 in every row, got \[-1, 0\]"):
            model.apply({"params": params}, jnp.zeros((2, 3), jnp.int32), cache.replace(pos=jnp.array([-1, 0])))
        with pytest.raises(ValueError, match=r"cache.pos must hold one position per row, shape \(2,\), got \(\)"):
            model.apply({"params": params}, jnp.zeros((2, 3), jnp.int32), cache.replace(pos=jnp.int32(0)))

    def test_cache_of_another_model(self, small):
        config, model, params = small
        other = KVCache.create(config.replace(n_kv_head=4), batch_size=1)
        with pytest.raises(ValueError, match="cache does not fit this model"):
            model.apply({"params": params}, jnp.zeros((1, 2), jnp.int32), other)
        wrong_batch = KVCache.create(config, batch_size=2)
        with pytest.raises(ValueError, match="cache does not fit this model"):
            model.apply({"params": params}, jnp.zeros((1, 2), jnp.int32), wrong_batch)

    def test_inside_jit_overflow_and_bad_ids_are_nan_not_silent(self, small):
        """Traced values cannot raise; they must not quietly clamp or wrap either."""
        config, model, params = small
        step = functools.partial(jit_apply, model, {"params": params})
        cache = KVCache.create(config, batch_size=1, capacity=8)
        logits, cache = step(jnp.ones((1, 6), jnp.int32), cache)
        assert bool(jnp.isfinite(logits).all())
        logits, _ = step(jnp.ones((1, 6), jnp.int32), cache)  # 12 > capacity 8
        assert bool(jnp.isnan(logits).all())
        for bad in (-1, 64):
            logits, _ = jit_apply(model, {"params": params}, jnp.array([[3, 4, 5], [3, bad, 5]]))
            # The NaN embedding reaches every position of its row (0 * NaN in the masked
            # attention sum); the other row is untouched.
            assert bool(jnp.isnan(logits[1]).all()) and bool(jnp.isfinite(logits[0]).all())


def test_bfloat16_compute_keeps_float32_master_weights():
    """dtype="bfloat16" computes in bf16 from float32 parameters; at the reference init the
    logits stay within 2% of the largest float32 logit (measured: 0.3%)."""
    config = SMALL.replace(dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(_init_shapes(config))} == {jnp.dtype(jnp.float32)}
    params = init_params(SMALL)  # (their values: the compute dtype does not enter the init)
    tokens = _tokens(9, (2, 24))
    want, _ = jit_apply(Decoder(SMALL), {"params": params}, tokens)
    got, _ = jit_apply(Decoder(config), {"params": params}, tokens)
    assert got.dtype == jnp.float32  # bf16 products, their float32 sums unrounded
    error = float(jnp.abs(got.astype(jnp.float32) - want).max())
    assert 0 < error < 0.02 * float(jnp.abs(want).max())  # bf16 really ran, and stayed close
    bf16_params = _init_shapes(config.replace(param_dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(bf16_params)} == {jnp.dtype(jnp.bfloat16)}


GROUPS = DecoderConfig(vocab_size=64, n_layer=3, n_head=4, n_kv_head=2, d_model=32, max_seq_len=32)


@pytest.mark.parametrize("config", [
    GROUPS, GROUPS.replace(layer_types=("sliding", "full", "sliding"), sliding_window=4),
    GROUPS.replace(scan_layers=True), GROUPS.replace(scan_layers=True, layer_types=("sliding", "full", "sliding"),
                                                     sliding_window=4),
    GROUPS.replace(qk_norm=True, qkv_bias=True, tie_embeddings=False)],
    ids=["full", "rings", "scanned", "scanned-rings", "qk-norm-untied"])
def test_groups_of_rows_in_one_call_equal_their_calls_apart(config):
    """A batch's one-token step and a prompt's 8-token piece, each in its own cache, as one call
    (the dense layers on all 11 tokens at once) give each group's logits and cache as apart."""
    model, params = Decoder(config), random_params(config, 1)
    batch, row = model.init_cache(3, 32), model.init_cache(1, 32)
    _, batch = jit_apply(model, {"params": params}, jax.random.randint(jax.random.key(0), (3, 9), 0, 64), batch)
    _, row = jit_apply(model, {"params": params}, jax.random.randint(jax.random.key(1), (1, 5), 0, 64), row)
    step, piece = jnp.asarray([[3], [4], [5]]), jax.random.randint(jax.random.key(2), (1, 8), 0, 64)
    apart = jax.jit(lambda params, step, piece, batch, row: [model.apply({"params": params}, step, batch),
                                                            model.apply({"params": params}, piece, row)])(
        params, step, piece, batch, row)
    # The grouped call (below) runs the dense layers on 11 rows where the calls apart run 3 and 8: the same
    # float32 sums, bitwise alike on a CPU, in other orders on a GPU (conftest's REORDERED).
    model64 = Decoder(float64_config(config))
    apart64 = in_float64(lambda params, step, piece, batch, row: [
        model64.apply({"params": params}, step, batch), model64.apply({"params": params}, piece, row)],
        params, step, piece, batch, row)
    (step_logits, piece_logits), (batch, row) = jax.jit(
        lambda params, a, b, c, d: model.apply({"params": params}, (a, b), (c, d)))(params, step, piece, batch, row)
    chex.assert_shape([step_logits, piece_logits], [(3, 1, 64), (1, 8, 64)])
    assert_reordered_equal((step_logits, batch), apart[0], apart64[0])
    assert_reordered_equal((piece_logits, row), apart[1], apart64[1])
    np.testing.assert_array_equal(row.pos, [13])
    with pytest.raises(ValueError, match="groups of tokens"):
        model.apply({"params": params}, (step, piece), batch)
