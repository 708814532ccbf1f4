"""The KV cache: an immutable pytree of fixed shape, one write position per row.

A model call takes a cache and returns a new one; under `jit` XLA makes the writes in
place, and `capacity` fixes every shape, so one compiled step serves every position. Keys
are stored after RoPE (a cached key never moves again) and with `n_kv_head` heads (GQA
saves memory only if K/V are not repeated first). A sliding-window layer keeps only the
slots its window can read, as a ring (`RingKV`). Why a scanned model's stack is the scan's
carry: docs/architecture.md, "Scanned layers"; the rows and the rings: docs/decoding.md.
"""

from __future__ import annotations

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
        index[axis - 1] = jnp.asarray(start, jnp.int32)  # (int32 alike, with 64-bit integers enabled too)
        if layer is not None:
            index[0] = jnp.asarray(layer, jnp.int32)
        return jax.lax.dynamic_update_slice(row, new_row.astype(row.dtype), index)

    return jax.vmap(one_row)(array, new, pos)


def layer_of(stack: jax.Array, layer: jax.Array) -> jax.Array:
    """Layer `layer` (traced) of a stacked array: `[batch, n_layer, slots, ...] -> [batch, slots, ...]`."""
    return jax.lax.dynamic_index_in_dim(stack, layer, axis=1, keepdims=False)


class OneKind:
    """`attend` for a view that reads one kind of slots (the views' protocol: see `KVCache.layer`)."""

    def attend(self, attention, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None, span=None):
        """`(attention(keys, values), view)`: `extend`'s keys and values attended to, and the view written."""
        (keys, values), written = self.extend(k_new, v_new, pos, stop, span)
        return attention(keys, values), written


@struct.dataclass
class LayerKV(OneKind):
    """One layer's cached keys and values (or, in a stacked cache, every layer's)."""

    k: jax.Array  # [batch, capacity, n_kv_head, head_dim] ([batch, n_layer, ...] stacked)
    v: jax.Array  # [batch, capacity, n_kv_head, head_dim] ([batch, n_layer, ...] stacked)

    def write(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array) -> "LayerKV":
        """A copy with row b's `k_new` / `v_new` `[batch, T, n_kv, head_dim]` at slots
        `pos[b] .. pos[b] + T - 1`; a start past the capacity clamps (see `KVCache.commit`)."""
        return LayerKV(k=write_rows(self.k, k_new, pos, axis=1), v=write_rows(self.v, v_new, pos, axis=1))

    def read(self, span: int) -> tuple[jax.Array, jax.Array]:
        """The keys and values attention reads, slots `0 .. span - 1`: `[batch, span, n_kv,
        head_dim]` each (a static slice, so a call costs its span, not the capacity)."""
        return self.k[:, :span], self.v[:, :span]

    def extend(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None, span=None):
        """`((keys, values), layer)`: this call's K/V written at their slots, then slots `0 ..
        span - 1` read, `[batch, span, ...]` (a slot's position is its index; None: every slot).
        `stop` is for rings."""
        written = self.write(k_new, v_new, pos)
        return written.read(self.k.shape[1] if span is None else span), written

    def extend_layer(self, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None,
                     span=None):
        """`extend` on layer `layer` of this stack: that layer's slots written in place, then read."""
        stack = LayerKV(k=write_rows(self.k, k_new[:, None], pos, axis=2, layer=layer),
                        v=write_rows(self.v, v_new[:, None], pos, axis=2, layer=layer))
        span = stack.k.shape[2] if span is None else span  # slots 0 .. span - 1 of the layer are read
        return (layer_of(stack.k[:, :, :span], layer), layer_of(stack.v[:, :, :span], layer)), stack


def ring_positions(pos: jax.Array, slots: int) -> jax.Array:
    """`[batch, slots]` int32: the position ring slot s holds in row b before a call that
    starts at `pos[b]`: the latest `p < pos[b]` with `p % slots == s`; negative where none."""
    s = jnp.arange(slots)[None, :]
    last = pos[:, None] - 1  # [batch, 1], the newest written position
    return last - jnp.mod(last - s, slots)


