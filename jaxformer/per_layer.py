"""Per-layer inputs (Gemma 4's per-layer embeddings): each layer reads a small input of its own
for every token, besides the residual stream, and adds what it makes of it to the stream.

    e_l   = E_pl[token, l] * sqrt(P)                     the token's own row, a second table [V', L, P]
    p_l   = norm(x0 W_proj[:, l] / sqrt(d_model))        the token's embedding x0 (scaled), projected
    in_l  = (p_l + e_l) / sqrt(2)                        layer l's input, [P]

and at the end of layer l, after its feed-forward,

    x = x + norm(W_proj (gelu(x W_gate) * in_l))         W_gate [d_model, P], W_proj [P, d_model]

(`config.per_layer_width` is P; `per_layer_vocab_size` is V'.) The table makes the model large
and a token's step cheap: a step reads one row of it per token.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.embeddings import lookup
from jaxformer.feedforward import GATES
from jaxformer.norms import rms_norm
from jaxformer.products import product
from jaxformer.sharding import EMBED, LAYERS, MLP, VOCAB, compute_param, param


class PerLayerInputs(nn.Module):
    """Every layer's input of `tokens`: `[batch, T, n_layer, per_layer_width]` in the compute dtype.

    Attributes:
      config: the model's `DecoderConfig` (`per_layer_width`, `per_layer_vocab_size`, `n_layer`).
    """

    config: "DecoderConfig"  # noqa: F821

    @nn.compact
    def __call__(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
        """`tokens` int `[batch, T]` and their embedding `x` `[batch, T, d_model]` as the stream starts
        (scaled by `sqrt(d_model)` where `embed_scale` says so)."""
        c = self.config
        L, P = c.n_layer, c.per_layer_width
        vocab = c.per_layer_vocab_size or c.vocab_size
        init = nn.initializers.normal(0.02)
        table = param(self, "embed", init, (vocab, L, P), (VOCAB, LAYERS, MLP), c.param_dtype)
        w_proj = compute_param(self, "w_proj", init, (c.d_model, L, P), (EMBED, LAYERS, MLP))
        # (The table's scale in the compute dtype, as the stream's; the other two in float32, then rounded.)
        own = lookup(table, tokens).astype(c.dtype) * jnp.asarray(math.sqrt(P), c.dtype)  # [batch, T, L, P]
        projected = times(product("btd,dlp->btlp", x, w_proj), c.d_model ** -0.5)
        projected = rms_norm(c, MLP, name="norm")(projected)  # each layer's P channels
        return times(projected + own, 2 ** -0.5)  # [batch, T, L, P]


def times(a: jax.Array, scale: float) -> jax.Array:
    """`a * scale` in float32, rounded to `a`'s dtype (as torch multiplies a tensor by a Python number)."""
    return (a.astype(jnp.float32) * jnp.float32(scale)).astype(a.dtype)


class PerLayerInput(nn.Module):
    """What layer l adds to the stream from its input: `norm(W_proj (gelu(x W_gate) * in_l))`,
    `[batch, T, d_model]`, from the stream `x` `[batch, T, d_model]` and `in_l` `[batch, T, P]`.

    Attributes:
      config: the model's `DecoderConfig`.
    """

    config: "DecoderConfig"  # noqa: F821

    @nn.compact
    def __call__(self, x: jax.Array, own: jax.Array) -> jax.Array:
        c = self.config
        P = c.per_layer_width
        init = nn.initializers.normal(0.02)
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))  # see GQASelfAttention
        w_gate = compute_param(self, "w_gate", init, (c.d_model, P), (EMBED, MLP))
        w_proj = compute_param(self, "w_proj", residual_init, (P, c.d_model), (MLP, EMBED))
        gated = GATES[c.mlp_activation](product("btd,dp->btp", x, w_gate)) * own  # [batch, T, P]
        return rms_norm(c, name="norm")(product("btp,pd->btd", gated, w_proj))  # [batch, T, d_model]
