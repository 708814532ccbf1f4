"""The KV cache: an immutable pytree of fixed shape, one write position per row.

A model call takes a cache and returns a new one; under `jit` XLA makes the writes in
place, and `capacity` fixes every shape, so one compiled step serves every position. Keys
are stored after RoPE (a cached key never moves again) and with `n_kv_head` heads (GQA
saves memory only if K/V are not repeated first). A sliding-window layer keeps only the
slots its window can read, as a ring (`RingKV`); a linear-attention layer keeps a state of
fixed size instead (`LinearState`), whatever the length. What each layer keeps is its mixer's
`cache_entry` (`Entry`). Why a scanned model's stack is the scan's carry: docs/architecture.md,
"Scanned layers"; the rows and the rings: docs/decoding.md.
"""

from __future__ import annotations

from typing import NamedTuple

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


class Entry(NamedTuple):
    """What one layer keeps per row between calls (its mixer spec's `cache_entry`).

    Attributes:
      kind: the layer's attention type: "full" or "sliding" (keys and values per slot: every
        position's, or a ring's), "linear" (a state of fixed size, whatever the length), or "none"
        (nothing: a layer that reads another layer's keys and values, Gemma 4's KV-shared layers).
      shapes: "full" and "sliding": the shapes of a slot's key and value, `(k, v)` (GQA's
        `(n_kv_head, head_dim)` each; latent attention's latent and RoPE key, `(1, width)` each);
        "linear": a row's conv inputs and recurrent state, `(conv, state)`; "none": `((), ())`.
    """

    kind: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]]


def attention_entry(kind: str, n_kv_head: int, head_dim: int) -> Entry:
    """The entry of a GQA layer of attention type `kind`: a key and a value of `[n_kv_head, head_dim]` a slot."""
    return Entry(kind, ((n_kv_head, head_dim), (n_kv_head, head_dim)))