def ring_write(array: jax.Array, new: jax.Array, pos: jax.Array, stop, *, layer=None) -> jax.Array:
    """`array` `[batch, slots, ...]` (`[batch, n_layer, slots, ...]` with `layer`) with row b's
    `new[b]` (T tokens at positions `pos[b] ..`) in slots `position % slots`: only the last
    `slots` positions before `stop[b]` (default `pos[b] + T`) are written, the rest dropped,
    so no slot is written twice and a ragged batch's padding never enters the ring."""
    T, slots = new.shape[1], array.shape[1 if layer is None else 2]
    position = pos[:, None] + jnp.arange(T)[None, :]  # [batch, T]
    end = pos[:, None] + T if stop is None else jnp.minimum(pos + T, stop)[:, None]
    keep = (position < end) & (position >= end - slots)  # [batch, T]
    slot = jnp.where(keep, jnp.mod(position, slots), slots)  # `slots` is out of range: dropped

    def one_row(row, new_row, slot_row):  # row [slots, ...] or [n_layer, slots, ...]
        index = slot_row if layer is None else (layer, slot_row)
        return row.at[index].set(new_row.astype(row.dtype), mode="drop")

    return jax.vmap(one_row)(array, new, slot)


@struct.dataclass
class RingKV(OneKind):
    """A sliding-window layer's keys and values: `slots` of them, position p in slot `p % slots`.

    A query at position q reads keys in `(q - window, q]`; `slots = window - 1 + rewind`
    keeps all of those from before the call (this call's own keys are read as they come, not
    from the ring), and `rewind` more, so a row set back by up to `rewind` positions (a
    speculative round's rejected tokens) still finds its window: slots a rejected token
    overwrote held positions that no later query reads.
    """

    k: jax.Array  # [batch, slots, n_kv_head, head_dim] ([batch, n_layer, ...] stacked)
    v: jax.Array  # [batch, slots, n_kv_head, head_dim] ([batch, n_layer, ...] stacked)

    def write(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None) -> "RingKV":
        """A copy with this call's K/V `[batch, T, n_kv, head_dim]` in the ring (`ring_write`)."""
        return RingKV(k=ring_write(self.k, k_new, pos, stop), v=ring_write(self.v, v_new, pos, stop))

    def extend(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None, span=None):
        """`((keys, values), ring)`: the ring's slots before this call, then this call's own K/V,
        `[batch, slots + T, ...]` (positions `ring_positions(pos, slots)`, then `pos ..`); the
        ring returned has them written. (`span` is for full layers: a ring is read whole.)"""
        keys = jnp.concatenate([self.k, k_new.astype(self.k.dtype)], axis=1)
        values = jnp.concatenate([self.v, v_new.astype(self.v.dtype)], axis=1)
        return (keys, values), self.write(k_new, v_new, pos, stop)

    def extend_layer(self, layer: jax.Array, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None,
                     span=None):
        """`extend` on layer `layer` of this stack of rings: its slots read, then written in place."""
        keys = jnp.concatenate([layer_of(self.k, layer), k_new.astype(self.k.dtype)], axis=1)
        values = jnp.concatenate([layer_of(self.v, layer), v_new.astype(self.v.dtype)], axis=1)
        return (keys, values), RingKV(k=ring_write(self.k, k_new, pos, stop, layer=layer),
                                      v=ring_write(self.v, v_new, pos, stop, layer=layer))


@struct.dataclass
class LayerSlice(OneKind):
    """Layer `layer` of a stacked cache (a scanned model's), as its block sees it: `extend`
    writes that layer's slots of the whole stack in place and reads that layer."""

    stack: LayerKV | RingKV  # k, v: [batch, n_layer, slots, n_kv_head, head_dim]
    layer: jax.Array  # [] int32, the block's index in this stack

    def extend(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None, span=None):
        """`LayerKV.extend` or `RingKV.extend` on layer `layer` of the stack."""
        keys_values, stack = self.stack.extend_layer(self.layer, k_new, v_new, pos, stop, span)
        return keys_values, self.replace(stack=stack)


