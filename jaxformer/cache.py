"""The KV cache: an immutable pytree of fixed shape, one write position per row.

A model call takes a cache and returns a new one; under `jit` XLA makes the writes in
place, and `capacity` fixes every shape, so one compiled step serves every position. Keys
are stored after RoPE (a cached key never moves again) and with `n_kv_head` heads (GQA
saves memory only if K/V are not repeated first). Why a scanned model's stack is the
scan's carry: docs/architecture.md, "Scanned layers"; the rows: docs/decoding.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxformer.config import DecoderConfig
from jaxformer.memory import check_fits
from jaxformer.validation import as_int, floating_dtype, is_traced


def write_rows(array: jax.Array, new: jax.Array, pos: jax.Array, *, axis: int, layer=None) -> jax.Array:
    """`array` `[batch, ..., capacity, ...]` with row b's `new[b]` (T slots) written from slot
    `pos[b]` along `axis` (2 in a stacked cache, whose `layer` is then the one written): one
    `dynamic_update_slice` per row, vectorised, which XLA makes one in-place scatter."""
    def one_row(row, new_row, start):  # row [..., capacity, ...] (the batch axis taken off)
        index = [jnp.zeros((), jnp.int32)] * row.ndim
        index[axis - 1] = start
        if layer is not None:
            index[0] = layer
        return jax.lax.dynamic_update_slice(row, new_row.astype(row.dtype), index)

    return jax.vmap(one_row)(array, new, pos)


@struct.dataclass
class LayerKV:
    """One layer's cached keys and values."""

    k: jax.Array  # [batch, capacity, n_kv_head, head_dim]
    v: jax.Array  # [batch, capacity, n_kv_head, head_dim]

    def write(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array) -> "LayerKV":
        """A copy with row b's `k_new` / `v_new` `[batch, T, n_kv, head_dim]` at slots
        `pos[b] .. pos[b] + T - 1`; a start past the capacity clamps (see `KVCache.commit`)."""
        return LayerKV(k=write_rows(self.k, k_new, pos, axis=1), v=write_rows(self.v, v_new, pos, axis=1))

    def read(self) -> tuple[jax.Array, jax.Array]:
        """The keys and values attention reads, `[batch, capacity, n_kv, head_dim]` each."""
        return self.k, self.v


@struct.dataclass
class LayerSlice:
    """Layer `layer` of a stacked cache, as the scanned block sees it: `write` updates that
    layer's slots of the whole stack in place, `read` slices it out."""

    stack: LayerKV  # k, v: [batch, n_layer, capacity, n_kv_head, head_dim]
    layer: jax.Array  # [] int32, the block this slice belongs to

    def write(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array) -> "LayerSlice":
        """`LayerKV.write` into layer `layer` of the stack."""
        stack = self.stack
        return self.replace(stack=LayerKV(k=write_rows(stack.k, k_new[:, None], pos, axis=2, layer=self.layer),
                                          v=write_rows(stack.v, v_new[:, None], pos, axis=2, layer=self.layer)))

    def read(self) -> tuple[jax.Array, jax.Array]:
        """This layer's keys and values, `[batch, capacity, n_kv, head_dim]` each."""
        return (jax.lax.dynamic_index_in_dim(self.stack.k, self.layer, axis=1, keepdims=False),
                jax.lax.dynamic_index_in_dim(self.stack.v, self.layer, axis=1, keepdims=False))

    def next_layer(self) -> "LayerSlice":
        """The slice the next block of the scan reads and writes."""
        return self.replace(layer=self.layer + 1)


