"""jaxformer: the 2017 encoder-decoder Transformer and a modern decoder-only
Transformer, written out plainly in JAX/Flax."""

from jaxformer.attention import (GQASelfAttention, MultiHeadAttention, attention_weights, combine_values,
                                 dot_product_attention)
from jaxformer.cache import KVCache, LayerKV
from jaxformer.config import DecoderConfig, RopeScaling, VanillaConfig
from jaxformer.decoder import Block, Decoder
from jaxformer.feedforward import FeedForward, SwiGLU
from jaxformer.decoding import generate, sample_token, stream
from jaxformer.losses import chunked_cross_entropy, label_smoothed_cross_entropy
from jaxformer.norms import LayerNorm, RMSNorm
from jaxformer.positions import (apply_rope, interleaved_to_split_half, rope_attention_factor, rope_cos_sin,
                                 rope_inv_freq, sinusoidal_table)
from jaxformer.schedules import noam_schedule, warmup_cosine_schedule
from jaxformer.vanilla import DecoderLayer, EncoderLayer, Residual, VanillaTransformer

__all__ = [
    "Block",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "MultiHeadAttention",
    "Residual",
    "VanillaConfig",
    "VanillaTransformer",
    "attention_weights",
    "chunked_cross_entropy",
    "combine_values",
    "sinusoidal_table",
    "stream",
    "warmup_cosine_schedule",
    "Decoder",
    "DecoderConfig",
    "GQASelfAttention",
    "KVCache",
    "LayerNorm",
    "LayerKV",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "dot_product_attention",
    "generate",
    "interleaved_to_split_half",
    "label_smoothed_cross_entropy",
    "noam_schedule",
    "RopeScaling",
    "rope_attention_factor",
    "rope_cos_sin",
    "rope_inv_freq",
    "sample_token",
]
