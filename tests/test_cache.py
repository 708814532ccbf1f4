import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jit_apply, random_params

from jaxformer import Decoder, DecoderConfig, KVCache, generate
from jaxformer.cache import Entry, LayerSlice, Stacks, attention_entry
from jaxformer.convert import with_scan_layers
from jaxformer.decoding import PromptLookup
from jaxformer.deltanet import GatedDeltaNetSpec
from jaxformer.layers import layer_specs
from jaxformer.memory import cache_entry_bytes

CONFIG = DecoderConfig(vocab_size=32, n_layer=3, n_head=4, n_kv_head=2, d_model=32, max_seq_len=16)


def test_create_shapes_and_inspection():
    cache = KVCache.create(CONFIG, batch_size=2)
    assert len(cache.layers) == 3
    chex.assert_tree_shape_prefix(cache.layers, (2, 16, 2, 8))
    chex.assert_shape(cache.pos, (2,))  # one position per row
    assert cache.pos.dtype == jnp.int32
    np.testing.assert_array_equal(cache.length, [0, 0])
    assert (cache.capacity, cache.batch_size) == (16, 2)
    # 2 (k, v) * 3 layers * batch 2 * 2 kv heads * head_dim 8 * 4 bytes per position
    assert cache.bytes_per_token == 2 * 3 * 2 * 2 * 8 * 4
    assert cache.nbytes == 16 * cache.bytes_per_token
    assert cache.bytes_used == 0
    small = KVCache.create(CONFIG, batch_size=1, capacity=5, dtype=jnp.bfloat16)
    assert small.capacity == 5 and small.layers[0].k.dtype == jnp.bfloat16


def test_write_is_functional_and_lands_at_each_rows_pos():
    cache = KVCache.create(CONFIG, batch_size=2, capacity=8)
    layer = cache.layers[0]
    k_new = jnp.arange(1.0, 3.0)[:, None, None, None] * jnp.ones((2, 3, 2, 8))  # row b holds b + 1
    written = jax.jit(layer.write)(k_new, 2 * k_new, jnp.array([4, 1], jnp.int32))
    assert float(jnp.abs(layer.k).max()) == 0.0  # the input is untouched
    for row, start in ((0, 4), (1, 1)):  # each row's window at its own slots, zeros elsewhere
        np.testing.assert_array_equal(written.k[row, start:start + 3], k_new[row])
        np.testing.assert_array_equal(written.v[row, start:start + 3], 2 * k_new[row])
        outside = np.delete(np.asarray(written.k[row]), np.s_[start:start + 3], axis=0)
        assert np.abs(outside).max() == 0.0
    advanced = cache.advance(3).advance(jnp.array([0, 2], jnp.int32))
    np.testing.assert_array_equal(advanced.length, [3, 5])
    assert advanced.bytes_used == (3 + 5) * cache.bytes_per_token // 2
    np.testing.assert_array_equal(cache.pos, [0, 0])


def test_stacked_write_lands_in_its_layer_at_each_rows_pos():
    cache = KVCache.create(CONFIG.replace(scan_layers=True), batch_size=2, capacity=8)
    k_new = jnp.ones((2, 2, 2, 8))
    _, written = LayerSlice(cache.layers, jnp.int32(1)).extend(k_new, -k_new, jnp.array([0, 5], jnp.int32))
    stack = written.stack
    want = np.zeros(stack.k.shape, np.float32)
    want[0, 1, 0:2], want[1, 1, 5:7] = 1.0, 1.0
    np.testing.assert_array_equal(stack.k, want)
    np.testing.assert_array_equal(stack.v, -want)


