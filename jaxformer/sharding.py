"""Both models over a mesh of devices: data parallel, fully sharded data parallel, and
tensor parallel. JAX's SPMD compiler does the communication; this module only says
where each array lives.

A mesh has two named axes:

    data:   batch rows are split across it. Data parallel (`"dp"`) keeps a full copy of
            every parameter on each device; fully sharded data parallel (`"fsdp"`) also
            splits every parameter (and its optimizer moments) across it, and the
            compiler gathers each one when a layer needs it.
    model:  tensor parallelism, the Megatron way: the first matrix of each pair splits
            its outputs (attention heads, FFN hidden units) and the second its inputs,
            so every device computes whole heads and whole hidden units, and one sum
            across devices finishes each block.

The rules name tensors by the end of their path in the parameter tree, so the same
rules fit the optimizer state, whose moment trees repeat the parameter paths. A
dimension that does not divide evenly over its axis is kept whole.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
STRATEGIES = ("dp", "fsdp")

# (the end of a parameter's path, the dimension split over `model`).
TENSOR_PARALLEL = (
    # decoder-only: wq/wk/wv [d_model, heads, head_dim] and their biases [heads, head_dim]
    # split the heads; wo [heads, head_dim, d_model] its input heads. SwiGLU's
    # w_gate/w_up [d_model, ffn] split the hidden units, w_down [ffn, d_model] its input.
    ("attn/wq", 1), ("attn/wk", 1), ("attn/wv", 1), ("attn/bq", 0), ("attn/bk", 0), ("attn/bv", 0),
    ("attn/wo", 0), ("mlp/w_gate", 1), ("mlp/w_up", 1), ("mlp/w_down", 0),
    # 2017 model: w_qkv [d_model, 3, heads, head_dim], b_qkv [3, heads, head_dim],
    # w_o [heads, head_dim, d_model]; the ReLU FFN's w1 [d_model, d_ff], b1, w2 [d_ff, d_model].
    ("_attn/w_qkv", 2), ("_attn/b_qkv", 1), ("_attn/w_o", 0), ("ffn/w1", 1), ("ffn/b1", 0), ("ffn/w2", 0),
    # Vocabulary-parallel embeddings and output layers: [vocab, d_model] tables split their
    # rows, [d_model, vocab] heads their columns; the softmax then spans the devices.
    ("embed", 0), ("lm_head", 1), ("out_proj", 1), ("out_bias", 0),
)


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A `(data, model)` mesh over `devices` (default: all of them).

    Args:
      data: devices along the batch axis; None takes every device `model` leaves.
      model: devices along the tensor-parallel axis.
      devices: the devices to use, in order; defaults to `jax.devices()`.

    Returns:
      A `jax.sharding.Mesh` with axes `("data", "model")`.
    """
    devices = jax.devices() if devices is None else list(devices)
    if type(model) is not int or model < 1 or len(devices) % model:
        raise ValueError(f"make_mesh: model must be a positive int dividing the device count "
                         f"{len(devices)}, got {model!r}")
    data = len(devices) // model if data is None else data
    if type(data) is not int or data < 1 or data * model != len(devices):
        raise ValueError(f"make_mesh: data * model must equal the device count {len(devices)}, "
                         f"got data={data!r} x model={model}")
    return Mesh(np.asarray(devices).reshape(data, model), (DATA, MODEL))


def parse_mesh(spec: str) -> dict[str, int]:
    """`"data=4,model=2"` as `{"data": 4, "model": 2}` (either may be left out)."""
    sizes = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in (DATA, MODEL) or name in sizes:
            raise ValueError(f"mesh {spec!r}: each part must be data=N or model=M, once (got {part!r})")
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh {spec!r}: {name} must be a positive int (got {value!r})")
        sizes[name] = int(value)
    return sizes


def check_fits(config, mesh: Mesh) -> None:
    """Query heads are split over `model`: their count must divide evenly. (Key/value
    heads that do not divide are kept whole on every device instead, see `partition_spec`.)"""
    n_model = mesh.shape[MODEL]
    if config.n_head % n_model:
        raise ValueError(f"{type(config).__name__}.n_head={config.n_head} is not divisible by the mesh's "
                         f"model axis ({n_model}): tensor parallelism splits whole heads")


def _path_name(path) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)


def partition_spec(name: str, shape: tuple[int, ...], mesh: Mesh, strategy: str = "dp") -> PartitionSpec:
    """Where one array lives: its `model` split from `TENSOR_PARALLEL`, then with FSDP
    its largest remaining dimension that divides evenly split over `data`.

    A dimension that does not divide over its axis stays whole: GQA's few kv heads
    (`n_kv_head < model`) are then computed on every device, which costs a little work
    and no communication.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    spec = [None] * len(shape)
    n_model, n_data = mesh.shape[MODEL], mesh.shape[DATA]
    for suffix, dim in TENSOR_PARALLEL:
        if name.endswith(suffix) and n_model > 1 and shape[dim] % n_model == 0:
            spec[dim] = MODEL
    if strategy == "fsdp" and n_data > 1:
        free = [i for i, size in enumerate(shape) if spec[i] is None and size % n_data == 0]
        if free:
            spec[max(free, key=lambda i: shape[i])] = DATA
    return PartitionSpec(*spec)


def tree_shardings(tree, mesh: Mesh, strategy: str = "dp"):
    """A `NamedSharding` for every leaf of a parameter or optimizer-state tree."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, partition_spec(_path_name(path), np.shape(x), mesh, strategy)), tree)


def mesh_of(params) -> Mesh | None:
    """The mesh `params` are placed on (by `tree_shardings`), or None on a single device."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
            return sharding.mesh
    return None


def cache_shardings(cache, mesh: Mesh):
    """Where a `KVCache` lives on `mesh`: rows over `data` and kv heads over `model`, each
    where it divides evenly (else kept whole), as the attention that reads it is split."""
    batch, n_kv = cache.layers[0].k.shape[0], cache.layers[0].k.shape[2]
    rows = DATA if batch % mesh.shape[DATA] == 0 else None
    heads = MODEL if n_kv % mesh.shape[MODEL] == 0 else None
    kv = NamedSharding(mesh, PartitionSpec(rows, None, heads, None))  # [batch, capacity, n_kv, head_dim]
    return cache.replace(layers=tuple(layer.replace(k=kv, v=kv) for layer in cache.layers),
                         pos=NamedSharding(mesh, PartitionSpec()), start=NamedSharding(mesh, PartitionSpec(rows)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows split over `data`, everything else whole: for every array of a batch."""
    return NamedSharding(mesh, PartitionSpec(DATA))