@struct.dataclass
class SplitSlice:
    """A layer of `SplitStacks`: its slices of the full stack and of the rings, at its index in
    its own stack (the other one's is never read), and `ring`, which of the two it is. Their
    keys differ in number, so `attend` runs attention on one of them (`lax.cond`), or where
    the layer's `kinds` are one type (its scanned block's specs), on that one's alone."""

    full: LayerSlice
    sliding: LayerSlice
    ring: jax.Array  # [] bool
    kinds: tuple[str, ...] = struct.field(pytree_node=False, default=("full", "sliding"))

    def attend(self, attention, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None, span=None):
        """`((out, None), view)`: `attention(keys, values, kind)`'s first output, with the keys and
        values of the stack of the layer's kind (`kind` "full" or "sliding": the masks differ too),
        and that stack written. (Its weights are dropped: the two kinds' differ in shape.)"""
        def as_sliding():
            (keys, values), sliding = self.sliding.extend(k_new, v_new, pos, stop, span)
            return attention(keys, values, "sliding")[0], self.full, sliding

        def as_full():
            (keys, values), full = self.full.extend(k_new, v_new, pos, stop, span)
            return attention(keys, values, "full")[0], full, self.sliding

        if len(self.kinds) == 1:  # (a block of one type has no mask of the other's for that branch)
            out, full, sliding = {"full": as_full, "sliding": as_sliding}[self.kinds[0]]()
        else:
            out, full, sliding = jax.lax.cond(self.ring, as_sliding, as_full)
        return (out, None), self.replace(full=full, sliding=sliding)


@struct.dataclass
class SplitStacks:
    """A scanned model's cache when its full and sliding layers keep different slots: one
    stack of each, the full layers' in order, the sliding layers' in order."""

    full: LayerKV  # [batch, n_full, capacity, n_kv_head, head_dim]
    sliding: RingKV  # [batch, n_sliding, slots, n_kv_head, head_dim]
    rings: tuple[bool, ...] = struct.field(pytree_node=False)  # per layer of the model: whether it is a ring

    def layer(self, layer: jax.Array, kinds: tuple[str, ...]) -> SplitSlice:
        """Layer `layer` of the model (traced, in a scan), of one of the attention types `kinds`:
        its `SplitSlice`, at its index in its stack."""
        rings = np.array(self.rings)
        rank = np.where(rings, np.cumsum(rings) - 1, np.cumsum(~rings) - 1)  # [n_layer]: each one's index in its stack
        index = jnp.asarray(rank, jnp.int32)[layer]
        return SplitSlice(full=LayerSlice(self.full, index), sliding=LayerSlice(self.sliding, index),
                          ring=jnp.asarray(rings)[layer], kinds=kinds)


def layer_shapes(batch_size: int, capacity: int, slots: tuple[int, ...], n_kv_head: int, head_dim: int,
                 stacked: bool) -> list[tuple[int, ...]]:
    """The k (and v) shape of each layer, or of each stack (the full layers', then the rings'),
    for layers of `slots` each; a stack holds one ring size."""
    if not stacked:
        return [(batch_size, n, n_kv_head, head_dim) for n in slots]
    kinds = set(slots)
    if len(kinds) == 1:
        return [(batch_size, len(slots), slots[0], n_kv_head, head_dim)]
    rings = [n for n in slots if n < capacity]
    if len(set(rings)) != 1 or len(kinds) != 2:
        raise ValueError(f"KVCache: a stacked cache holds one ring size, got slots {slots}")
    return [(batch_size, len(slots) - len(rings), capacity, n_kv_head, head_dim),
            (batch_size, len(rings), rings[0], n_kv_head, head_dim)]