def test_is_a_pytree():
    cache = KVCache.create(CONFIG, batch_size=2, capacity=4)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 2 * 3 + 1  # k and v per layer, pos
    doubled = jax.tree.map(lambda x: x * 2, cache)
    assert isinstance(doubled, KVCache)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=2, capacity=17), r"capacity .*max_seq_len=16"),
    (dict(batch_size=2, capacity=0), "capacity"),
])
def test_bad_create(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCache.create(CONFIG, **kwargs)


def test_cache_dtype_is_selectable():
    """A bf16 cache under float32 compute: half the bytes, logits close to the float32 cache's."""
    config = CONFIG.replace(cache_dtype="bfloat16")
    cache = KVCache.create(config, batch_size=2, capacity=8)
    assert cache.layers[0].k.dtype == jnp.bfloat16
    assert cache.nbytes * 2 == KVCache.create(CONFIG, batch_size=2, capacity=8).nbytes
    params = random_params(CONFIG, seed=0, scale=0.02)  # (the init's scale, without an init to compile)
    tokens = jnp.arange(12).reshape(2, 6) % CONFIG.vocab_size
    want, _ = jit_apply(Decoder(CONFIG), {"params": params}, tokens, KVCache.create(CONFIG, 2, capacity=8))
    got, cache = jit_apply(Decoder(config), {"params": params}, tokens, cache)
    assert got.dtype == jnp.float32 and cache.layers[-1].v.dtype == jnp.bfloat16
    error = float(jnp.abs(got - want).max())
    assert 0 < error < 0.02 * float(jnp.abs(want).max())


def _greedy(step, token, cache, n):
    """`n` greedy steps from `token [batch]`: the tokens `[batch, n]` (the first is `token`) and the cache."""
    tokens = [token]
    for _ in range(n - 1):
        logits, cache = step(tokens[-1][:, None], cache)
        tokens.append(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
    return jnp.stack(tokens, axis=1), cache


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_row_evicted_and_refilled_decodes_as_its_prompt_alone(scan_layers):
    """A batch of 4 decodes; row 2 is evicted and a new prompt, prefilled alone, is inserted
    there; every row goes on in one batched step. Row 2's greedy tokens are the new
    prompt's solo decoding's and its cache holds the solo cache's values; the other rows
    are exactly their undisturbed run."""
    config, params = with_scan_layers(CONFIG.replace(max_seq_len=32),
                                      random_params(CONFIG.replace(max_seq_len=32), seed=3), scan_layers)
    model = Decoder(config)
    step = jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache))
    prompts = jax.random.randint(jax.random.key(1), (4, 5), 0, config.vocab_size)
    logits, cache = step(prompts, KVCache.create(config, 4, capacity=20))
    tokens, cache = _greedy(step, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache, 3)
    undisturbed, undisturbed_cache = _greedy(step, tokens[:, -1], cache, 6)

    new_prompt = jax.random.randint(jax.random.key(2), (1, 6), 0, config.vocab_size)
    new_logits, alone = step(new_prompt, KVCache.create(config, 1, capacity=20))  # the prefill into a row
    first = jnp.argmax(new_logits[:, -1], axis=-1).astype(jnp.int32)  # [1]
    joined = cache.evict(2).insert(2, alone)
    np.testing.assert_array_equal(joined.pos, [7, 7, 6, 7])  # rows at different positions in one batch
    got, got_cache = _greedy(step, tokens[:, -1].at[2].set(first[0]), joined, 6)
    solo, solo_cache = _greedy(step, first, alone, 6)

    np.testing.assert_array_equal(got[2], solo[0])
    np.testing.assert_array_equal(np.delete(np.asarray(got), 2, axis=0), np.delete(np.asarray(undisturbed), 2, axis=0))
    np.testing.assert_array_equal(got_cache.pos, [12, 12, 11, 12])
    for got_leaf, solo_leaf, undisturbed_leaf in zip(jax.tree.leaves(got_cache.layers),
                                                     jax.tree.leaves(solo_cache.layers),
                                                     jax.tree.leaves(undisturbed_cache.layers)):
        np.testing.assert_allclose(got_leaf[2], solo_leaf[0], atol=1e-5)
        keep = np.array([0, 1, 3])
        np.testing.assert_allclose(got_leaf[keep], undisturbed_leaf[keep], atol=1e-5)


