"""SmolLM3: Llama's layout and fields, with NoPE layers: `no_rope_layers[i]` is 1 where layer i
rotates q and k, 0 where it does not (a NoPE layer: `AttentionSpec.use_rope` False); absent, every
`no_rope_layer_interval`-th layer (default 4) is NoPE, as transformers makes it. Its RoPE base
defaults to 2000000."""

from __future__ import annotations

import dataclasses

from jaxformer.config import DecoderConfig
from jaxformer.families.common import Family, fail, hf_layer_types, positive_int, refuse_set, refuse_sliding
from jaxformer.families.llama import llama_layer, read_llama, write_llama
from jaxformer.layers import layer_specs
from jaxformer.validation import python_int

DEFAULT_THETA = 2000000.0  # SmolLM3Config's, where config.json names no rope_theta


def rotating_layers(hf: dict, n_layer: int) -> list[bool]:
    """Whether each layer rotates: `no_rope_layers` (1 or 0 a layer, at least `n_layer` of them, as
    transformers reads its first `n_layer`), else all but every `no_rope_layer_interval`-th."""
    given = hf.get("no_rope_layers")
    if given is None:
        interval = positive_int(hf, "no_rope_layer_interval", default=4)
        return [(i + 1) % interval != 0 for i in range(n_layer)]
    if not (isinstance(given, list) and len(given) >= n_layer and all(python_int(f) in (0, 1) for f in given)):
        fail("no_rope_layers", f"must list 1 (RoPE) or 0 (NoPE) for each of the {n_layer} (num_hidden_layers) layers",
             given)
    return [python_int(f) == 1 for f in given[:n_layer]]


def read_smollm3(hf: dict, max_seq_len: int | None) -> dict:
    # (transformers slides its NoPE layers where `use_sliding_window` is set: no shipped SmolLM3 does.)
    refuse_set(hf, "use_sliding_window", False, "SmolLM3's sliding window is not implemented")
    refuse_sliding(hf)
    fields = read_llama(hf, max_seq_len, default_theta=DEFAULT_THETA)
    derived = layer_specs(DecoderConfig(**fields))
    return dict(fields, layers=tuple(dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, use_rope=rope))
                                     for spec, rope in zip(derived, rotating_layers(hf, fields["n_layer"]))))


def write_smollm3(config: DecoderConfig) -> dict:
    return {**write_llama(config), "use_sliding_window": False, "sliding_window": None,
            "layer_types": hf_layer_types(config),
            "no_rope_layers": [int(spec.mixer.use_rope) for spec in layer_specs(config)]}


SMOLLM3 = Family("smollm3", "SmolLM3ForCausalLM", read_smollm3, write_smollm3, llama_layer)