def check_longrope_capacity(config: DecoderConfig, capacity: int, where: str) -> None:
    """A ValueError if `config`'s LongRoPE context is shorter than `capacity`: past it, every
    position's keys (and the hidden states below them) change, and transformers recomputes
    the whole prefix when a sequence crosses it, which a cache cannot do."""
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "longrope" and capacity > scaling.original_max_position_embeddings:
        raise ValueError(f"{where}: capacity={capacity} is past rope_scaling.original_max_position_embeddings="
                         f"{scaling.original_max_position_embeddings}, where LongRoPE switches every position to "
                         "its long factors: a cache holds at most that many positions")


def sliding_slots(window: int, capacity: int, rewind: int = 0) -> int:
    """Slots a layer sliding over `window` positions keeps for a cache of `capacity` positions:
    its ring's `window - 1 + rewind`, or `capacity` when that is no fewer."""
    return min(capacity, window - 1 + rewind)


# A call's attention reads a static prefix of each full layer's slots, its span: the smallest
# of these buckets that holds every row's positions after the call. Powers of two keep the
# slots read within 2x of those filled, and the programs few: one per bucket, log2(capacity / 256)
# + 1 at most. Below 256 a step's weights cost more than its keys, and a bucket saves nothing.
SMALLEST_SPAN = 256


def spans(capacity: int) -> tuple[int, ...]:
    """The buckets a cache of `capacity` positions is read at: powers of two from `SMALLEST_SPAN`
    below `capacity`, then `capacity` (`spans(1000)` is `(256, 512, 1000)`)."""
    smaller = []
    while (span := SMALLEST_SPAN << len(smaller)) < capacity:
        smaller.append(span)
    return (*smaller, capacity)


def span_for(needed: int, capacity: int) -> int:
    """The bucket of `spans(capacity)` a call reads when its rows' positions reach `needed`
    (the largest `pos + T`): the smallest that holds them."""
    return next(span for span in spans(capacity) if span >= min(needed, capacity))


