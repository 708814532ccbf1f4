import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import Decoder, DecoderConfig, KVCache

CONFIG = DecoderConfig(vocab_size=32, n_layer=3, n_head=4, n_kv_head=2, d_model=32, max_seq_len=16)


def test_create_shapes_and_inspection():
    cache = KVCache.create(CONFIG, batch_size=2)
    assert len(cache.layers) == 3
    chex.assert_tree_shape_prefix(cache.layers, (2, 16, 2, 8))
    chex.assert_shape(cache.pos, ())
    assert cache.pos.dtype == jnp.int32 and int(cache.length) == 0
    chex.assert_shape(cache.start, (2,))
    np.testing.assert_array_equal(cache.start, [0, 0])
    assert (cache.capacity, cache.batch_size) == (16, 2)
    # 2 (k, v) * 3 layers * batch 2 * 2 kv heads * head_dim 8 * 4 bytes per position
    assert cache.bytes_per_token == 2 * 3 * 2 * 2 * 8 * 4
    assert cache.nbytes == 16 * cache.bytes_per_token
    assert cache.bytes_used == 0
    small = KVCache.create(CONFIG, batch_size=1, capacity=5, dtype=jnp.bfloat16)
    assert small.capacity == 5 and small.layers[0].k.dtype == jnp.bfloat16


def test_write_is_functional_and_lands_at_pos():
    cache = KVCache.create(CONFIG, batch_size=1, capacity=8)
    layer = cache.layers[0]
    k_new = jnp.ones((1, 3, 2, 8))
    written = jax.jit(layer.write)(k_new, 2 * k_new, jnp.int32(4))
    assert float(jnp.abs(layer.k).max()) == 0.0  # the input is untouched
    np.testing.assert_array_equal(written.k[:, 4:7], k_new)
    np.testing.assert_array_equal(written.v[:, 4:7], 2 * k_new)
    assert float(jnp.abs(written.k[:, :4]).max()) == 0.0 and float(jnp.abs(written.k[:, 7:]).max()) == 0.0
    advanced = cache.advance(3)
    assert int(advanced.length) == 3 and advanced.bytes_used == 3 * cache.bytes_per_token
    assert int(cache.pos) == 0


def test_is_a_pytree():
    cache = KVCache.create(CONFIG, batch_size=2, capacity=4)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 2 * 3 + 2  # k and v per layer, pos, start
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
    from conftest import init_params
    config = CONFIG.replace(cache_dtype="bfloat16")
    cache = KVCache.create(config, batch_size=2, capacity=8)
    assert cache.layers[0].k.dtype == jnp.bfloat16
    assert cache.nbytes * 2 == KVCache.create(CONFIG, batch_size=2, capacity=8).nbytes
    params = init_params(CONFIG)
    tokens = jnp.arange(12).reshape(2, 6) % CONFIG.vocab_size
    want, _ = Decoder(CONFIG).apply({"params": params}, tokens, KVCache.create(CONFIG, 2, capacity=8))
    got, cache = Decoder(config).apply({"params": params}, tokens, cache)
    assert got.dtype == jnp.float32 and cache.layers[-1].v.dtype == jnp.bfloat16
    error = float(jnp.abs(got - want).max())
    assert 0 < error < 0.02 * float(jnp.abs(want).max())
