"""The KV cache: an immutable pytree of fixed shape.

Autoregressive decoding feeds one new token per step; the keys and values of the
tokens before it do not change, so each layer keeps them instead of recomputing the
prefix. Here the cache is a value, not a buffer: a model call takes a cache and
returns a new one. Under `jit` XLA turns the `dynamic_update_slice` writes into in-place
updates, and because every shape is fixed by `capacity`, one compiled step serves every
position.

Keys are stored after RoPE (a cached key never moves again) and with only `n_kv_head`
heads: grouped-query attention saves memory only if K/V are not repeated first.

A model whose blocks run as one scanned block (`DecoderConfig.scan_layers`) keeps every
layer's keys in one array `[batch, n_layer, capacity, n_kv_head, head_dim]` (and the
values in another), the scan's carry: each block writes its own layer's slots in place
(`LayerSlice`). Carried, not scanned over: a scanned-over cache would come out of the loop
as a new stacked array, a copy of the whole cache at every step. The batch stays first, as
in every other cache, so code that reorders or shards rows (beam search, meshes) treats
both forms alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxformer.config import DecoderConfig
from jaxformer.memory import check_fits
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

    def read(self) -> tuple[jax.Array, jax.Array]:
        """The keys and values attention reads, `[batch, capacity, n_kv, head_dim]` each."""
        return self.k, self.v


@struct.dataclass
class LayerSlice:
    """One layer of a stacked cache, as the scanned block at `layer` sees it.

    The stack is the scan's carry, so `write` updates one layer's slots of the whole
    stack in place, and `read` slices that layer out for attention.
    """

    stack: LayerKV  # k, v: [batch, n_layer, capacity, n_kv_head, head_dim]
    layer: jax.Array  # [] int32, the block this slice belongs to

    def write(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array) -> "LayerSlice":
        """`LayerKV.write` into layer `layer` of the stack (same clamping caveat)."""
        start = (0, self.layer, pos, 0, 0)
        stack = self.stack
        return self.replace(stack=LayerKV(
            k=jax.lax.dynamic_update_slice(stack.k, k_new[:, None].astype(stack.k.dtype), start),
            v=jax.lax.dynamic_update_slice(stack.v, v_new[:, None].astype(stack.v.dtype), start)))

    def read(self) -> tuple[jax.Array, jax.Array]:
        """This layer's keys and values, `[batch, capacity, n_kv, head_dim]` each."""
        return (jax.lax.dynamic_index_in_dim(self.stack.k, self.layer, axis=1, keepdims=False),
                jax.lax.dynamic_index_in_dim(self.stack.v, self.layer, axis=1, keepdims=False))

    def next_layer(self) -> "LayerSlice":
        """The slice the next block of the scan reads and writes."""
        return self.replace(layer=self.layer + 1)


@struct.dataclass
class KVCache:
    """Per-layer keys and values, the write position, and each row's first real slot.

    Attributes:
      layers: one `LayerKV` per block, or, for a scanned model (`scan_layers`), one
        `LayerKV` whose k and v stack every block's: `[batch, n_layer, capacity, n_kv_head,
        head_dim]`.
      pos: int32 scalar, the number of slots already written. The model advances it
        once per call, after all layers, so every layer of one call writes at the same
        slots.
      start: int32 `[batch]`, the slot holding each row's first real token. Prompts of
        different lengths share one cache by left padding: row b's slots before
        `start[b]` are padding, never attended to, and its token in slot s sits at
        position `s - start[b]`. All zeros when every row is full.
    """

    layers: tuple[LayerKV, ...] | LayerKV
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
                         dtype=config.cache_storage_dtype if dtype is None else dtype, stacked=config.scan_layers)

    @classmethod
    def zeros(cls, batch_size: int, capacity: int | None, *, n_layer: int, n_kv_head: int, head_dim: int,
              max_seq_len: int, dtype, stacked: bool = False) -> "KVCache":
        """An empty cache of `n_layer` layers of `[batch_size, capacity, n_kv_head, head_dim]`.

        Args:
          batch_size: rows, an integral scalar >= 1 (a numpy int too).
          capacity: positions, in `[1, max_seq_len]`; None for `max_seq_len`.
          dtype: a floating storage dtype, as the configs' `cache_dtype`: an integer or
            bool cache would round every key and value, and the logits with them.
          stacked: one `[batch, n_layer, ...]` array for k and one for v (a scanned
            model's cache) instead of one pair per layer.

        Raises:
          ValueError: naming `batch_size`, `capacity` or `dtype` when out of its limits, or
            a cache that needs more memory than is free (`jaxformer.memory.check_fits`).
        """
        batch_size = as_int(batch_size, "KVCache.create: batch_size", minimum=1)
        capacity = as_int(max_seq_len if capacity is None else capacity, "KVCache.create: capacity", minimum=1,
                          maximum=max_seq_len, maximum_name="max_seq_len")
        storage = floating_dtype(dtype)
        if storage is None:
            raise ValueError(f"KVCache.create: dtype must be a floating dtype, as the configs' cache_dtype "
                             f"(got {dtype!r})")
        shape = (batch_size, capacity, n_kv_head, head_dim)
        # A checkpoint's max_seq_len (the default capacity) may be 10**12: refuse, do not allocate.
        check_fits(2 * n_layer * math.prod(shape) * storage.itemsize,
                   f"KVCache.create: a cache of {capacity:,} positions (capacity, default max_seq_len)")
        if stacked:
            stacked_shape = (batch_size, n_layer, *shape[1:])
            layers = LayerKV(k=jnp.zeros(stacked_shape, storage), v=jnp.zeros(stacked_shape, storage))
        else:
            layers = tuple(LayerKV(k=jnp.zeros(shape, storage), v=jnp.zeros(shape, storage)) for _ in range(n_layer))
        return cls(layers=layers, pos=jnp.zeros((), jnp.int32), start=jnp.zeros((batch_size,), jnp.int32))

    @property
    def stacked(self) -> bool:
        """Whether the layers are stacked in one array (a scanned model's cache)."""
        return isinstance(self.layers, LayerKV)

    @property
    def n_layer(self) -> int:
        return self.layers.k.shape[1] if self.stacked else len(self.layers)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's k (or v) shape, `(batch, capacity, n_kv_head, head_dim)`."""
        if self.stacked:
            batch, _, capacity, n_kv_head, head_dim = self.layers.k.shape
            return batch, capacity, n_kv_head, head_dim
        return self.layers[0].k.shape

    @property
    def batch_size(self) -> int:
        return self.layer_shape[0]

    @property
    def capacity(self) -> int:
        """Positions allocated (static)."""
        return self.layer_shape[1]

    @property
    def length(self) -> jax.Array:
        """Tokens written so far (`pos`; `int(cache.length)` outside `jit`)."""
        return self.pos

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes across all layers and the batch: `2 * L * B * n_kv * d * itemsize`."""
        return sum(array.nbytes for array in jax.tree.leaves(self.layers)) // self.capacity

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
          layers: the `LayerKV`s the call returned, one per layer (or the stacked one).
          logits: the call's logits.
          n_tokens: the tokens the call wrote (static).

        Returns:
          `(logits, cache)`: the logits (NaN if the writes did not fit) and the cache
          holding `layers` with `pos + n_tokens`.
        """
        logits = jnp.where(self.pos + n_tokens <= self.capacity, logits, jnp.nan)
        layers = layers if isinstance(layers, LayerKV) else tuple(layers)
        return logits, self.replace(layers=layers).advance(n_tokens)
