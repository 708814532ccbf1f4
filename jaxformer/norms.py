"""RMSNorm: LayerNorm without the mean subtraction and without a bias.

(The 2017 model's LayerNorm is flax's `nn.LayerNorm`.)
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    """`y = x / sqrt(mean(x^2) + eps) * weight`, normalised over the last axis.

    The mean square is accumulated in float32 even for bf16 activations, the result is
    cast back to the activation dtype, and only then multiplied by the weight (HF Llama
    does the same, in that order). Unlike LayerNorm the output is not centred.

    Attributes:
      eps: added to the mean square before the reciprocal square root.
      param_dtype: storage dtype of the weight.
    """

    eps: float = 1e-6
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.param_dtype)  # [d_model]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype) * weight.astype(x.dtype)