@struct.dataclass
class KVCache:
    """Per-layer keys and values, and each row's write position.

    Attributes:
      layers: one `LayerKV` per block, or, for a scanned model, one whose k and v stack
        every block's: `[batch, n_layer, capacity, n_kv_head, head_dim]`.
      pos: int32 `[batch]`, the slots written in each row: row b's next token goes to slot
        `pos[b]`, which is its position. The model advances it once per call, after all layers.
    """

    layers: tuple[LayerKV, ...] | LayerKV
    pos: jax.Array  # [batch] int32

    @classmethod
    def create(cls, config, batch_size: int, capacity: int | None = None, dtype=None) -> "KVCache":
        """An empty cache for the decoder-only model of `config` (a `DecoderConfig`).

        Args:
          config: the model's `DecoderConfig` (the encoder-decoder's cache comes from
            `VanillaTransformer.init_cache`).
          batch_size: sequences decoded together.
          capacity: positions, at most (and by default) `max_seq_len`: RoPE has no angles beyond.
          dtype: a floating storage dtype; defaults to the config's `cache_dtype`, else `dtype`.
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
          batch_size: rows, an int >= 1.
          capacity: positions, in `[1, max_seq_len]`; None for `max_seq_len`.
          dtype: a floating storage dtype (an integer cache would round every key and value).
          stacked: one `[batch, n_layer, ...]` array for k and one for v (a scanned model's).

        Raises:
          ValueError: an argument out of its limits, or more memory than is free.
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
        return cls(layers=layers, pos=jnp.zeros((batch_size,), jnp.int32))

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
        """Tokens written so far in each row, `[batch]` (`pos`)."""
        return self.pos

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes across all layers and rows: `2 * L * B * n_kv * d * itemsize`."""
        return sum(array.nbytes for array in jax.tree.leaves(self.layers)) // self.capacity

    @property
    def nbytes(self) -> int:
        """Bytes allocated (all `capacity` positions)."""
        return self.bytes_per_token * self.capacity

    @property
    def bytes_used(self) -> int:
        """Bytes holding written tokens, summed over the rows (host-side: reads `pos`)."""
        return int(np.sum(np.asarray(self.pos))) * self.bytes_per_token // self.batch_size

    def advance(self, n_tokens) -> "KVCache":
        """The same slots with every row's `pos` moved `n_tokens` on (a scalar, or `[batch]`)."""
        return self.replace(pos=self.pos + n_tokens)

    def commit(self, layers, logits: jax.Array, n_tokens: int) -> tuple[jax.Array, "KVCache"]:
        """Ends a model call whose every layer wrote `n_tokens` (static) at each row's slots `pos[b] ..`.

        `pos` advances once, after every layer. `dynamic_update_slice` clamps a write past the
        capacity: concrete inputs are refused before (`validation.check_cache_step`), and inside
        `jit` such a row's logits `[batch, T, vocab]` become NaN. Returns `(logits, cache)`.
        """
        fits = self.pos + n_tokens <= self.capacity  # [batch]
        logits = jnp.where(fits[:, None, None], logits, jnp.nan)
        layers = layers if isinstance(layers, LayerKV) else tuple(layers)
        return logits, self.replace(layers=layers).advance(n_tokens)

    # Row operations, what a continuous-batching engine needs: a finished request leaves
    # its row (`evict`), a new one is prefilled alone and joins (`insert`), the other
    # rows keep their state. `row` may be traced; a concrete one is checked.

    def evict(self, row) -> "KVCache":
        """Row `row` emptied: its keys and values zeroed and its `pos` 0, as in a new cache."""
        row = self._row(row, "evict")
        def clear(leaf):
            return jax.lax.dynamic_update_index_in_dim(leaf, jnp.zeros(leaf.shape[1:], leaf.dtype), row, axis=0)

        evicted = self.replace(layers=jax.tree.map(clear, self.layers),
                               pos=jax.lax.dynamic_update_index_in_dim(self.pos, jnp.zeros((), jnp.int32), row, 0))
        return evicted._poisoned_unless_in_range(row)

    def insert(self, row, other: "KVCache") -> "KVCache":
        """Row `row` replaced by the single row of `other`, a one-row cache of the same layout (a
        prompt prefilled alone into `model.init_cache(1, cache.capacity)`).

        Raises:
          ValueError: `other` is not one row of this cache's layout, or `row` is out of range.
        """
        row = self._row(row, "insert")
        want = (1, *self.layer_shape[1:])
        if other.stacked != self.stacked or other.layer_shape != want or other.n_layer != self.n_layer:
            raise ValueError(f"KVCache.insert: other must be a one-row cache of layer shape {want} "
                             f"({'stacked' if self.stacked else 'per layer'}, {self.n_layer} layers), got "
                             f"{other.layer_shape} ({'stacked' if other.stacked else 'per layer'}, "
                             f"{other.n_layer} layers)")
        def put(leaf, new):
            return jax.lax.dynamic_update_slice_in_dim(leaf, new.astype(leaf.dtype), row, axis=0)

        inserted = self.replace(layers=jax.tree.map(put, self.layers, other.layers),
                                pos=jax.lax.dynamic_update_slice_in_dim(self.pos, other.pos, row, axis=0))
        return inserted._poisoned_unless_in_range(row)

    def _poisoned_unless_in_range(self, row) -> "KVCache":
        """Under `jit` a row index cannot raise, and `dynamic_update_slice` would clamp it onto
        another row: an out-of-range traced `row` makes every key and value NaN instead, so the
        logits read from the cache are NaN, loud (a concrete `row` was refused by `_row`)."""
        if not is_traced(row):
            return self
        in_range = (row >= 0) & (row < self.batch_size)
        return self.replace(layers=jax.tree.map(lambda leaf: jnp.where(in_range, leaf, jnp.nan), self.layers))

    def _row(self, row, operation: str):
        """`row` checked against the batch where it is concrete (a traced one is used as is)."""
        if is_traced(row):
            return row
        return as_int(row, f"KVCache.{operation}: row", minimum=0, maximum=self.batch_size - 1,
                      maximum_name="batch_size - 1")
