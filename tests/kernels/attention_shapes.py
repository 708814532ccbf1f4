"""The arguments' shapes of a flash-attention kernel, for `jax.export` without arrays."""

import jax
import jax.numpy as jnp


def attention_shapes(batch: int, T: int, S: int, n_head: int, n_kv: int, head_dim: int, dtype) -> tuple:
    """`(q, k, v, q_pos, k_pos, window)` as `jax.ShapeDtypeStruct`s."""
    return (jax.ShapeDtypeStruct((batch, T, n_head, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, S, n_kv, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, S, n_kv, head_dim), dtype),
            jax.ShapeDtypeStruct((batch, T), jnp.int32), jax.ShapeDtypeStruct((batch, S), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32))
