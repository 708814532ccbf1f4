"""Where each array lives on a `(data, expert, model)` mesh: DP, FSDP, tensor and expert parallelism.

Every parameter names its dimensions where it is created (`param`), and `RULES` maps
those logical axes to mesh axes; JAX's compiler inserts the communication. The
strategies and the rules are described in docs/sharding.md.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from flax import struct
from flax.core import meta
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from qwix import QArray

from jaxformer.validation import python_int

DATA, EXPERT, MODEL = "data", "expert", "model"
AXES = (DATA, EXPERT, MODEL)  # a mesh's axes, in `make_mesh`'s order
STRATEGIES = ("dp", "fsdp")

# Logical axes: what a parameter's dimension means, whatever the model.
EMBED = "embed"  # the residual stream, d_model
VOCAB = "vocab"  # token ids
HEADS = "heads"  # query heads (every head, in the 2017 model)
KV_HEADS = "kv_heads"  # key/value heads of grouped-query attention
HEAD_DIM = "head_dim"  # channels within one head
MLP = "mlp"  # the feed-forward network's hidden units
QKV = "qkv"  # which of Q, K, V in a packed projection
LAYERS = "layers"  # the block a stacked parameter belongs to (a scanned model); never split
EXPERTS = "experts"  # which expert of a mixture (`jaxformer.experts`) a stacked parameter is
ROUTES = "routes"  # a router's score per expert; never split: every device routes its own tokens
LATENT = "latent"  # a low-rank projection's inner width (latent attention's); every head reads all of it
CONV = "conv"  # the taps of a short convolution (Gated DeltaNet's); never split: each is a few numbers
SCALAR = "scalar"  # a single learned number (Gemma 4's layer scalar); never split

# (logical axis, mesh axis, strategies), in order of preference. A mesh axis splits at
# most one dimension of an array, and a dimension that does not divide evenly over it is
# kept whole: GQA's few kv heads (n_kv_head < model) are then computed on every device,
# which costs a little work and no communication.
_BOTH, _FSDP = STRATEGIES, ("fsdp",)
RULES = (
    # Tensor parallel: whole heads and hidden units per device; vocabulary-parallel
    # embeddings and output layers (the softmax then spans the devices).
    (HEADS, MODEL, _BOTH), (KV_HEADS, MODEL, _BOTH), (MLP, MODEL, _BOTH), (VOCAB, MODEL, _BOTH),
    # Expert parallel: whole experts per device (`jaxformer.experts.expert_parallel` sends the tokens to them).
    (EXPERTS, EXPERT, _BOTH),
    # FSDP: one more dimension over `data`, the larger kinds first.
    (VOCAB, DATA, _FSDP), (MLP, DATA, _FSDP), (EMBED, DATA, _FSDP), (HEADS, DATA, _FSDP),
    (KV_HEADS, DATA, _FSDP), (HEAD_DIM, DATA, _FSDP), (QKV, DATA, _FSDP), (LATENT, DATA, _FSDP),
)
AXES_COLLECTION = "param_axes"


class LogicalAxes(struct.PyTreeNode, meta.AxisMetadata):
    """A parameter's logical axis names, kept in the `param_axes` collection at init.

    Static (no array leaves), so they pass through `jax.eval_shape`; as flax axis
    metadata they gain the `LAYERS` axis where `nn.scan` stacks the blocks."""

    names: tuple[str, ...] = struct.field(pytree_node=False)

    def unbox(self):
        return None  # nothing boxed: the names are the whole content

    def replace_boxed(self, val):
        return self

    def add_axis(self, index: int, params: dict) -> "LogicalAxes":
        names = list(self.names)
        names.insert(index, params[nn.PARTITION_NAME])
        return self.replace(names=tuple(names))

    def remove_axis(self, index: int, params: dict) -> "LogicalAxes":
        return self.replace(names=self.names[:index] + self.names[index + 1:])


def param(module: nn.Module, name: str, init: Callable, shape: tuple[int, ...], axes: tuple[str, ...],
          dtype) -> jax.Array:
    """`module.param(name, init, shape, dtype)`, its dimensions named by `axes`.

    The parameter stays a plain array; the names go to the `param_axes` collection.

    Raises:
      ValueError: `axes` does not name every dimension of `shape`.
    """
    if len(axes) != len(shape):
        raise ValueError(f"{name}: {len(axes)} axis names {axes} for a {len(shape)}-D parameter")
    if module.is_mutable_collection(AXES_COLLECTION):
        module.variable(AXES_COLLECTION, name, LogicalAxes, tuple(axes))
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if isinstance(value, QArray):  # (`jaxformer.quantized.Quantized`: stored with its inputs last, which
            # flax's shape check would compare)
            if value.shape != tuple(shape):
                raise ValueError(f"{name}: a quantized matrix of shape {value.shape} where {tuple(shape)} is declared")
            return value
    return module.param(name, init, shape, dtype)


class Weight(NamedTuple):
    """A layer kind's parameter: its shape, the logical axis of each dimension (`EMBED`, ...)
    and how many leading dimensions are its input (a matrix's rows; 0 for a bias)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    inputs: int = 1


def compute_param(module: nn.Module, name: str, init: Callable, shape: tuple[int, ...],
                  axes: tuple[str, ...]) -> jax.Array:
    """`param` stored in `module.config.param_dtype` and returned in the compute `dtype`."""
    config = module.config
    return param(module, name, init, shape, axes, config.param_dtype).astype(config.dtype)


def _names(path) -> tuple[str, ...]:
    """The dict keys at the end of a tree path: a parameter's path, also inside an optimizer state."""
    names = []
    for key in reversed(path):
        if not isinstance(key, jax.tree_util.DictKey):
            break
        names.append(str(key.key))
    return tuple(reversed(names))


def param_axes(model: nn.Module) -> dict:
    """The logical axis names of every parameter of `model`, a tree shaped like its params.

    Runs `model.init` on shapes only (`jax.eval_shape`): nothing is computed.

    Raises:
      ValueError: a parameter created without names (a plain `self.param`), which would
        otherwise be silently replicated.
    """
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), *model.init_inputs()))
    declared = {_names(path): axes.names for path, axes in jax.tree_util.tree_flatten_with_path(
        variables.get(AXES_COLLECTION, {}), is_leaf=lambda x: isinstance(x, LogicalAxes))[0]}

    def names_of(path, leaf):
        names = declared.get(_names(path))
        if names is None:
            raise ValueError(f"parameter {'/'.join(_names(path))} has no logical axis names: create it with "
                             "jaxformer.sharding.param(...) so that its sharding is declared")
        return names

    return jax.tree_util.tree_map_with_path(names_of, variables["params"])


