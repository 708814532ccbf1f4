"""Position-wise feed-forward networks: every position transformed on its own."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax

from jaxformer.dropout import Dropout
from jaxformer.lora import project
from jaxformer.products import product
from jaxformer.quantized import QArray
from jaxformer.sharding import EMBED, MLP, Weight, compute_param


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """`(silu(x W_gate) * (x W_up)) W_down`.

    On a CPU its gradient is the hand-written one (`written_swiglu`), which wins there; on a GPU
    or TPU autodiff's (`gated(jax.nn.silu, ...)`): their compilers fold the transposes it
    avoids into the matrix products, and a remat policy sees its products (a custom gradient's
    are hidden from it).

    Args:
      x: `[batch, T, d_model]`.
      w_gate, w_up: `[d_model, ffn_dim]`.
      w_down: `[ffn_dim, d_model]`.

    Returns:
      `[batch, T, d_model]`.
    """
    if any(isinstance(w, QArray) for w in (w_gate, w_up, w_down)):  # frozen: `product`'s gradient is its own
        return gated(jax.nn.silu, x, w_gate, w_up, w_down)
    return jax.lax.platform_dependent(x, w_gate, w_up, w_down, cpu=written_swiglu,
                                      default=functools.partial(gated, jax.nn.silu))


def gated(act, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """`(act(x W_gate) * (x W_up)) W_down`, autodiff's gradient; shapes as `swiglu`."""
    gate = product("btd,df->btf", x, w_gate)  # [batch, T, ffn_dim]
    up = product("btd,df->btf", x, w_up)  # [batch, T, ffn_dim]
    return product("btf,fd->btd", act(gate) * up, w_down)  # [batch, T, d_model]


@jax.custom_vjp
def written_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """`swiglu` with a hand-written gradient (`_swiglu_bwd`)."""
    return _swiglu_fwd(x, w_gate, w_up, w_down)[0]


def _swiglu_fwd(x, w_gate, w_up, w_down):
    gate = product("btd,df->btf", x, w_gate)  # [batch, T, ffn_dim]
    up = product("btd,df->btf", x, w_up)  # [batch, T, ffn_dim]
    y = product("btf,fd->btd", jax.nn.silu(gate) * up, w_down)  # [batch, T, d_model]
    return y, (x, w_gate, w_up, w_down, gate, up)  # what the backward pass reads


def _swiglu_bwd(residuals, dy):
    """The gradients of `y = h W_down`, `h = silu(gate) * up`, `gate = x W_gate`, `up = x W_up`.

    Autodiff's layout transposes two `ffn_dim`-wide activations per layer on a CPU; here
    each weight gradient contracts a `d_model`-wide operand first, so only `x` and `dy`
    are transposed (docs/performance.md, "Training steps").
    """
    x, w_gate, w_up, w_down, gate, up = residuals
    sig = jax.nn.sigmoid(gate)  # [batch, T, ffn_dim]
    silu = gate * sig  # silu(z) = z sigmoid(z)
    d_silu = sig * (1 + gate * (1 - sig))  # silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))
    h = silu * up  # [batch, T, ffn_dim]
    # dW_down = h^T dy, formed as (dy^T h)^T: [d_model, ffn_dim], then transposed (small).
    d_w_down = product("btd,btf->df", dy, h).T  # [ffn_dim, d_model]
    dh = product("btd,fd->btf", dy, w_down)  # [batch, T, ffn_dim], dy W_down^T
    d_up = dh * silu  # [batch, T, ffn_dim]
    d_gate = dh * up * d_silu  # [batch, T, ffn_dim]
    dx = product("btf,df->btd", d_gate, w_gate) + product("btf,df->btd", d_up, w_up)  # [batch, T, d_model]
    d_w_gate = product("btd,btf->df", x, d_gate)  # [d_model, ffn_dim], x^T dgate
    d_w_up = product("btd,btf->df", x, d_up)  # [d_model, ffn_dim], x^T dup
    return dx, d_w_gate, d_w_up, d_w_down


written_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def gelu_tanh(z: jax.Array) -> jax.Array:
    """GELU's tanh approximation (Gemma's `gelu_pytorch_tanh`), `0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))`."""
    return jax.nn.gelu(z, approximate=True)


GATED_FFNS = {"silu": swiglu, "gelu_tanh": functools.partial(gated, gelu_tanh)}  # `mlp_activation` -> its FFN
GATES = {"silu": jax.nn.silu, "gelu_tanh": gelu_tanh}  # ... and its gate's nonlinearity


@dataclasses.dataclass(frozen=True)
class GatedMLPSpec:
    """The "gated MLP" feed-forward kind of a decoder layer: `W_down (act(x W_gate) * (x W_up))`.

    Attributes:
      width: the hidden width (`ffn_dim`).
      activation: the gate's nonlinearity, a key of `GATES`: "silu" (SwiGLU, Llama) or
        "gelu_tanh" (GeGLU, Gemma).
    """

    width: int
    activation: str = "silu"

    def build(self, config, name: str) -> "GatedMLP":
        """The module of a layer of this spec, named `name` in its block."""
        return GatedMLP(config, self, name=name)

    def weights(self, d_model: int) -> dict[str, Weight]:
        """The three matrices, by name (as `AttentionSpec.weights`)."""
        return {"w_gate": Weight((d_model, self.width), (EMBED, MLP)),
                "w_up": Weight((d_model, self.width), (EMBED, MLP)),
                "w_down": Weight((self.width, d_model), (MLP, EMBED))}


class GatedMLP(nn.Module):
    """`W_down (act(x W_gate) * (x W_up))`: a gated FFN with three matrices (a feed-forward of
    kind `GatedMLPSpec`).

    Attributes:
      config: the model's `DecoderConfig` (`d_model`, `n_layer`, LoRA, dtypes).
      spec: this layer's `GatedMLPSpec`; None: the config's (`ffn_dim`, `mlp_activation`).
    """

    config: "DecoderConfig"  # noqa: F821
    spec: GatedMLPSpec | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        spec = self.spec or GatedMLPSpec(c.ffn_dim, c.mlp_activation)
        init = nn.initializers.normal(0.02)
        residual_init = nn.initializers.normal(0.02 / math.sqrt(2 * c.n_layer))  # see GQASelfAttention
        weights = spec.weights(c.d_model)
        w_gate, w_up = (compute_param(self, name, init, *weights[name][:2]) for name in ("w_gate", "w_up"))
        w_down = compute_param(self, "w_down", residual_init, *weights["w_down"][:2])
        if c.lora is None or not c.lora.matrices & {"w_gate", "w_up", "w_down"}:
            return GATED_FFNS[spec.activation](x, w_gate, w_up, w_down)  # [batch, T, d_model]
        # With adapters, each product is `project`'s (the FFNs above take bare matrices).
        gate, up = project(self, x, ("w_gate", "btd,df->btf", w_gate), ("w_up", "btd,df->btf", w_up))  # [b, T, ffn]
        (y,) = project(self, GATES[spec.activation](gate) * up, ("w_down", "btf,fd->btd", w_down))
        return y  # [batch, T, d_model]


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
        hidden = jax.nn.relu(product("btd,df->btf", x, w1) + b1)  # [batch, T, ffn]
        hidden = Dropout(c.dropout)(hidden, deterministic=deterministic)
        return product("btf,fd->btd", hidden, w2) + b2  # [batch, T, d_model]

