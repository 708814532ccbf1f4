"""The training tests' problem: a tiny linear regression with input dropout.

Dropout makes a resumed run depend on the dropout keys as well as the data keys.
"""

import jax
import jax.numpy as jnp

from jaxformer.training import TrainState

IN, BATCH, LR = 4, 16, 0.1
W_TRUE = jnp.array([[1.0], [-2.0], [0.5], [3.0]])


def make_batch(data_key):
    kx, kn = jax.random.split(data_key)
    x = jax.random.normal(kx, (BATCH, IN))  # [batch, in]
    return {"x": x, "y": x @ W_TRUE + 0.7 + 0.01 * jax.random.normal(kn, (BATCH, 1))}


def loss_fn(params, batch, dropout_key):
    keep = jax.random.bernoulli(dropout_key, 0.95, batch["x"].shape)
    pred = (batch["x"] * keep / 0.95) @ params["w"] + params["b"]  # [batch, 1]
    err = pred - batch["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def init_state(optimizer):
    return TrainState.create({"w": jnp.zeros((IN, 1)), "b": jnp.zeros((1,))}, optimizer)