def test_evict_clears_one_row_and_insert_checks_its_inputs():
    cache = KVCache.create(CONFIG, batch_size=3, capacity=8)
    cache = jax.tree.map(lambda x: x + 1, cache)  # every slot written, every pos 1
    evicted = cache.evict(1)
    np.testing.assert_array_equal(evicted.pos, [1, 0, 1])
    for leaf in jax.tree.leaves(evicted.layers):
        assert float(jnp.abs(leaf[1]).max()) == 0.0 and float(jnp.abs(leaf[0] - 1).max()) == 0.0
    traced = jax.jit(KVCache.evict)(cache, jnp.int32(2))  # a traced row
    np.testing.assert_array_equal(traced.pos, [1, 1, 0])
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(traced.layers))
    # A traced row out of range cannot raise; it must not clamp onto the last row either: the
    # keys and values turn NaN, so every logit read from them is NaN.
    one_row = KVCache.create(CONFIG, batch_size=1, capacity=8)
    for operation in (lambda c, r: c.evict(r), lambda c, r: c.insert(r, one_row)):
        for row in (3, -1):
            bad = jax.jit(operation)(cache, jnp.int32(row))
            assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(bad.layers))
    unguarded = jax.jit(lambda c, r: c.insert(r, one_row, guard=False))(cache, jnp.int32(1))  # (an engine's own row)
    for got, want in zip(jax.tree.leaves(unguarded), jax.tree.leaves(cache.insert(1, one_row))):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"KVCache.evict: row .*batch_size - 1=2"):
        cache.evict(3)
    with pytest.raises(ValueError, match="KVCache.insert: other must be a one-row cache"):
        cache.insert(0, KVCache.create(CONFIG, batch_size=2, capacity=8))
    with pytest.raises(ValueError, match="KVCache.insert: other must be a one-row cache"):
        cache.insert(0, KVCache.create(CONFIG, batch_size=1, capacity=4))
    with pytest.raises(ValueError, match=r"KVCache.insert: row"):
        cache.insert(-1, KVCache.create(CONFIG, batch_size=1, capacity=8))


# Sliding-window layers keep a ring of `window - 1 + rewind` slots (`RingKV`).

WINDOWED = DecoderConfig(vocab_size=32, n_layer=3, n_head=4, n_kv_head=2, d_model=32, max_seq_len=48,
                         layer_types=("sliding", "sliding", "full"), sliding_window=5, local_rope_theta=100.0)


def test_ring_positions_and_writes_keep_each_rows_last_slots():
    from jaxformer.cache import RingKV, ring_positions

    pos = jnp.array([0, 3, 9])
    np.testing.assert_array_equal(ring_positions(pos, 4), [[-4, -3, -2, -1], [0, 1, 2, -1], [8, 5, 6, 7]])
    ring = RingKV(k=jnp.zeros((3, 4, 1, 1)), v=jnp.zeros((3, 4, 1, 1)))
    new = (jnp.arange(6.0)[None, :, None, None] + 10 * jnp.arange(3.0)[:, None, None, None])  # row b: 10b + t
    written = ring.write(new, new, pos, stop=jnp.array([6, 5, 100]))
    # Row 0 wrote positions 0..5 of which only the last 4 before stop 6 (2..5) fit; row 1 stopped
    # at 5 (positions 3, 4); row 2 kept positions 11..14 in slots 3, 0, 1, 2.
    np.testing.assert_array_equal(written.k[:, :, 0, 0], [[4, 5, 2, 3], [11, 0, 0, 10], [23, 24, 25, 22]])


def test_a_ring_decodes_as_a_full_cache_with_the_window_mask_past_the_window():
    """Prefill, then chunks of 1 and 3 tokens through rings of window - 1 slots (and of
    window - 1 + 3 for the chunks), against the same calls on full slots: equal logits."""
    model = Decoder(WINDOWED)
    params = random_params(WINDOWED, seed=3, scale=0.5)
    tokens = jax.random.randint(jax.random.key(0), (2, 30), 0, WINDOWED.vocab_size)
    # (One jitted function for every call: the full slots' programs serve both runs.)
    step = functools.partial(jit_apply, model, {"params": params})
    whole, _ = step(tokens)  # (causal: its first `stop` positions are the forward of the first `stop` tokens)
    for rewind, chunk in ((0, 1), (2, 3)):
        ring, full = KVCache.create(WINDOWED, 2, 40, rewind=rewind), KVCache.create(WINDOWED, 2, 40, rewind=40)
        assert [type(layer).__name__ for layer in ring.layers] == ["RingKV", "RingKV", "LayerKV"]
        assert ring.layers[0].k.shape[1] == 4 + rewind and full.layers[0].k.shape[1] == 40
        got, want = [], []
        for start, stop in [(0, 7), *((t, t + chunk) for t in range(7, 30 - chunk + 1, chunk))]:
            logits, ring = step(tokens[:, start:stop], ring)
            got.append(logits)
            logits, full = step(tokens[:, start:stop], full)
            want.append(logits)
        # (float32 sums over other key sets: the ring's slots and this call's, or all 40 slots)
        np.testing.assert_allclose(jnp.concatenate(got, 1), jnp.concatenate(want, 1), atol=1e-4, rtol=0)
        np.testing.assert_allclose(jnp.concatenate(got, 1), whole[:, :stop], atol=1e-4, rtol=0)


