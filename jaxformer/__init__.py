"""jaxformer: the 2017 encoder-decoder Transformer and a modern decoder-only
Transformer, written out plainly in JAX/Flax."""

from jaxformer.attention import GQASelfAttention, dot_product_attention
from jaxformer.cache import KVCache, LayerKV
from jaxformer.config import DecoderConfig
from jaxformer.decoder import Block, Decoder
from jaxformer.feedforward import SwiGLU
from jaxformer.generation import generate, sample_token
from jaxformer.norms import RMSNorm
from jaxformer.positions import apply_rope, interleaved_to_split_half, rope_tables

__all__ = [
    "Block",
    "Decoder",
    "DecoderConfig",
    "GQASelfAttention",
    "KVCache",
    "LayerKV",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "dot_product_attention",
    "generate",
    "interleaved_to_split_half",
    "rope_tables",
    "sample_token",
]
