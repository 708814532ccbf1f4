"""Weights in and out of jaxformer: Hugging Face checkpoints of `jaxformer.families.FAMILIES`, PyTorch's
`nn.Transformer`, the RoPE pairing permutation between conventions, and the per-layer
and stacked (scanned) forms of the decoder's parameters."""

from jaxformer.convert.hf import config_from_hf, config_to_hf, load_hf, load_hf_config, save_hf
from jaxformer.convert.layers import stack_layers, unstack_layers, with_scan_layers
from jaxformer.convert.rope_pairing import with_rope_pairing
from jaxformer.convert.torch_transformer import from_torch_transformer

__all__ = ["config_from_hf", "config_to_hf", "from_torch_transformer", "load_hf", "load_hf_config", "save_hf",
           "stack_layers", "unstack_layers", "with_rope_pairing", "with_scan_layers"]