def make_mesh(data: int | None = None, model: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A `(data, expert, model)` mesh over `devices` (default `jax.devices()`: every process's),
    laid out by the devices' topology (`jax.make_mesh`): on a TPU slice or a GPU host the
    `model` axis, whose collectives come at every layer, spans neighbouring devices on the
    fastest links, then `expert`; across processes, each process's devices are together.

    Args:
      data: devices along the batch axis; None takes every device `model` and `expert` leave.
      model: devices along the tensor-parallel axis.
      expert: devices along the expert-parallel axis: a mixture's experts split over it, and
        the batch's rows too (it is a data axis for everything but the experts).
      devices: the devices to use.

    Raises:
      ValueError: `data`, `model` or `expert` not a positive int, or their product not the device count.
    """
    devices = jax.devices() if devices is None else list(devices)
    n_model, n_expert = python_int(model), python_int(expert)  # numpy ints too, as plain ints
    if n_model is None or n_model < 1 or len(devices) % n_model:
        raise ValueError(f"make_mesh: model must be a positive int dividing the device count "
                         f"{len(devices)}, got {model!r}")
    if n_expert is None or n_expert < 1 or len(devices) % (n_model * n_expert):
        raise ValueError(f"make_mesh: expert must be a positive int dividing the device count {len(devices)} "
                         f"over model={n_model}, got {expert!r}")
    n_data = len(devices) // (n_model * n_expert) if data is None else python_int(data)
    if n_data is None or n_data < 1 or n_data * n_expert * n_model != len(devices):
        named = ("data * model", f"data={data!r} x model={n_model}") if n_expert == 1 else (
            "data * expert * model", f"data={data!r} x expert={n_expert} x model={n_model}")
        raise ValueError(f"make_mesh: {named[0]} must equal the device count {len(devices)}"
                         + (f" ({jax.process_count()} processes)" if jax.process_count() > 1 else "")
                         + f", got {named[1]}")
    # Auto axes: the compiler places what the rules leave open (jax.make_mesh's default is Explicit).
    return jax.make_mesh((n_data, n_expert, n_model), AXES, (AxisType.Auto,) * 3, devices=devices)


def axis_size(mesh, name: str) -> int:
    """The devices along the mesh axis `name`; 1 for an axis the mesh lacks (a mesh made otherwise)."""
    return dict(mesh.shape).get(name, 1)


def batch_axes(mesh) -> str | tuple[str, str]:
    """The mesh axes a batch's rows are split over: `data`, and `expert` where it has more than one
    device (expert parallelism splits the tokens over data x expert, `jaxformer.experts`)."""
    return (DATA, EXPERT) if axis_size(mesh, EXPERT) > 1 else DATA


def batch_devices(mesh) -> int:
    """How many ways a batch's rows are split: `data x expert`."""
    return axis_size(mesh, DATA) * axis_size(mesh, EXPERT)


def parse_mesh(spec: str) -> dict[str, int]:
    """`"data=4,model=2"` as `{"data": 4, "model": 2}`; `expert=E` too (any may be left out)."""
    sizes = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES or name in sizes:
            raise ValueError(f"mesh {spec!r}: each part must be data=N, expert=E or model=M, once (got {part!r})")
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh {spec!r}: {name} must be a positive int (got {value!r})")
        sizes[name] = int(value)
    return sizes


def check_mesh_fits(config, mesh: Mesh) -> None:
    """Raises ValueError unless `config.n_head`, and each layer's query heads where `config.layers`
    gives them (a `DecoderConfig`'s filled specs), divide over the mesh's `model` axis, and every
    experts layer's `n_experts` over its `expert` axis."""
    n_model, n_expert = axis_size(mesh, MODEL), axis_size(mesh, EXPERT)
    heads = {"n_head": config.n_head}
    for i, spec in enumerate(getattr(config, "layers", ())):
        heads.setdefault(f"layers[{i}].mixer.n_head", spec.mixer.n_head)
    for field, n_head in heads.items():
        if n_head % n_model:
            raise ValueError(f"{type(config).__name__}.{field}={n_head} is not divisible by the mesh's "
                             f"model axis ({n_model}): tensor parallelism splits whole heads")
    for i, layer in enumerate(getattr(config, "layers", None) or ()):
        n_experts = getattr(layer.ffn, "n_experts", None)
        if n_experts is not None and n_experts % n_expert:
            raise ValueError(f"{type(config).__name__}.layers[{i}].ffn.n_experts={n_experts} is not divisible by "
                             f"the mesh's expert axis ({n_expert}): expert parallelism splits whole experts")


def partition_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, strategy: str = "dp") -> PartitionSpec:
    """Where one array with logical `axes` and `shape` lives, by `RULES` (strategy "dp" or "fsdp")."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    spec = [None] * len(shape)
    for logical, mesh_axis, strategies in RULES:
        n = axis_size(mesh, mesh_axis)
        if strategy not in strategies or n == 1 or mesh_axis in spec:
            continue
        for dim, name in enumerate(axes):
            if name == logical and spec[dim] is None and shape[dim] % n == 0:
                spec[dim] = mesh_axis
                break
    return PartitionSpec(*spec)


def tree_shardings(tree, axes: dict, mesh: Mesh, strategy: str = "dp"):
    """A `NamedSharding` for every leaf of a parameter tree, a `TrainState` or an optimizer state.

    A leaf whose path ends with a parameter's path (an optimizer moment) is placed as that
    parameter; a scalar is replicated; a quantized matrix (a `QArray`, `jaxformer.quantized`)
    gets a `QArray` of shardings, `quantized_shardings` of its float matrix's.

    Args:
      tree: the arrays to place (their shapes are read, not their values).
      axes: `param_axes(model)`.
      mesh: from `make_mesh`.
      strategy: "dp" or "fsdp" (tensor parallelism follows from the mesh's `model` axis).

    Raises:
      ValueError: an array leaf of no named parameter, or whose rank does not match its names.
    """
    declared = {_names(path): names for path, names in
                jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]}

    def place(path, leaf):
        if isinstance(leaf, QArray):  # (taken whole: its own leaves' paths end in .qvalue, .scale): its float
            # matrix's sharding (the model's shape: a `Quantized`'s `shape`) followed by its arrays
            return quantized_shardings(place(path, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)), leaf)
        shape = np.shape(leaf)
        if not shape:  # a step count, or a scalar an optimizer keeps per parameter
            return NamedSharding(mesh, PartitionSpec())
        names = declared.get(_names(path))
        if names is None:
            raise ValueError(f"{jax.tree_util.keystr(path)} {shape}: no parameter of this name has logical "
                             "axis names (see jaxformer.sharding.param_axes)")
        if len(names) != len(shape):
            raise ValueError(f"{jax.tree_util.keystr(path)}: {len(shape)}-D, but its logical axes are {names}")
        return NamedSharding(mesh, partition_spec(names, shape, mesh, strategy))

    return jax.tree_util.tree_map_with_path(place, tree, is_leaf=lambda x: isinstance(x, QArray))


def quantized_shardings(sharding: jax.sharding.Sharding, w: QArray) -> QArray:
    """Where a quantized matrix `w`'s arrays live (a `QArray` of shardings), given `sharding`, its
    float matrix's: its values there; its scales and zero point split as the values are, but whole
    along a dimension that does not divide over its mesh axes (int8's one scale over the inputs, an
    int4 scale's `n_in / 64` rows over more devices than that), so each device holds the scales of
    the values it holds, or all of them.

    Raises:
      ValueError: `sharding` splits an array but is not a `NamedSharding` (its spec is what is followed).
    """
    if not isinstance(sharding, NamedSharding):
        if not sharding.is_fully_replicated:
            raise ValueError(f"shardings: a quantized matrix's must be a NamedSharding or replicated, got {sharding}")
        return w.replace(qvalue=sharding, scale=sharding, zero_point=None if w.zero_point is None else sharding)
    spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))  # the model's axes
    if hasattr(w, "stored_order"):  # a `jaxformer.quantized.Quantized`: its arrays hold the inputs last
        spec = w.stored_order(spec)
    values = NamedSharding(sharding.mesh, PartitionSpec(*spec))

    def like_values(a):
        def kept(dim, axes):  # the mesh axes that split dimension `dim` of the values, if they divide `a`'s
            if axes is None:
                return None
            n = math.prod(axis_size(sharding.mesh, axis) for axis in (axes if isinstance(axes, tuple) else (axes,)))
            return axes if a.shape[dim] % n == 0 else None

        return NamedSharding(sharding.mesh, PartitionSpec(*(kept(dim, axes) for dim, axes in enumerate(spec))))

    return w.replace(qvalue=values, scale=like_values(w.scale),
                     zero_point=None if w.zero_point is None else like_values(w.zero_point))


def mesh_of(params) -> Mesh | None:
    """The mesh `params` are placed on (by `tree_shardings`), or None on a single device."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


def traced_on(fn: Callable, mesh) -> Callable:
    """`fn`, traced with `mesh` as the context's mesh (`jax.sharding.use_abstract_mesh`), for what
    reads the mesh as it traces: expert parallelism (`jaxformer.experts.expert_mesh`). `fn` itself
    when `mesh` is None. (Only the tracing sees it: nothing made outside a program is placed by it,
    as `jax.set_mesh` would place it.)"""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def mesh_of_shardings(shardings) -> Mesh | None:
    """The mesh of a tree of `NamedSharding`s (`tree_shardings`'), or None."""
    for sharding in jax.tree.leaves(shardings):
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def cache_shardings(cache, mesh: Mesh):
    """Where a `KVCache` lives: rows over `data` (and `expert`, `batch_axes`), and each layer's
    arrays over `model` as the layer that reads them is split, where all of them divide it (else
    they are whole on each device): a slot's kv heads; a linear layer's state's value heads and its
    conv inputs' channels.

    A Gated DeltaNet layer whose value heads split runs split: its q, k and v channels come out of
    their projections over `model`, and XLA places the conv inputs a prefill keeps by their channels
    there. Placed by rows alone, they would be gathered onto every device after the prefill (each
    holding `model` times the bytes) and the new token's channels at every step; split, each device
    keeps and updates its own channels in place. Each channel's convolution is its own (nothing is
    summed across devices), so decoding computes the same numbers either way."""
    rows = (batch_axes(mesh) if cache.batch_size % batch_devices(mesh) == 0 else
            DATA if cache.batch_size % axis_size(mesh, DATA) == 0 else None)
    model = axis_size(mesh, MODEL)

    def place(stack, axes):  # one layer's (or stack's) arrays, and the axis of each that `model` splits
        split = all(leaf.shape[axis] % model == 0 for leaf, axis in zip(jax.tree.leaves(stack), jax.tree.leaves(axes)))

        def sharding(leaf, axis: int):  # axis counted from the end
            spec = [rows] + [None] * (leaf.ndim - 1)
            if split:
                spec[leaf.ndim + axis] = MODEL
            return NamedSharding(mesh, PartitionSpec(*spec))

        return jax.tree.map(sharding, stack, axes)

    return cache.replace(layers=cache.map_stacks(place, cache.heads_axes),
                         pos=NamedSharding(mesh, PartitionSpec(rows)),
                         stop=None if cache.stop is None else NamedSharding(mesh, PartitionSpec(rows)))


def put(tree, shardings):
    """`tree`'s arrays placed by `shardings` (a matching tree, or one sharding for all).

    On one process, `jax.device_put`. On several, each process places the blocks of its
    own devices, cut from its copy of each array: the arrays must be the same on every
    process (drawn from the same seed, read from the same file), as nothing is compared
    across processes (`jax.device_put` would gather and compare every array).
    """
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(put, tree, shardings)

    def place(x):
        if shardings.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, shardings)  # on one process; or from one global layout to another
        return jax.make_array_from_callback(np.shape(x), shardings, lambda index: x[index])

    return jax.tree.map(place, tree)


def to_host(tree):
    """`tree`'s arrays as numpy arrays on this host: fetched where this process holds them
    whole (one process, or replicated arrays), gathered from the other processes' devices
    where it does not (`process_allgather`: every process calls it, and every one gets the
    whole arrays). What a report or an export asks for; never the training's hot path."""
    def fetch(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return jax.device_get(x)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(fetch, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over `data` (and `expert`: `batch_axes`), everything else whole: for every array of a batch."""
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))
