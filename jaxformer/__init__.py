"""jaxformer: the 2017 encoder-decoder Transformer and a modern decoder-only
Transformer, written out plainly in JAX/Flax.

What a user calls is here; the parts the models are built from (attention, norms,
positions, feed-forward layers, the blocks) stay in their modules: `jaxformer.attention`,
`jaxformer.norms`, `jaxformer.positions`, `jaxformer.feedforward`, `jaxformer.vanilla`, ...
"""

from jaxformer.cache import KVCache
from jaxformer.config import DecoderConfig, LoraConfig, RopeScaling, VanillaConfig
from jaxformer.convert import load_hf, save_hf
from jaxformer.convert.peft import load_peft, save_peft
from jaxformer.decoder import Decoder
from jaxformer.decoding import generate, sample_token, stream
from jaxformer.lora import init_lora, merge
from jaxformer.losses import chunked_cross_entropy, label_smoothed_cross_entropy
from jaxformer.schedules import noam_schedule, warmup_cosine_schedule
from jaxformer.serving import Engine
from jaxformer.text import load_tokenizer, save_tokenizer
from jaxformer.text.perplexity import perplexity
from jaxformer.vanilla import VanillaTransformer

__all__ = [
    # the two models and their configurations
    "Decoder", "DecoderConfig", "RopeScaling", "VanillaTransformer", "VanillaConfig",
    # decoding: whole runs, token by token, one pick, the cache they carry, a server's engine
    "generate", "stream", "sample_token", "KVCache", "Engine",
    # checkpoint folders, tokenizers, LoRA adapters (peft's files)
    "load_hf", "save_hf", "load_tokenizer", "save_tokenizer", "LoraConfig", "init_lora", "merge", "load_peft",
    "save_peft",
    # training and evaluation
    "label_smoothed_cross_entropy", "chunked_cross_entropy", "noam_schedule", "warmup_cosine_schedule", "perplexity",
]
