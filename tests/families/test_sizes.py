"""Each shipped mixture of experts read from its own config.json has the size its makers
publish: its parameters all told and those a token reads (its k experts of each layer, and
a shared expert), from the checkpoint's tensor table that `load_hf` reads (nothing is
allocated); each shipped dense model its parameters all told. A reader that took a width, a
count or a dense layer wrongly would be off by far more than the figures' rounding."""

import math

import pytest
from shipped import SHIPPED

from jaxformer.convert import config_from_hf
from jaxformer.experts import ExpertsSpec
from jaxformer.families import family_of
from jaxformer.layers import layer_specs

# (total, second figure, what the second counts) in billions as published, to the digits published:
# the parameters a token reads ("active"), those without the embedding (OpenAI's count for
# gpt-oss), or every parameter but the embedding and the output head ("non-embedding").
PUBLISHED = {
    # Qwen's model card: "30.5B in total and 3.3B activated", "Number of Parameters (Non-Embedding): 29.9B"
    "Qwen3-30B-A3B": (30.5, 29.9, "non-embedding"),
    "Qwen3-235B-A22B": (235, 22, "active"),
    "Mixtral-8x7B-v0.1": (46.7, 12.9, "active"),  # Mistral AI: "46.7B total parameters but only uses 12.9B per token"
    "Mixtral-8x22B-v0.1": (141, 39, "active"),
    "OLMoE-1B-7B-0924": (6.9, 1.3, "active"),  # its paper: 6.9B total, 1.3B active
    "Qwen1.5-MoE-A2.7B": (14.3, 2.7, "active"),
    "Qwen2-57B-A14B": (57, 14, "active"),
    "gpt-oss-20b": (20.91, 3.61, "active without the embedding"),  # OpenAI's model card
    "gpt-oss-120b": (116.83, 5.13, "active without the embedding"),
    # DeepSeek's weights document (README_WEIGHTS.md): the main model's "Total parameters: 671B", "Activation
    # parameters: 36.6B (including 0.9B for the output Head)" (the multi-token prediction module apart)
    "DeepSeek-V3": (671, 36.6, "active without the embedding"),
}


def digits(x: float) -> float:
    """Half a unit of the last digit `x` is written to: its rounding."""
    text = repr(x)
    return 0.5 * 10 ** -(len(text.split(".")[1]) if "." in text else 0)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_shipped_mixture_has_its_published_size(name):
    total_b, second_b, what = PUBLISHED[name]
    config = config_from_hf(dict(SHIPPED[name], quantization_config=None), max_seq_len=64)
    total = sum(math.prod(t.shape) for t in family_of(config).tensors(config))

    def idle(spec: ExpertsSpec) -> int:  # the parameters of the experts a token does not choose
        biases = 2 * spec.width + config.d_model if spec.expert_bias else 0
        return (spec.n_experts - spec.top_k) * (3 * config.d_model * spec.width + biases)

    embedding = config.vocab_size * config.d_model
    second = {"active": total - sum(idle(s.ffn) for s in layer_specs(config) if isinstance(s.ffn, ExpertsSpec)),
              "non-embedding": total - embedding * (1 if config.tie_embeddings else 2)}
    second["active without the embedding"] = second["active"] - embedding
    assert abs(total / 1e9 - total_b) <= digits(total_b), total / 1e9
    assert abs(second[what] / 1e9 - second_b) <= digits(second_b), second[what] / 1e9


# Dense checkpoints, their parameters all told: to the parameter as the hub's safetensors index counts them
# (OLMo 2 7B's; OLMo 3 7B's as a fine-tune of it declares), or in billions as published (SmolLM3's blog: 3.08B).
PUBLISHED_DENSE = {"SmolLM3-3B": 3.08, "OLMo-2-1124-7B": 7_298_617_344, "Olmo-3-1025-7B": 7_298_011_136}


@pytest.mark.parametrize("name", sorted(PUBLISHED_DENSE))
def test_each_shipped_dense_model_has_its_published_size(name):
    config = config_from_hf(SHIPPED[name], max_seq_len=64)
    total, published = sum(math.prod(t.shape) for t in family_of(config).tensors(config)), PUBLISHED_DENSE[name]
    if isinstance(published, int):
        assert total == published
    else:
        assert abs(total / 1e9 - published) <= digits(published), total / 1e9
