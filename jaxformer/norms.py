"""LayerNorm (2017) and RMSNorm (modern) over the last axis; statistics in float32.

RMSNorm drops LayerNorm's centring and bias: cheaper, and in practice as good.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer.sharding import EMBED, param


class RMSNorm(nn.Module):
    """`y = x / sqrt(mean(x^2) + eps) * weight`, cast back to `x.dtype` before the weight
    multiplies (HF Llama's order); with `plus_one`, `* (1 + weight)` in float32 and then
    cast (Gemma's order; its weights start at 0, the identity); with `float32_scale`,
    `* weight` in float32 and then cast (Gemma 4's).

    Attributes:
      eps: added to the mean square before the reciprocal square root.
      param_dtype: storage dtype of the weight.
      plus_one: the weight is stored as its offset from 1 (Gemma).
      axis_name: the logical axis of the normalised channels (`EMBED`, or `HEAD_DIM` for q/k norms).
      float32_scale: the weight multiplies in float32, before the cast (Gemma 4).
      scaled: False: no weight at all, `x / sqrt(mean(x^2) + eps)` (Gemma 4's norm of the values
        and of its router's input).
    """

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32
    plus_one: bool = False
    axis_name: str = EMBED
    float32_scale: bool = False
    scaled: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if not self.scaled:
            return normed.astype(x.dtype)
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        weight = param(self, "weight", init, (x.shape[-1],), (self.axis_name,), self.param_dtype)  # [channels]
        if self.plus_one:
            return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        if self.float32_scale:
            return (normed * weight.astype(jnp.float32)).astype(x.dtype)
        return normed.astype(x.dtype) * weight.astype(x.dtype)


def rms_norm(config, axis_name: str = EMBED, *, name: str, scaled: bool = True) -> RMSNorm:
    """An RMSNorm of the form `config` (a `DecoderConfig`) states for all of its norms: its eps,
    parameter dtype, `norm_plus_one` and `norm_float32_scale`; named `name`."""
    return RMSNorm(config.norm_eps, config.param_dtype, config.norm_plus_one, axis_name, config.norm_float32_scale,
                   scaled, name=name)


class LayerNorm(nn.Module):
    """`y = (x - mean(x)) / sqrt(var(x) + eps) * scale + bias`, as `torch.nn.LayerNorm`.

    Attributes:
      eps: added to the variance before the reciprocal square root.
      param_dtype: storage dtype of `scale` and `bias`.
    """

    eps: float = 1e-5
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = param(self, "scale", nn.initializers.ones, (d,), (EMBED,), self.param_dtype)  # [d_model]
        bias = param(self, "bias", nn.initializers.zeros, (d,), (EMBED,), self.param_dtype)  # [d_model]
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + self.eps)
        return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