RAGGED_PROMPTS = [np.arange(3) % 32, (np.arange(12) * 7) % 32]


@pytest.fixture(scope="module")
def windowed_alone():
    """The windowed model's parameters, and each ragged prompt's 20 greedy tokens decoded alone."""
    params = random_params(WINDOWED, seed=4, scale=0.5)
    return params, [generate(Decoder(WINDOWED), params, p[None], max_new_tokens=20)[0, len(p):] for p in RAGGED_PROMPTS]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_rings_decode_ragged_prompts_and_speculative_rewinds_as_each_prompt_alone(scan_layers, windowed_alone):
    """Rows of 3 and 12 tokens (the longer past the window, the shorter padded), plain and
    speculative (k=4: rejected proposals are set back across the ring's wrap): each row's
    tokens are those of its prompt decoded alone (no padding, no rewind: the ring as the test
    above checks it), per layer or scanned (its rings and full slots two stacks)."""
    params, alone = windowed_alone
    config, params = with_scan_layers(WINDOWED, params, scan_layers)
    model = Decoder(config)
    batch = np.zeros((2, 12), np.int32)
    batch[0, :3], batch[1] = RAGGED_PROMPTS
    for speculative in (None, PromptLookup(k=4, n=1)):
        out = generate(model, params, batch, prompt_lengths=np.array([3, 12]), max_new_tokens=20,
                       speculative=speculative)
        for row, want in enumerate(alone):
            np.testing.assert_array_equal(out[row, 12:], want)  # the padded prompt's 12 columns, then the new


def test_gemma3_cache_at_32k_keeps_about_a_sixth_of_a_full_cache():
    """Gemma 3 1B's layout: 26 layers, five of every six sliding over 512 positions (shapes only)."""
    gemma3 = DecoderConfig(vocab_size=262144, n_layer=26, n_head=4, n_kv_head=1, d_model=1152, head_dim_override=256,
                           max_seq_len=32768, sliding_window=512, local_rope_theta=10000.0, scan_layers=True,
                           layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26)),
                           dtype="bfloat16")
    ring = jax.eval_shape(lambda: KVCache.create(gemma3, 1, 32768))
    full = jax.eval_shape(lambda: KVCache.create(gemma3.replace(layer_types=None, sliding_window=None,
                                                                local_rope_theta=None), 1, 32768))
    nbytes = lambda cache: sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(cache.layers))  # noqa: E731
    # 4 full layers of 32768 slots and 22 rings of 511, against 26 layers of 32768.
    assert nbytes(full) == 2 * 26 * 32768 * 256 * 2
    assert nbytes(ring) == 2 * (4 * 32768 + 22 * 511) * 256 * 2
    assert nbytes(ring) / nbytes(full) < 0.17


