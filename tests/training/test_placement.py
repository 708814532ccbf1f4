"""`jaxformer.training.placement` on a one-device mesh (`tests/sharding/eight_devices.py`
trains on eight)."""

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from jaxformer import Decoder, DecoderConfig, label_smoothed_cross_entropy
from jaxformer.sharding import make_mesh, param_axes
from jaxformer.training import TrainState, make_train_step, shard_batches, shard_state

CONFIG = DecoderConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=16)


def test_shard_state_places_every_leaf_and_the_step_keeps_them_there():
    model = Decoder(CONFIG)
    # (jitted: one compile, not one per operation)
    params = jax.jit(model.init)(jax.random.key(0), *model.init_inputs())["params"]
    optimizer = optax.adam(1e-2)

    def loss_fn(params, batch, dropout_key):
        logits, _ = model.apply({"params": params}, batch["tokens"])
        return label_smoothed_cross_entropy(logits, batch["targets"], 0.0), {}

    def make_batch(data_key):
        tokens = jax.random.randint(data_key, (4, 9), 0, CONFIG.vocab_size)  # [batch, seq + 1]
        return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

    mesh = make_mesh(data=1, model=1)
    state, state_sharding = shard_state(TrainState.create(params, optimizer), param_axes(model), mesh, "fsdp")
    assert jax.tree.structure(state_sharding) == jax.tree.structure(state)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(state_sharding)):
        assert isinstance(sharding, NamedSharding) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)

    batches = shard_batches(make_batch, mesh)
    batch = batches(jax.random.key(1))
    assert all(x.sharding.mesh == mesh for x in jax.tree.leaves(batch))
    state, metrics = make_train_step(loss_fn, optimizer, state_sharding)(state, batch, jax.random.key(2))
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(state_sharding)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)

    _, want = make_train_step(loss_fn, optimizer)(TrainState.create(params, optimizer), make_batch(jax.random.key(1)),
                                                  jax.random.key(2))
    np.testing.assert_allclose(float(metrics["loss"]), float(want["loss"]), rtol=1e-6)
