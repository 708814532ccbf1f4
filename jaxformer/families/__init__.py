"""Checkpoint families: each module reads and writes one family's `config.json` and lists
its tensors (`common.Family`); the model itself is shared. To add a family, write its
module and add its `Family` to `FAMILIES` (docs/architecture.md, "Checkpoint families")."""

from jaxformer.families.common import Family
from jaxformer.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3, KIMI_K2
from jaxformer.families.gemma import GEMMA, GEMMA2, GEMMA3
from jaxformer.families.gemma4 import GEMMA4_TEXT
from jaxformer.families.gpt_oss import GPT_OSS
from jaxformer.families.llama import LLAMA, MISTRAL, QWEN2
from jaxformer.families.mixtral import MIXTRAL
from jaxformer.families.olmo import OLMO2, OLMO3
from jaxformer.families.olmoe import OLMOE
from jaxformer.families.phi3 import PHI3
from jaxformer.families.qwen3 import QWEN3
from jaxformer.families.qwen3_next import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from jaxformer.families.qwen_moe import QWEN2_MOE, QWEN3_MOE
from jaxformer.families.smollm3 import SMOLLM3

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA, GEMMA2, GEMMA3, PHI3,
                                                         SMOLLM3, OLMO2, OLMO3, QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE,
                                                         GPT_OSS, DEEPSEEK_V3, KIMI_K2, DEEPSEEK_V2, QWEN3_NEXT,
                                                         QWEN3_5, QWEN3_5_MOE, GEMMA4_TEXT)}


def family_of(config) -> Family:
    """The family `save_hf` writes a `DecoderConfig` as: its `hf_model_type` (an image-text
    checkpoint's text model's), else Qwen2 with q/k/v biases, else Llama."""
    model_type = config.hf_model_type or ("qwen2" if config.qkv_bias else "llama")
    if model_type not in FAMILIES:
        raise ValueError(f"config.hf_model_type must be one of {sorted(FAMILIES)} (got {model_type!r})")
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "family_of"]