def direct_layer(cache: KVCache, config: DecoderConfig, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Layer i's k and v `[batch, slots, n_kv, head_dim]`, sliced straight from the cache's arrays:
    its own, its row of the one stack, or of its kind's stack at its rank among that kind."""
    if not config.scan_layers:
        layer, index = cache.layers[i], slice(None)
    elif not cache.ring_slots:
        layer, index = cache.layers, i
    else:
        kind = config.attention_types[i]
        layer = cache.layers.sliding if kind == "sliding" else cache.layers.full
        index = config.attention_types[:i].count(kind)
    return np.array(layer.k[:, index]), np.array(layer.v[:, index])


@pytest.mark.parametrize("config", [
    CONFIG, CONFIG.replace(scan_layers=True), WINDOWED,
    # (a layer's rank in its stack differs from its number, clamped into the stack: the rank is read)
    WINDOWED.replace(layer_types=("full", "sliding", "sliding"), scan_layers=True),
], ids=["per layer", "stacked", "rings", "two stacks"])
def test_each_layouts_layer_view_reads_and_writes_its_layer_alone(config):
    """For each layer i of each layout: `layer(i)` given back unwritten is the same cache; its
    `attend` reads layer i's slots (a full layer's first `read_slots`, a ring's whole) then this
    call's K/V; `with_layer(i, written)` holds them at each row's slot and leaves every other
    layer as it was."""
    cache = KVCache.create(config, batch_size=2, capacity=16).replace(pos=jnp.array([3, 9], jnp.int32))
    keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(cache.layers)))
    leaves = [jax.random.randint(key, leaf.shape, 0, 100).astype(leaf.dtype)  # integers: exact sums
              for key, leaf in zip(keys, jax.tree.leaves(cache.layers))]
    cache = cache.replace(layers=jax.tree.unflatten(jax.tree.structure(cache.layers), leaves))
    k_new = jnp.full((2, 1, 2, 8), 1000.0)
    step = jax.jit(lambda cache, i: cache.with_layer(i, cache.layer(i)), static_argnums=1 if not config.scan_layers
                   else ())
    for i, kind in enumerate(config.attention_types):
        index = i if not config.scan_layers else jnp.int32(i)  # traced in a scan, so here too
        chex.assert_trees_all_equal(step(cache, index), cache)
        def sums(keys, values, kind=None):  # the same shape for both kinds: a cache of two stacks returns it
            return jnp.stack([keys.sum(1), values.sum(1)]), None  # (out, weights)

        (read, _), written = cache.layer(index).attend(sums, k_new, -k_new, cache.pos, None, cache.read_slots)
        k_sum, v_sum = read
        written = cache.with_layer(index, written)
        for j in range(config.n_layer):
            want_k, want_v = direct_layer(cache, config, j)
            if j == i:  # row b's slot pos[b] (in a ring, pos[b] % slots) holds the new K/V
                before_k, before_v = want_k.copy(), want_v.copy()
                slots = want_k.shape[1]
                for row, at in enumerate(np.asarray(cache.pos) % slots):
                    want_k[row, at], want_v[row, at] = 1000.0, -1000.0
                # what attention read: a full layer's slots once written, a ring's before, then this call's
                read_k, read_v = (want_k, want_v) if slots == cache.capacity else (before_k, before_v)
                np.testing.assert_array_equal(k_sum, read_k.sum(1) + (slots < cache.capacity) * 1000.0)
                np.testing.assert_array_equal(v_sum, read_v.sum(1) - (slots < cache.capacity) * 1000.0)
            got_k, got_v = direct_layer(written, config, j)
            np.testing.assert_array_equal(got_k, want_k, err_msg=f"layer {j} after writing layer {i} ({kind})")
            np.testing.assert_array_equal(got_v, want_v, err_msg=f"layer {j} after writing layer {i} ({kind})")


def test_a_ring_too_short_for_the_window_or_of_another_layout_is_refused():
    model, params = Decoder(WINDOWED), random_params(WINDOWED, seed=3)
    kv = dict(n_layer=3, n_kv_head=2, head_dim=8, max_seq_len=48, dtype=jnp.float32)
    short = KVCache.zeros(1, 40, slots=(3, 3, 40), **kv)  # a window of 5 reads 4 earlier keys
    with pytest.raises(ValueError, match=r"rings of 3 slots are shorter than sliding_window - 1 = 4"):
        model.apply({"params": params}, jnp.zeros((1, 1), jnp.int32), short)
    unringed_full = KVCache.zeros(1, 40, slots=(4, 40, 4), **kv)  # the ring on the full layer
    with pytest.raises(ValueError, match="cache does not fit this model"):
        model.apply({"params": params}, jnp.zeros((1, 1), jnp.int32), unringed_full)
    with pytest.raises(ValueError, match=r"slots must be an int in \[1, capacity=40\] \(got 41\)"):
        KVCache.zeros(1, 40, slots=(4, 41, 4), **kv)