@struct.dataclass
class LinearState:
    """A linear-attention layer's state (Gated DeltaNet): each row's last `kernel - 1` inputs to
    its causal short convolution and its recurrent state, the same size at any length, so a row
    costs no more at position 30,000 than at 3. Its layer reads it whole (`read`) and gives it
    back whole (`write`); the state stays float32, the running sum of every step's update."""

    conv: jax.Array  # [batch, kernel - 1, channels] ([batch, n_layer, ...] stacked)
    state: jax.Array  # [batch, heads, d_k, d_v] float32 ([batch, n_layer, ...] stacked)

    def read(self) -> tuple[jax.Array, jax.Array]:
        """`(conv, state)` of every row."""
        return self.conv, self.state

    def write(self, conv: jax.Array, state: jax.Array) -> "LinearState":
        """The state after a call: `conv` and `state` in place of the old ones."""
        return LinearState(conv=conv.astype(self.conv.dtype), state=state.astype(self.state.dtype))

    def read_layer(self, layer: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`read` of layer `layer` of this stack."""
        return layer_of(self.conv, layer), layer_of(self.state, layer)

    def write_layer(self, layer: jax.Array, conv: jax.Array, state: jax.Array) -> "LinearState":
        """`write` of layer `layer` of this stack, in place."""
        def put(stack, new):
            return jax.lax.dynamic_update_index_in_dim(stack, new.astype(stack.dtype), layer, axis=1)

        return LinearState(conv=put(self.conv, conv), state=put(self.state, state))


@struct.dataclass
class LayerSlice(OneKind):
    """Layer `layer` of a stacked cache (a scanned model's), as its block sees it: `extend`
    writes that layer's slots of the whole stack in place and reads that layer."""

    stack: LayerKV | RingKV | LinearState  # k, v: [batch, n_layer, slots, n_kv_head, head_dim]
    layer: jax.Array  # [] int32, the block's index in this stack

    def extend(self, k_new: jax.Array, v_new: jax.Array, pos: jax.Array, stop=None, span=None):
        """`LayerKV.extend` or `RingKV.extend` on layer `layer` of the stack."""
        keys_values, stack = self.stack.extend_layer(self.layer, k_new, v_new, pos, stop, span)
        return keys_values, self.replace(stack=stack)

    def read(self) -> tuple[jax.Array, jax.Array]:
        """`LinearState.read` of layer `layer` of the stack."""
        return self.stack.read_layer(self.layer)

    def write(self, conv: jax.Array, state: jax.Array) -> "LayerSlice":
        """`LinearState.write` of layer `layer` of the stack, in place."""
        return self.replace(stack=self.stack.write_layer(self.layer, conv, state))


@struct.dataclass
class SplitSlice:
    """A layer of `Stacks` that may be full or sliding: its slices of the full stack and of the rings, at its index in
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


def is_stack(node) -> bool:
    """Whether `node` is one layer's (or one stack's) arrays: a tree map over a cache's layers
    stops there to treat each kind as its own."""
    return isinstance(node, (LayerKV, RingKV, LinearState))


STORES = (("full", LayerKV), ("sliding", RingKV), ("linear", LinearState))  # how a layer's entry is kept


def store(entry: Entry, slots: int, capacity: int) -> str:
    """Where a layer of `entry` keeping `slots` slots lives: "sliding" (a ring) when its slots are
    fewer than `capacity`, "linear" for a state, "none" for nothing, else "full" (a sliding layer
    whose window holds the whole capacity keeps every slot, as a full one)."""
    if entry.kind in ("linear", "none"):
        return entry.kind
    return "sliding" if slots < capacity else "full"


@struct.dataclass
class Stacks:
    """A scanned model's cache when its layers are kept in more than one way: a stack of each,
    `full` (`[batch, n_full, capacity, ...]`), `sliding` (rings, `[batch, n_sliding, slots, ...]`)
    and `linear` (`LinearState`s), each its layers' in order, None where no layer is of it."""

    full: LayerKV | None
    sliding: RingKV | None
    linear: LinearState | None
    stores: tuple[str, ...] = struct.field(pytree_node=False)  # per layer of the model: its stack's name

    def layer(self, layer: jax.Array, kinds: tuple[str, ...]):
        """Layer `layer` of the model (traced, in a scan), of one of the attention types `kinds`:
        its slice of its stack, at its index there; a `SplitSlice` for a body that may be full
        or sliding (`kinds`, its scanned specs') when both stacks exist."""
        stores = np.array(self.stores)
        rank = np.zeros(len(stores), np.int32)  # each layer's index in its stack
        for name in set(self.stores):
            rank[stores == name] = np.arange(np.sum(stores == name))
        index = jnp.asarray(rank)[layer]
        if "linear" in kinds:
            return LayerSlice(self.linear, index)
        if self.full is not None and self.sliding is not None and "sliding" in kinds:
            return SplitSlice(full=LayerSlice(self.full, index), sliding=LayerSlice(self.sliding, index),
                              ring=jnp.asarray(stores == "sliding")[layer], kinds=kinds)
        return LayerSlice(self.full if self.sliding is None or "sliding" not in kinds else self.sliding, index)

    def with_slice(self, view) -> "Stacks":
        """These stacks with the one `view` (from `layer`, written) sliced put back."""
        if isinstance(view, SplitSlice):
            return self.replace(full=view.full.stack, sliding=view.sliding.stack)
        name = next(name for name, kind in STORES if isinstance(view.stack, kind))
        return self.replace(**{name: view.stack})


def layer_shapes(batch_size: int, capacity: int, entries: tuple[Entry, ...], slots: tuple[int, ...],
                 stacked: bool) -> list[tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """The shapes of the two arrays of each layer of `entries` keeping `slots` slots (k and v, or
    conv and state; None for a layer that keeps nothing), or of each stack (`STORES`' order) of a
    stacked cache; a stack holds one shape of entry, and one ring size."""
    def one(entry: Entry, n: int, layers: tuple[int, ...] = ()):
        a, b = entry.shapes
        if entry.kind == "linear":
            return (batch_size, *layers, *a), (batch_size, *layers, *b)
        return (batch_size, *layers, n, *a), (batch_size, *layers, n, *b)

    if not stacked:
        return [None if entry.kind == "none" else one(entry, n) for entry, n in zip(entries, slots)]
    if any(entry.kind == "none" for entry in entries):
        raise ValueError("KVCache: a stacked cache holds no layer that keeps nothing (a kv_shared layer's); "
                         "make it per layer (scan_layers=False)")
    out = []
    for name, _ in STORES:
        mine = [(entry, n) for entry, n in zip(entries, slots) if store(entry, n, capacity) == name]
        if mine and len(set(mine)) > 1:
            raise ValueError(f"KVCache: a stacked cache holds one shape of {name} layer, got "
                             f"{sorted(set(mine), key=str)} (entries, slots)")
        if mine:
            out.append(one(*mine[0], layers=(len(mine),)))
    return out


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
        than the capacity, a `LinearState` for a linear-attention layer, None for a layer that
        keeps nothing: one that reads another layer's keys and values), or, for a scanned
        model, one of them whose arrays stack every block's, `[batch, n_layer, slots, n_kv_head,
        head_dim]`, or `Stacks` of each kind where the layers are kept in several ways.
      pos: int32 `[batch]`, the slots written in each row: row b's next token goes to slot
        `pos[b]`, which is its position. The model advances it once per call, after all layers.
      capacity: positions each row can hold (static).
      stop: int32 `[batch]` or None: a call writes row b's positions before `stop[b]` only
        into the rings (a ragged prefill's padding stays out); None: all of them.
      span: the slots `0 .. span - 1` a call's full layers read (static: one of `spans(capacity)`,
        set by `spanning`), so that a step costs what the rows hold, not the capacity; every
        row's `pos + T` must fit it. None: the capacity.
    """

    layers: tuple[LayerKV | RingKV | LinearState, ...] | LayerKV | RingKV | LinearState | Stacks
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
                         slots=slots, entries=tuple(Entry(*entry) for entry in config.cache_entries))

    @classmethod
    def zeros(cls, batch_size: int, capacity: int | None, *, n_layer: int, n_kv_head: int, head_dim: int,
              max_seq_len: int, dtype, stacked: bool = False, slots: tuple[int, ...] | None = None,
              entries: tuple[Entry, ...] | None = None) -> "KVCache":
        """An empty cache of `n_layer` layers of `[batch_size, slots[l], n_kv_head, head_dim]`
        (or of what `entries` say each layer keeps).

        Args:
          batch_size: rows, an int >= 1.
          capacity: positions, in `[1, max_seq_len]`; None for `max_seq_len`.
          dtype: a floating storage dtype (an integer cache would round every key and value).
          stacked: one `[batch, n_layer, ...]` array for k and one for v (a scanned model's;
            with rings and full layers both, one stack of each, `SplitStacks`).
          slots: each layer's slots; fewer than `capacity` make it a ring. None: `capacity` each.
          entries: each layer's `Entry` (a state for a linear layer; keys and values of other
            shapes); None: GQA's keys and values of `n_kv_head` x `head_dim`, full layers.

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
        entries = (attention_entry("full", n_kv_head, head_dim),) * n_layer if entries is None else entries
        if len(slots) != n_layer or len(entries) != n_layer:
            raise ValueError(f"KVCache.create: slots and entries must give {n_layer} (n_layer) layers, got "
                             f"{len(slots)} and {len(entries)}")
        stores = tuple(store(entry, n, capacity) for entry, n in zip(entries, slots))
        shapes = layer_shapes(batch_size, capacity, entries, slots, stacked)
        # A checkpoint's max_seq_len (the default capacity) may be 10**12: refuse, do not allocate.
        check_fits(sum(np.prod(shape) * storage.itemsize for pair in shapes if pair for shape in pair),
                   f"KVCache.create: a cache of {capacity:,} positions (capacity, default max_seq_len)")

        def layer(name: str, shape: tuple[tuple[int, ...], tuple[int, ...]] | None):
            if name == "none":  # (a kv_shared layer reads another's keys and values: it keeps nothing)
                return None
            a, b = shape
            if name == "linear":  # (the recurrent state a running sum in float32, whatever the cache's dtype)
                return LinearState(conv=jnp.zeros(a, storage), state=jnp.zeros(b, jnp.float32))
            return dict(STORES)[name](k=jnp.zeros(a, storage), v=jnp.zeros(b, storage))

        if not stacked:
            layers = tuple(layer(name, shape) for name, shape in zip(stores, shapes))
        else:
            names = [name for name, _ in STORES if name in stores]
            made = {name: layer(name, shape) for name, shape in zip(names, shapes)}
            layers = made[names[0]] if len(made) == 1 else Stacks(**{name: made.get(name) for name, _ in STORES},
                                                                  stores=stores)
        return cls(layers=layers, pos=jnp.zeros((batch_size,), jnp.int32), capacity=capacity)

    def layout_shapes(self, batch_size: int, entries: tuple[Entry, ...], slots: tuple[int, ...], stacked: bool
                      ) -> list[tuple[int, ...]]:
        """The shapes of the arrays (k, v, k, v, ... in the layers' order) a model with these layers'
        `entries` and `slots` reads in a cache of `batch_size` rows and this one's capacity: what
        `check_cache_step` compares."""
        return [shape for pair in layer_shapes(batch_size, self.capacity, entries, slots, stacked) if pair
                for shape in pair]

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
    def stacks(self) -> tuple[LayerKV | RingKV | LinearState, ...]:
        """A scanned model's stacks (one, or those of `Stacks`), else the layers that keep something."""
        if isinstance(self.layers, Stacks):
            return tuple(stack for stack in (self.layers.full, self.layers.sliding, self.layers.linear)
                         if stack is not None)
        return (self.layers,) if self.stacked else tuple(layer for layer in self.layers if layer is not None)

    @property
    def ring_slots(self) -> tuple[int, ...]:
        """The sizes of the rings among the layers (or stacks), smallest first; () without rings."""
        return tuple(sorted({stack.k.shape[-3] for stack in self.stacks if isinstance(stack, RingKV)}))

    @property
    def has_state(self) -> bool:
        """Whether a layer keeps a state (`LinearState`): then a row cannot be set back to an
        earlier position (its state holds every token it has read), only continued or emptied."""
        return any(isinstance(stack, LinearState) for stack in self.stacks)

    # A model reads and writes its layers through views, one per layer: `layer(i)` gives layer
    # i's, `with_layer(i, view)` takes it back written. A view of keys and values has
    # `attend(attention, k_new, v_new, pos, stop, span)`, which writes this call's K/V and calls
    # `attention(keys, values)` on the keys the layer reads, whichever layout holds it: a layer's
    # own `LayerKV` or `RingKV`, a `LayerSlice` of a stack, or a `SplitSlice` choosing between two
    # stacks, which adds the layer's kind, "full" or "sliding" (the model's flag cannot pick the
    # mask: the two kinds' differ in shape). A view of a state (`LinearState`, or a `LayerSlice`
    # of a stack of them) has `read()` and `write(conv, state)`. So the model never asks which
    # layout it holds.

    def layer(self, i, kinds: tuple[str, ...] = ("full", "sliding")):
        """Layer i's view: the layer itself, or in a stacked cache (`i` traced, in a scan) its slice
        of its stack (a `SplitSlice` of two, for a layer that may be of either type in `kinds`)."""
        if isinstance(self.layers, Stacks):
            return self.layers.layer(i, kinds)
        return LayerSlice(self.layers, i) if self.stacked else self.layers[i]

    def with_layer(self, i, view) -> "KVCache":
        """This cache with layer i's view `view` (from `layer(i)`, written) in its place."""
        if isinstance(self.layers, Stacks):
            layers = self.layers.with_slice(view)
        elif self.stacked:
            layers = view.stack
        else:
            layers = (*self.layers[:i], view, *self.layers[i + 1:])
        return self.replace(layers=layers)

    @property
    def heads_axes(self):
        """A tree like `layers` giving the axis of each array that a mesh splits over its `model`
        axis (`sharding.cache_shardings`), counted from its end: a slot's kv heads, -2; a state's
        value heads, -3, and its conv inputs' channels, -1."""
        def axes(stack):
            if isinstance(stack, LinearState):
                return stack.replace(conv=-1, state=-3)
            return stack.replace(k=-2, v=-2)

        return self.map_stacks(axes)

    def map_stacks(self, fn, *trees):
        """`fn(stack, *its nodes of trees)` for each layer's (or stack's) arrays of `layers` (each
        kind's whole: `is_stack`), `trees` being like `layers`: a tree like them."""
        return jax.tree.map(fn, self.layers, *trees, is_leaf=is_stack)

    @property
    def n_layer(self) -> int:
        if not self.stacked:
            return len(self.layers)
        return sum(jax.tree.leaves(stack)[0].shape[1] for stack in self.stacks)

    @property
    def layer_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each stack's (or layer's) first array's shape: k's, or a state's conv inputs'."""
        return tuple(jax.tree.leaves(stack)[0].shape for stack in self.stacks)

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (every layer's slots: a ring keeps fewer than `capacity`)."""
        return sum(array.nbytes for array in jax.tree.leaves(self.layers))

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes across all layers and rows, on average over the capacity
        (`2 * L * B * n_kv * d * itemsize` without rings or states)."""
        return self.nbytes // self.capacity

    @property
    def length(self) -> jax.Array:
        """Tokens written so far in each row, `[batch]` (`pos`)."""
        return self.pos

    @property
    def bytes_used(self) -> int:
        """Bytes holding written tokens, summed over the rows (host-side: reads `pos`; a ring
        counts at most its slots, a state its whole size once a row has begun)."""
        pos = np.asarray(self.pos)
        total = 0
        for stack in self.stacks:
            if isinstance(stack, LinearState):
                total += int(np.sum(pos > 0)) * (stack.conv.nbytes + stack.state.nbytes) // self.batch_size
                continue
            slots = stack.k.shape[-3]
            per_position = (stack.k.nbytes + stack.v.nbytes) // (self.batch_size * slots)
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
        want = tuple((1, *leaf.shape[1:]) for leaf in jax.tree.leaves(self.layers))
        got = tuple(leaf.shape for leaf in jax.tree.leaves(other.layers))
        if (other.stacked, got, other.capacity) != (self.stacked, want, self.capacity):
            form = {True: "stacked", False: "per layer"}
            raise ValueError(f"KVCache.insert: other must be a one-row cache of this layout, array shapes "
                             f"{sorted(set(want))} ({form[self.stacked]}, capacity {self.capacity}), got "
                             f"{sorted(set(got))} ({form[other.stacked]}, capacity {other.capacity})")
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
        of their caches (on XLA:CPU, 9 against 28 ms for one row of docs/serving.md's model). A
        state (`LinearState`) has no slots: the rows' whole states are copied back, a few numbers."""
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

        def back_stack(whole, part):
            if isinstance(whole, LinearState):  # rows 0 .. rows - 1 whole
                return jax.tree.map(lambda w, p: jax.lax.dynamic_update_slice_in_dim(w, p, 0, axis=0), whole, part)
            return jax.tree.map(back, whole, part)

        layers = jax.tree.map(back_stack, self.layers, head.layers, is_leaf=is_stack)
        return self.replace(layers=layers, pos=jax.lax.dynamic_update_slice_in_dim(self.pos, head.pos, 0, axis=0))

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
