"""The KV cache: an immutable pytree of fixed shape.

Autoregressive decoding feeds one new token per step; the keys and values of the
tokens before it do not change, so each layer keeps them instead of recomputing the
prefix. Here the cache is a value, not a buffer: a model call takes a cache and
returns a new one. Under `jit` XLA turns the `dynamic_update_slice` writes into in-place
updates, and because every shape is fixed by `capacity`, one compiled step serves every
position.

Keys are stored after RoPE (a cached key never moves again) and with only `n_kv_head`
heads: grouped-query attention saves memory only if K/V are not repeated first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.config import DecoderConfig
from jaxformer.validation import as_int, floating_dtype


@struct.dataclass
class LayerKV:
    """One layer's cached keys and values."""

    k: jax.Array  # [batch, capacity, n_kv_head, head_dim]
    v: jax.Array  # [batch, capacity, n_kv_head, head_dim]

    def write(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array) -> "LayerKV":
        """Returns a copy with `k_new` / `v_new` (`[batch, T, n_kv, head_dim]`) at slots `pos .. pos+T-1`.

        `dynamic_update_slice` clamps a start that does not fit instead of failing, which
        would overwrite the last slots; callers check `pos + T <= capacity` where the
        numbers are concrete (`validation.check_step_inputs`) and `commit` poisons the
        logits where they are not.
        """
        start = (0, pos, 0, 0)
        return LayerKV(
            k=jax.lax.dynamic_update_slice(self.k, k_new.astype(self.k.dtype), start),
            v=jax.lax.dynamic_update_slice(self.v, v_new.astype(self.v.dtype), start),
        )


@struct.dataclass
class KVCache:
    """Per-layer keys and values, the write position, and each row's first real slot.

    Attributes:
      layers: one `LayerKV` per block.
      pos: int32 scalar, the number of slots already written. The model advances it
        once per call, after all layers, so every layer of one call writes at the same
        slots.
      start: int32 `[batch]`, the slot holding each row's first real token. Prompts of
        different lengths share one cache by left padding: row b's slots before
        `start[b]` are padding, never attended to, and its token in slot s sits at
        position `s - start[b]`. All zeros when every row is full.
    """

    layers: tuple[LayerKV, ...]
    pos: jax.Array  # [] int32
    start: jax.Array  # [batch] int32

    @classmethod
    def create(cls, config, batch_size: int, capacity: int | None = None, dtype=None) -> "KVCache":
        """An empty cache for the decoder-only model of `config` (a `DecoderConfig`).

        (The encoder-decoder's decoder cache comes from `VanillaTransformer.init_cache`.)

        Args:
          config: the model's `DecoderConfig`.
          batch_size: number of sequences decoded together.
          capacity: positions to allocate; defaults to `config.max_seq_len`, which is also
            its upper limit (RoPE has no angles beyond it).
          dtype: a floating storage dtype; defaults to the config's `cache_dtype`, else
            its `dtype`.

        Returns:
          A `KVCache` of zeros with `pos == 0`.

        Raises:
          TypeError: `config` is not a `DecoderConfig`.
          ValueError: see `zeros`.
        """
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"KVCache.create takes a DecoderConfig, got {type(config).__name__}; for the "
                            "encoder-decoder use VanillaTransformer(config).init_cache(batch_size)")
        return cls.zeros(batch_size, capacity, n_layer=config.n_layer, n_kv_head=config.n_kv_head,
                         head_dim=config.head_dim, max_seq_len=config.max_seq_len,
                         dtype=config.cache_storage_dtype if dtype is None else dtype)

    @classmethod
    def zeros(cls, batch_size: int, capacity: int | None, *, n_layer: int, n_kv_head: int, head_dim: int,
              max_seq_len: int, dtype) -> "KVCache":
        """An empty cache of `n_layer` layers of `[batch_size, capacity, n_kv_head, head_dim]`.

        Args:
          batch_size: rows, an integral scalar >= 1 (a numpy int too).
          capacity: positions, in `[1, max_seq_len]`; None for `max_seq_len`.
          dtype: a floating storage dtype, as the configs' `cache_dtype`: an integer or
            bool cache would round every key and value, and the logits with them.

        Raises:
          ValueError: naming `batch_size`, `capacity` or `dtype` when out of its limits.
        """
        batch_size = as_int(batch_size, "KVCache.create: batch_size", minimum=1)
        capacity = as_int(max_seq_len if capacity is None else capacity, "KVCache.create: capacity", minimum=1,
                          maximum=max_seq_len, maximum_name="max_seq_len")
        storage = floating_dtype(dtype)
        if storage is None:
            raise ValueError(f"KVCache.create: dtype must be a floating dtype, as the configs' cache_dtype "
                             f"(got {dtype!r})")
        shape = (batch_size, capacity, n_kv_head, head_dim)
        layers = tuple(LayerKV(k=jnp.zeros(shape, storage), v=jnp.zeros(shape, storage)) for _ in range(n_layer))
        return cls(layers=layers, pos=jnp.zeros((), jnp.int32), start=jnp.zeros((batch_size,), jnp.int32))

    @property
    def batch_size(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def capacity(self) -> int:
        """Positions allocated (static)."""
        return self.layers[0].k.shape[1]

    @property
    def length(self) -> jax.Array:
        """Tokens written so far (`pos`; `int(cache.length)` outside `jit`)."""
        return self.pos

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes across all layers and the batch: `2 * L * B * n_kv * d * itemsize`."""
        return sum(layer.k.nbytes + layer.v.nbytes for layer in self.layers) // self.capacity

    @property
    def nbytes(self) -> int:
        """Bytes allocated (all `capacity` positions)."""
        return self.bytes_per_token * self.capacity

    @property
    def bytes_used(self) -> int:
        """Bytes holding written tokens, `length * bytes_per_token` (host-side: reads `pos`)."""
        return int(self.pos) * self.bytes_per_token

    def advance(self, n_tokens: int) -> "KVCache":
        """The same slots with `pos` moved `n_tokens` on."""
        return self.replace(pos=self.pos + n_tokens)

    def commit(self, layers, logits: jax.Array, n_tokens: int) -> tuple[jax.Array, "KVCache"]:
        """Ends a model call whose `n_tokens` tokens every layer wrote at slots `pos ..`.

        `pos` advances once, after every layer, so all layers of one call write at the
        same slots. Past the capacity `dynamic_update_slice` clamps the writes instead of
        failing; concrete inputs are refused before (`validation.check_step_inputs`),
        and inside `jit` the logits become NaN: loud, never silently wrong.

        Args:
          layers: the `LayerKV`s the call returned, one per layer.
          logits: the call's logits.
          n_tokens: the tokens the call wrote (static).

        Returns:
          `(logits, cache)`: the logits (NaN if the writes did not fit) and the cache
          holding `layers` with `pos + n_tokens`.
        """
        logits = jnp.where(self.pos + n_tokens <= self.capacity, logits, jnp.nan)
        return logits, self.replace(layers=tuple(layers)).advance(n_tokens)