@pytest.mark.parametrize("layer_types, scan", [(None, False), (("sliding", "full", "sliding"), False),
                                               (None, True), (("sliding", "full", "sliding"), True)],
                         ids=["full", "rings", "stacked", "split-stacks"])
def test_with_steps_of_copies_back_what_a_step_of_the_first_rows_wrote(layer_types, scan):
    """A step of the first 2 of 4 rows, its slots copied back, equals its rows copied back whole."""
    config = CONFIG.replace(layer_types=layer_types, sliding_window=4 if layer_types else None, scan_layers=scan)
    model = Decoder(config)
    params = random_params(config, 5)
    prompt = jax.random.randint(jax.random.key(1), (4, 9), 0, config.vocab_size)  # 9 positions: the rings wrap
    _, cache = jit_apply(model, {"params": params}, prompt, model.init_cache(4, 16))
    cache = cache.replace(pos=jnp.asarray([9, 7, 9, 9], jnp.int32))
    head = jax.tree.map(lambda leaf: leaf[:2], cache)
    _, stepped = jit_apply(model, {"params": params}, jnp.asarray([[3], [5]]), head)
    whole = jax.tree.map(lambda leaf, part: jax.lax.dynamic_update_slice_in_dim(leaf, part, 0, axis=0), cache,
                         stepped)
    slots = jax.jit(lambda c, h, w: c.with_steps_of(h, w))(cache, stepped, head.pos)
    chex.assert_trees_all_equal(slots, whole)
    np.testing.assert_array_equal(slots.pos, [10, 8, 9, 9])


# A linear-attention hybrid's cache, at the cache alone: layers 0, 1 and 3 keep a state (conv inputs
# [kernel - 1 = 3, 6 channels], a state [2 heads, 4, 5]), layer 2 keys and values.
STATE = Entry("linear", ((3, 6), (2, 4, 5)))
KV = attention_entry("full", 2, 8)
HYBRID = dict(n_layer=4, n_kv_head=2, head_dim=8, max_seq_len=16, dtype=jnp.float32, entries=(STATE, STATE, KV, STATE))


@pytest.mark.parametrize("stacked", [False, True], ids=["per layer", "stacked"])
def test_a_cache_keeps_linear_layers_states_beside_keys_and_values(stacked):
    """States are the size their entries say, whatever the capacity, float32 whatever the cache's
    dtype; each layer's view reads and writes its own alone; a row's state moves whole through
    `insert`, `evict` and `with_steps_of`; `bytes_used` counts a begun row's state."""
    cache = KVCache.zeros(3, 16, stacked=stacked, **HYBRID)
    if stacked:  # one stack of each kind: the three states, the one layer of keys
        assert isinstance(cache.layers, Stacks) and cache.layers.sliding is None
        assert cache.layer_shapes == ((3, 1, 16, 2, 8), (3, 3, 3, 6))
        chex.assert_shape(cache.layers.linear.state, (3, 3, 2, 4, 5))
    else:
        assert [type(layer).__name__ for layer in cache.layers] == ["LinearState"] * 2 + ["LayerKV", "LinearState"]
        chex.assert_shape([cache.layers[0].conv, cache.layers[0].state], [(3, 3, 6), (3, 2, 4, 5)])
    assert cache.has_state and cache.n_layer == 4
    assert {leaf.dtype for leaf in jax.tree.leaves(KVCache.zeros(3, 16, stacked=stacked, **{
        **HYBRID, "dtype": jnp.bfloat16}).layers)} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
    per_row = 3 * (3 * 6 + 2 * 4 * 5) * 4 + 16 * 2 * 2 * 8 * 4  # three states, and layer 2's slots
    assert cache.nbytes == 3 * per_row == 3 * sum(cache_entry_bytes(e, 16, 4) for e in HYBRID["entries"])

    def index(i):
        return jnp.int32(i) if stacked else i

    def state_of(cache, i):  # layer i's (conv, state), every row
        return cache.layer(index(i), ("linear",)).read()

    conv, state = jnp.ones((3, 3, 6)), jnp.arange(3 * 40.0).reshape(3, 2, 4, 5)
    written = jax.jit(lambda c: c.with_layer(index(1), c.layer(index(1), ("linear",)).write(conv, state)))(cache)
    for i in (0, 3):
        chex.assert_trees_all_equal(state_of(written, i), state_of(cache, i))  # the other states untouched
    chex.assert_trees_all_equal(state_of(written, 1), (conv, state))
    chex.assert_trees_all_equal(written.layer(index(2)).k if not stacked else written.layers.full.k,
                                cache.layer(index(2)).k if not stacked else cache.layers.full.k)

    begun = written.replace(pos=jnp.asarray([4, 0, 2], jnp.int32))
    assert begun.bytes_used == 2 * 3 * (3 * 6 + 2 * 4 * 5) * 4 + (4 + 2) * 2 * 2 * 8 * 4
    row = jax.tree.map(lambda leaf: leaf[2:], begun)  # a one-row cache: row 2's
    inserted = begun.evict(0).insert(0, row)
    for i in (0, 1, 3):
        chex.assert_trees_all_equal(jax.tree.map(lambda a: a[0], state_of(inserted, i)),
                                    jax.tree.map(lambda a: a[2], state_of(begun, i)))
    assert float(jnp.abs(state_of(begun.evict(1), 1)[1][1]).max()) == 0.0  # a row evicted: its state zeroed
    head = jax.tree.map(lambda leaf: leaf[:2] + 1, begun)  # "a step" of rows 0 and 1 changed every number
    stepped = begun.with_steps_of(head.replace(pos=begun.pos[:2] + 1), begun.pos[:2])
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[:2], state_of(stepped, 1)),
                                jax.tree.map(lambda a: a[:2] + 1, state_of(begun, 1)))  # whole rows' states
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[2], state_of(stepped, 1)),
                                jax.tree.map(lambda a: a[2], state_of(begun, 1)))
    axes = jax.tree.leaves(cache.heads_axes)  # what a mesh splits over `model`: kv heads, a state's heads, its channels
    assert sorted(axes) == sorted([-2, -2] + [-1, -3] * (1 if stacked else 3))


