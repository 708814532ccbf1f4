"""Position-wise feed-forward networks: every position transformed on its own."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.sharding import EMBED, MLP, compute_param


class SwiGLU(nn.Module):
    """`W_down (silu(x W_gate) * (x W_up))`: a gated FFN with three matrices.

    Attributes:
      config: a `DecoderConfig` (`d_model`, `ffn_dim`, `n_layer`, `dtype`).
    """

    config: "DecoderConfig"  # noqa: F821

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        init = nn.initializers.normal(0.02)
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))  # see GQASelfAttention
        w_gate = compute_param(self, "w_gate", init, (c.d_model, c.ffn_dim), (EMBED, MLP))
        w_up = compute_param(self, "w_up", init, (c.d_model, c.ffn_dim), (EMBED, MLP))
        w_down = compute_param(self, "w_down", residual_init, (c.ffn_dim, c.d_model), (MLP, EMBED))
        gate = jnp.einsum("btd,df->btf", x, w_gate)  # [batch, T, ffn_dim]
        up = jnp.einsum("btd,df->btf", x, w_up)  # [batch, T, ffn_dim]
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w_down)  # [batch, T, d_model]


class FeedForward(nn.Module):
    """The 2017 FFN, `max(0, x W1 + b1) W2 + b2`, with dropout on the hidden layer.

    Attributes:
      config: a `VanillaConfig` (`d_model`, `ffn_dim`, `dropout`, `dtype`).
    """

    config: "VanillaConfig"  # noqa: F821

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        c = self.config
        init = nn.initializers.xavier_uniform()
        w1 = compute_param(self, "w1", init, (c.d_model, c.ffn_dim), (EMBED, MLP))
        b1 = compute_param(self, "b1", nn.initializers.zeros, (c.ffn_dim,), (MLP,))
        w2 = compute_param(self, "w2", init, (c.ffn_dim, c.d_model), (MLP, EMBED))
        b2 = compute_param(self, "b2", nn.initializers.zeros, (c.d_model,), (EMBED,))
        hidden = jax.nn.relu(jnp.einsum("btd,df->btf", x, w1) + b1)  # [batch, T, ffn_dim]
        hidden = nn.Dropout(c.dropout)(hidden, deterministic=deterministic)
        return jnp.einsum("btf,fd->btd", hidden, w2) + b2  # [batch, T, d_model]

