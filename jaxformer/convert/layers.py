"""A `Decoder`'s parameters per layer (`block_{i}`) or scanned (`scan_layers`), and the one
into the other.

Scanned, each segment of layers (`jaxformer.layers.segments`: a run of one period of specs,
repeated) is one subtree, `blocks`, `blocks_1`, `blocks_2`, ... in order, whose leaves stack
its periods on a leading axis. A segment of one body holds the block's parameters itself; a
longer period holds one subtree per body, `block_{j}`:

    blocks/attn/wq[r]                  layer first + r              (a period of one body)
    blocks_1/block_2/attn/wq[r]        layer first + r * period + 2  (a period of several)

A uniform model is one segment of one body: leaf `blocks/.../w[i]` is `block_{i}/.../w`, and
so is Gemma 3's (its full and sliding layers share one body). `scanned_places` gives each
layer's subtree and row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.config import DecoderConfig
from jaxformer.layers import layer_specs, scan_name, scanned_places


def block_name(i: int) -> str:
    return f"block_{i}"


def _stacks(config: DecoderConfig) -> dict[tuple[str, ...], list[int]]:
    """`{path: the layers stacked under it, row by row}` in `config`'s scanned form."""
    stacks: dict[tuple[str, ...], list[int]] = {}
    for i, (path, _, _) in enumerate(scanned_places(layer_specs(config))):
        stacks.setdefault(path, []).append(i)
    return stacks


def _with(tree: dict, path: tuple[str, ...], value) -> dict:
    """`tree` with `value` at `path`, the dicts along it new ones."""
    if not path:
        return value
    return {**tree, path[0]: _with(tree.get(path[0], {}), path[1:], value)}


def stack_layers(params: dict, config: DecoderConfig) -> dict:
    """`block_0 .. block_{n_layer-1}` in the scanned form of `config`: each segment's
    subtrees of `[repeats, ...]` leaves (the module's docstring).

    Raises:
      ValueError: a block is missing or left over, or blocks that stack do not share one tree
        structure.
    """
    n_layer = config.n_layer
    missing = [block_name(i) for i in range(n_layer) if block_name(i) not in params]
    if missing:
        raise ValueError(f"params: no {missing[0]} to stack (want block_0 .. block_{n_layer - 1}, one per layer)")
    rest = {name: value for name, value in params.items() if name not in {block_name(i) for i in range(n_layer)}}
    extra = sorted(name for name in rest if name.startswith(("block_", scan_name(0))))
    if extra:  # a deeper model than the config says: stacking n_layer blocks would drop these silently
        raise ValueError(f"params: {extra} besides block_0 .. block_{n_layer - 1}: not a {n_layer}-layer model")
    for path, layers in _stacks(config).items():
        blocks = [params[block_name(i)] for i in layers]
        structure = jax.tree.structure(blocks[0])
        for i, block in zip(layers, blocks):
            if jax.tree.structure(block) != structure:
                raise ValueError(f"params: {block_name(i)} does not have {block_name(layers[0])}'s parameters, so "
                                 "they cannot stack")
        rest = _with(rest, path, jax.tree.map(lambda *leaves: jnp.stack(leaves), *blocks))
    return rest


def unstack_layers(params: dict, config: DecoderConfig) -> dict:
    """The scanned form of `config` as `block_0 .. block_{n_layer-1}`, the inverse of `stack_layers`.

    Raises:
      ValueError: a segment's subtree is missing, or stacks another number of layers.
    """
    stacks = _stacks(config)
    names = {path[0] for path in stacks}
    missing = sorted(names - set(params))
    if missing:
        raise ValueError(f"params: no {missing[0]!r} subtree to unstack (not a scan_layers=True parameter tree "
                         f"of this config)")
    blocks = {}
    for path, layers in stacks.items():
        stacked = functools.reduce(lambda tree, name: tree[name], path, params)
        rows = jax.tree.leaves(stacked)[0].shape[0]
        if rows != len(layers):
            raise ValueError(f"params: {'/'.join(path)} stacks {rows} layers, not the config's {len(layers)}")
        blocks.update({block_name(i): jax.tree.map(lambda leaf, row=row: leaf[row], stacked)
                       for row, i in enumerate(layers)})
    rest = {name: value for name, value in params.items() if name not in names}
    return {**rest, **{name: blocks[name] for name in map(block_name, range(config.n_layer))}}


def with_scan_layers(config: DecoderConfig, params: dict, scan_layers: bool) -> tuple[DecoderConfig, dict]:
    """`(config, params)` in the form `scan_layers` asks for, computing the same logits;
    the same objects when they are in it."""
    if scan_layers == config.scan_layers:
        return config, params
    params = stack_layers(params, config) if scan_layers else unstack_layers(params, config)
    return config.replace(scan_layers=scan_layers), params
