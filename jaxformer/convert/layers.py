"""A `Decoder`'s parameters per layer (`block_{i}`) or stacked (`blocks`, `scan_layers`):
leaf `blocks/.../w[i]` is `block_{i}/.../w`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.config import DecoderConfig

STACKED = "blocks"


def block_name(i: int) -> str:
    return f"block_{i}"


def stack_layers(params: dict, n_layer: int) -> dict:
    """`block_0 .. block_{n_layer-1}` as one `blocks` subtree of `[n_layer, ...]` leaves.

    Raises:
      ValueError: a block is missing or left over, or the blocks do not share one tree
        structure.
    """
    missing = [block_name(i) for i in range(n_layer) if block_name(i) not in params]
    if missing:
        raise ValueError(f"params: no {missing[0]} to stack (want block_0 .. block_{n_layer - 1}, one per layer)")
    blocks = [params[block_name(i)] for i in range(n_layer)]
    structure = jax.tree.structure(blocks[0])
    for i, block in enumerate(blocks):
        if jax.tree.structure(block) != structure:
            raise ValueError(f"params: {block_name(i)} does not have block_0's parameters, so they cannot stack")
    rest = {name: value for name, value in params.items() if name not in {block_name(i) for i in range(n_layer)}}
    extra = sorted(name for name in rest if name.startswith("block_") or name == STACKED)
    if extra:  # a deeper model than the config says: stacking n_layer blocks would drop these silently
        raise ValueError(f"params: {extra} besides block_0 .. block_{n_layer - 1}: not a {n_layer}-layer model")
    return {**rest, STACKED: jax.tree.map(lambda *leaves: jnp.stack(leaves), *blocks)}


def unstack_layers(params: dict) -> dict:
    """The `blocks` subtree as `block_0 .. block_{n_layer-1}`, the inverse of `stack_layers`.

    Raises:
      ValueError: there is no `blocks` subtree.
    """
    if STACKED not in params:
        raise ValueError("params: no 'blocks' subtree to unstack (not a scan_layers=True parameter tree)")
    stacked = params[STACKED]
    n_layer = jax.tree.leaves(stacked)[0].shape[0]
    rest = {name: value for name, value in params.items() if name != STACKED}
    return {**rest, **{block_name(i): jax.tree.map(lambda leaf, i=i: leaf[i], stacked) for i in range(n_layer)}}


def with_scan_layers(config: DecoderConfig, params: dict, scan_layers: bool) -> tuple[DecoderConfig, dict]:
    """`(config, params)` in the form `scan_layers` asks for, computing the same logits;
    the same objects when they are in it."""
    if scan_layers == config.scan_layers:
        return config, params
    params = stack_layers(params, config.n_layer) if scan_layers else unstack_layers(params)
    return config.replace(scan_layers=scan_layers), params
