"""Moving a decoder's weights between the two RoPE pairings.

RoPE rotates channel pairs of every query and key head. Which channels form a pair is
a convention of the checkpoint:

    split_half:  (i, i + head_dim/2)   GPT-NeoX, Hugging Face Llama / Mistral / Qwen2
    interleaved: (2i, 2i + 1)          RoFormer, Meta's original Llama release

Pair i rotates at the same frequency in both, so the two models compute the same
function once the output channels of W_Q and W_K (and their biases) are reordered within
each head: q . k is a sum over channels, and reordering both sides alike leaves every
score unchanged. W_V and W_O are untouched (values are never rotated).
"""

from __future__ import annotations

import numpy as np

from jaxformer.config import ROPE_PAIRINGS, DecoderConfig
from jaxformer.convert.layers import STACKED, block_name
from jaxformer.positions import interleaved_to_split_half


def with_rope_pairing(config: DecoderConfig, params, pairing: str):
    """The same model, its query/key channels reordered for the other RoPE pairing.

    `Decoder(new_config).apply({'params': new_params}, tokens)` equals
    `Decoder(config).apply({'params': params}, tokens)` (up to float rounding).

    Args:
      config: the `DecoderConfig` the parameters were trained with.
      params: a `Decoder` parameter tree.
      pairing: "split_half" or "interleaved", the pairing wanted.

    Returns:
      `(new_config, new_params)`: `config.replace(rope_pairing=pairing)` and a copy of
      `params` with `wq`, `wk` (and `bq`, `bk`) permuted along their head_dim axis. The
      same objects when `pairing` is already the config's.
    """
    if pairing not in ROPE_PAIRINGS:
        raise ValueError(f"pairing: must be one of {ROPE_PAIRINGS} (got {pairing!r})")
    if pairing == config.rope_pairing:
        return config, params
    perm = interleaved_to_split_half(config.head_dim)  # split_half[..., i] = interleaved[..., perm[i]]
    if pairing == "interleaved":
        perm = np.argsort(perm)
    new_params = dict(params)
    blocks = [STACKED] if config.scan_layers else [block_name(i) for i in range(config.n_layer)]
    for block in blocks:
        attn = dict(params[block]["attn"])
        for name in ("wq", "wk", "bq", "bk"):  # head_dim is the last axis of each (stacked too)
            if name in attn:
                attn[name] = attn[name][..., perm]
        new_params[block] = {**params[block], "attn": attn}
    return config.replace(rope_pairing=pairing), new_params