@struct.dataclass
class KVCache:
    """Per-layer keys and values, and each row's write position.

    Attributes:
      layers: one `LayerKV` per block (a `RingKV` for a sliding layer whose ring is shorter
        than the capacity), or, for a scanned model, one `LayerKV` (or `RingKV`) whose k and
        v stack every block's, `[batch, n_layer, slots, n_kv_head, head_dim]`, or
        `SplitStacks` of both kinds.
      pos: int32 `[batch]`, the slots written in each row: row b's next token goes to slot
        `pos[b]`, which is its position. The model advances it once per call, after all layers.
      capacity: positions each row can hold (static).
      stop: int32 `[batch]` or None: a call writes row b's positions before `stop[b]` only
        into the rings (a ragged prefill's padding stays out); None: all of them.
      span: the slots `0 .. span - 1` a call's full layers read (static: one of `spans(capacity)`,
        set by `spanning`), so that a step costs what the rows hold, not the capacity; every
        row's `pos + T` must fit it. None: the capacity.
    """

    layers: tuple[LayerKV | RingKV, ...] | LayerKV | RingKV | SplitStacks
    pos: jax.Array  # [batch] int32
    capacity: int = struct.field(pytree_node=False)
    stop: jax.Array | None = None  # [batch] int32
    span: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, config, batch_size: int, capacity: int | None = None, dtype=None, rewind: int = 0) -> "KVCache":
        """An empty cache for the decoder-only model of `config` (a `DecoderConfig`).

        Args:
          config: the model's `DecoderConfig` (the encoder-decoder's cache comes from
            `VanillaTransformer.init_cache`).
          batch_size: sequences decoded together.
          capacity: positions, at most (and by default) `max_seq_len`: RoPE has no angles beyond.
          dtype: a floating storage dtype; defaults to the config's `cache_dtype`, else `dtype`.
          rewind: positions a row may be set back by after a call (a speculative round's
            proposals), which a sliding layer's ring keeps besides its window.
        """
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"KVCache.create takes a DecoderConfig, got {type(config).__name__}; for the "
                            "encoder-decoder use VanillaTransformer(config).init_cache(batch_size)")
        capacity = as_int(config.max_seq_len if capacity is None else capacity, "KVCache.create: capacity",
                          minimum=1, maximum=config.max_seq_len, maximum_name="max_seq_len")
        rewind = as_int(rewind, "KVCache.create: rewind", minimum=0)
        check_longrope_capacity(config, capacity, "KVCache.create")
        slots = tuple(capacity if window is None else sliding_slots(window, capacity, rewind)
                      for window in config.windows)  # (a full layer's window is None)
        return cls.zeros(batch_size, capacity, n_layer=config.n_layer, n_kv_head=config.n_kv_head,
                         head_dim=config.head_dim, max_seq_len=config.max_seq_len,
                         dtype=config.cache_storage_dtype if dtype is None else dtype, stacked=config.scan_layers,
                         slots=slots)

    @classmethod
    def zeros(cls, batch_size: int, capacity: int | None, *, n_layer: int, n_kv_head: int, head_dim: int,
              max_seq_len: int, dtype, stacked: bool = False, slots: tuple[int, ...] | None = None) -> "KVCache":
        """An empty cache of `n_layer` layers of `[batch_size, slots[l], n_kv_head, head_dim]`.

        Args:
          batch_size: rows, an int >= 1.
          capacity: positions, in `[1, max_seq_len]`; None for `max_seq_len`.
          dtype: a floating storage dtype (an integer cache would round every key and value).
          stacked: one `[batch, n_layer, ...]` array for k and one for v (a scanned model's;
            with rings and full layers both, one stack of each, `SplitStacks`).
          slots: each layer's slots; fewer than `capacity` make it a ring. None: `capacity` each.

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
        slots = (capacity,) * n_layer if slots is None else tuple(
            as_int(n, "KVCache.create: slots", minimum=1, maximum=capacity, maximum_name="capacity") for n in slots)
        if len(slots) != n_layer:
            raise ValueError(f"KVCache.create: slots must give {n_layer} (n_layer) layers, got {len(slots)}")
        # A checkpoint's max_seq_len (the default capacity) may be 10**12: refuse, do not allocate.
        check_fits(2 * sum(slots) * batch_size * n_kv_head * head_dim * storage.itemsize,
                   f"KVCache.create: a cache of {capacity:,} positions (capacity, default max_seq_len)")

        def layer(shape: tuple[int, ...]):
            kind = RingKV if shape[-3] < capacity else LayerKV
            return kind(k=jnp.zeros(shape, storage), v=jnp.zeros(shape, storage))

        shapes = layer_shapes(batch_size, capacity, slots, n_kv_head, head_dim, stacked)
        layers = [layer(shape) for shape in shapes]
        if stacked:
            layers = layers[0] if len(layers) == 1 else SplitStacks(full=layers[0], sliding=layers[1],
                                                                    rings=tuple(n < capacity for n in slots))
        return cls(layers=tuple(layers) if isinstance(layers, list) else layers,
                   pos=jnp.zeros((batch_size,), jnp.int32), capacity=capacity)

    def layout_shapes(self, batch_size: int, slots: tuple[int, ...], n_kv_head: int, head_dim: int, stacked: bool
                      ) -> list[tuple[int, ...]]:
        """The shapes of the arrays (k, v, k, v, ...) a model with these layers' `slots` reads
        in a cache of `batch_size` rows and this one's capacity: what `check_cache_step` compares."""
        return [shape for shape in layer_shapes(batch_size, self.capacity, slots, n_kv_head, head_dim, stacked)
                for _ in "kv"]

    @property
    def read_slots(self) -> int:
        """The slots a call's full layers read, `0 .. read_slots - 1` (`span`, else the capacity)."""
        return self.capacity if self.span is None else self.span

    def spanning(self, needed: int | None) -> "KVCache":
        """This cache read at the bucket `span_for(needed, capacity)` (static: a new bucket is a new
        program), `needed` the largest `pos + T` of the next call; None reads every slot."""
        return self.replace(span=None if needed is None else span_for(needed, self.capacity))

    @property
    def stacked(self) -> bool:
        """Whether the layers are stacked in arrays (a scanned model's cache)."""
        return not isinstance(self.layers, tuple)

    @property
    def stacks(self) -> tuple[LayerKV | RingKV, ...]:
        """A scanned model's stacks (one, or `SplitStacks`' full and sliding), else the layers."""
        if isinstance(self.layers, SplitStacks):
            return self.layers.full, self.layers.sliding
        return (self.layers,) if self.stacked else self.layers

    @property
    def ring_slots(self) -> tuple[int, ...]:
        """The sizes of the rings among the layers (or stacks), smallest first; () without rings."""
        return tuple(sorted({stack.k.shape[-3] for stack in self.stacks if isinstance(stack, RingKV)}))

    # A model reads and writes its layers through views, one per layer: `layer(i)` gives layer
    # i's, `with_layer(i, view)` takes it back written. Each view has `attend(attention, k_new,
    # v_new, pos, stop, span)`, which writes this call's K/V and calls `attention(keys, values)`
    # on the keys the layer reads, whichever layout holds it: a layer's own `LayerKV` or
    # `RingKV`, a `LayerSlice` of a stack, or a `SplitSlice` choosing between two stacks, which
    # adds the layer's kind, "full" or "sliding" (the model's flag cannot pick the mask: the two
    # kinds' differ in shape). So the model never asks which layout it holds.

    def layer(self, i, kinds: tuple[str, ...] = ("full", "sliding")):
        """Layer i's view: the layer itself, or in a stacked cache (`i` traced, in a scan) its slice
        of the stack (`SplitSlice` of two stacks, for a layer of one of the attention types `kinds`)."""
        if isinstance(self.layers, SplitStacks):
            return self.layers.layer(i, kinds)
        return LayerSlice(self.layers, i) if self.stacked else self.layers[i]

    def with_layer(self, i, view) -> "KVCache":
        """This cache with layer i's view `view` (from `layer(i)`, written) in its place."""
        if isinstance(self.layers, SplitStacks):
            layers = self.layers.replace(full=view.full.stack, sliding=view.sliding.stack)
        elif self.stacked:
            layers = view.stack
        else:
            layers = (*self.layers[:i], view, *self.layers[i + 1:])
        return self.replace(layers=layers)

    @property
    def n_layer(self) -> int:
        return sum(stack.k.shape[1] for stack in self.stacks) if self.stacked else len(self.layers)

    @property
    def layer_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each stack's (or layer's) k shape."""
        return tuple(stack.k.shape for stack in self.stacks)

    @property
    def batch_size(self) -> int:
        return self.stacks[0].k.shape[0]

    @property
    def n_kv_head(self) -> int:
        return self.stacks[0].k.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (every layer's slots: a ring keeps fewer than `capacity`)."""
        return sum(array.nbytes for array in jax.tree.leaves(self.layers))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes across all layers and rows, on average over the capacity
        (`2 * L * B * n_kv * d * itemsize` without rings)."""
        return self.nbytes // self.capacity

    @property
    def length(self) -> jax.Array:
        """Tokens written so far in each row, `[batch]` (`pos`)."""
        return self.pos

    @property
    def bytes_used(self) -> int:
        """Bytes holding written tokens, summed over the rows (host-side: reads `pos`; a ring
        counts at most its slots)."""
        pos = np.asarray(self.pos)
        total = 0
        for stack in self.stacks:
            slots = stack.k.shape[-3]
            per_position = stack.k.nbytes * 2 // (self.batch_size * slots)
            total += int(np.sum(np.minimum(pos, slots))) * per_position
        return total

    def advance(self, n_tokens) -> "KVCache":
        """The same slots with every row's `pos` moved `n_tokens` on (a scalar, or `[batch]`)."""
        return self.replace(pos=self.pos + n_tokens)

    def commit(self, layers, logits: jax.Array, n_tokens: int) -> tuple[jax.Array, "KVCache"]:
        """Ends a model call whose every layer wrote `n_tokens` (static) at each row's slots `pos[b] ..`.

        `pos` advances once, after every layer. `dynamic_update_slice` clamps a write past the
        capacity, and a query past the span would miss its own key: concrete inputs are refused
        before (`validation.check_cache_step`), and inside `jit` such a row's logits `[batch, T,
        vocab]` become NaN. Returns `(logits, cache)`.
        """
        fits = self.pos + n_tokens <= self.read_slots  # [batch]
        logits = jnp.where(fits[:, None, None], logits, jnp.nan)
        layers = tuple(layers) if isinstance(layers, list) else layers
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

    def insert(self, row, other: "KVCache", *, guard: bool = True) -> "KVCache":
        """Row `row` replaced by the single row of `other`, a one-row cache of the same layout (a
        prompt prefilled alone into `model.init_cache(1, cache.capacity)`).

        `guard`: a traced `row` out of range turns every key and value NaN (`_poisoned_unless_in_range`),
        which costs a pass over the whole cache, more than the write; False for a caller whose
        rows are its own indices, in range by construction (the serving engine).

        Raises:
          ValueError: `other` is not one row of this cache's layout, or `row` is out of range.
        """
        row = self._row(row, "insert")
        want = tuple((1, *shape[1:]) for shape in self.layer_shapes)
        if (other.stacked, other.layer_shapes, other.capacity) != (self.stacked, want, self.capacity):
            raise ValueError(f"KVCache.insert: other must be a one-row cache of this layout, k shapes {want} "
                             f"({'stacked' if self.stacked else 'per layer'}, capacity {self.capacity}), got "
                             f"{other.layer_shapes} ({'stacked' if other.stacked else 'per layer'}, "
                             f"capacity {other.capacity})")
        def put(leaf, new):
            return jax.lax.dynamic_update_slice_in_dim(leaf, new.astype(leaf.dtype), row, axis=0)

        inserted = self.replace(layers=jax.tree.map(put, self.layers, other.layers),
                                pos=jax.lax.dynamic_update_slice_in_dim(self.pos, other.pos, row, axis=0))
        return inserted._poisoned_unless_in_range(row) if guard else inserted

    def with_steps_of(self, head: "KVCache", written: jax.Array) -> "KVCache":
        """This cache with what a one-token call on its first rows wrote: `head` is those rows
        (`leaf[:rows]`) after the call, which wrote row r's position `written[r]` (int32
        `[rows]`, the `pos` it was given); that slot of each layer (`written[r] % slots`: a
        ring's, or a full layer's own) and the rows' `pos` are copied back, not the whole rows,
        which are this cache's already: a step of a few rows then costs their step, not a copy
        of their caches (on XLA:CPU, 9 against 28 ms for one row of docs/serving.md's model)."""
        axis = 2 if self.stacked else 1  # the slots' axis: [batch, slots, ...] or [batch, n_layer, slots, ...]

        def back(whole: jax.Array, part: jax.Array) -> jax.Array:
            slots = whole.shape[axis]
            for row in range(part.shape[0]):  # (a few rows, unrolled: each its own slot, written in place)
                slot = written[row] % slots
                new = jax.lax.dynamic_slice_in_dim(part[row:row + 1], slot, 1, axis=axis)
                index = [jnp.zeros((), jnp.int32)] * whole.ndim
                index[0], index[axis] = jnp.int32(row), slot
                whole = jax.lax.dynamic_update_slice(whole, new, index)
            return whole

        return self.replace(layers=jax.tree.map(back, self.layers, head.layers),
                            pos=jax.lax.dynamic_update_slice_in_dim(self.pos, head.pos, 0, axis=0))

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