def hybrid_config(**changes) -> DecoderConfig:
    """A linear-attention hybrid (Qwen3-Next's period): three Gated DeltaNet layers, then a full-attention
    one, chunks of 4 so that a 12-token prompt spans three."""
    base = DecoderConfig(vocab_size=32, n_layer=4, n_head=4, n_kv_head=2, d_model=32, max_seq_len=48, **changes)
    attention = layer_specs(base)[0]
    linear = dataclasses.replace(attention, mixer=GatedDeltaNetSpec(2, 4, 8, 8, chunk=4))
    return base.replace(layers=(linear,) * 3 + (attention,))


HYBRID_CONFIG = hybrid_config()


@pytest.fixture(scope="module")
def hybrid_alone():
    """The hybrid's parameters, and each ragged prompt's 16 greedy tokens and 3 beams' decoded alone."""
    params = random_params(HYBRID_CONFIG, seed=4, scale=0.5)
    model = Decoder(HYBRID_CONFIG)
    return params, [(generate(model, params, p[None], max_new_tokens=16)[0, len(p):],
                     generate(model, params, p[None], max_new_tokens=16, num_beams=3)[0, len(p):])
                    for p in RAGGED_PROMPTS]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_a_hybrid_cache_decodes_ragged_prompts_and_beams_as_each_prompt_alone(scan_layers, hybrid_alone):
    """Rows of 3 and 12 tokens, the shorter padded: a ragged prefill's padding changes no row's states
    (`cache.stop`), and beams reorder the states with the keys, so each row's greedy tokens and 3 beams'
    are those of its prompt decoded alone, per layer or scanned (its states and keys two stacks)."""
    params, alone = hybrid_alone
    config, params = with_scan_layers(HYBRID_CONFIG, params, scan_layers)
    batch = np.zeros((2, 12), np.int32)
    batch[0, :3], batch[1] = RAGGED_PROMPTS
    for beams, column in ((1, 0), (3, 1)):
        out = generate(Decoder(config), params, batch, prompt_lengths=np.array([3, 12]), max_new_tokens=16,
                       num_beams=beams)
        for row, want in enumerate(alone):
            np.testing.assert_array_equal(out[row, 12:], want[column])
