"""Moving a decoder's weights between the two RoPE pairings (docs/parity.md, "RoPE pairings").

Reordering the query and key channels alike leaves every score `q . k` unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxformer.attention import AttentionSpec
from jaxformer.config import ROPE_PAIRINGS, DecoderConfig
from jaxformer.positions import interleaved_to_split_half
from jaxformer.validation import one_of


def with_rope_pairing(config: DecoderConfig, params, pairing: str):
    """The same model (equal logits, up to rounding), its query/key channels reordered for `pairing`.

    Args:
      config: the `DecoderConfig` the parameters were trained with.
      params: a `Decoder` parameter tree.
      pairing: "split_half" or "interleaved", the pairing wanted.

    Returns:
      `(new_config, new_params)`, `wq`, `wk`, `bq`, `bk` permuted along head_dim; the same
      objects when `pairing` is already the config's.
    """
    one_of(pairing, "pairing", ROPE_PAIRINGS)
    if pairing == config.rope_pairing:
        return config, params
    for i, spec in enumerate(config.layers):  # (q and k whose channels are not all RoPE's: not permuted here)
        mixer = spec.mixer
        if not isinstance(mixer, AttentionSpec) or mixer.output_gate or mixer.rotary_dim != mixer.head_dim:
            raise ValueError(f"config.layers[{i}]: a mixer other than attention rotating all of q and k (an output "
                             f"gate, partial rotary, another kind) keeps its RoPE pairing ({config.rope_pairing!r}); "
                             f"it cannot be moved to {pairing!r}")
    perm = interleaved_to_split_half(config.head_dim)  # split_half[..., i] = interleaved[..., perm[i]]
    if pairing == "interleaved":
        perm = np.argsort(perm)

    def permuted(path, leaf):  # a block's q and k, scanned or not: head_dim is the last axis of each
        names = [getattr(key, "key", None) for key in path]
        return leaf[..., perm] if names[-2:-1] == ["attn"] and names[-1] in ("wq", "wk", "bq", "bk") else leaf

    new_params = jax.tree_util.tree_map_with_path(permuted, params)
    layers = tuple(dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, rope_pairing=pairing))
                   for spec in config.layers)  # (filled specs pair as the config does: `layers.MODEL_WIDE`)
    return config.replace(rope_pairing=pairing, layers=layers), new_params
