"""`benchmarks.llama_1b`'s shapes: the published models' parameter counts, and configs read as those models'."""

import math

import pytest

from benchmarks import llama_1b
from jaxformer.convert import config_from_hf


@pytest.mark.parametrize("shape, count, tied", [("1b", 1_235_814_400, True), ("8b", 8_030_261_248, False)])
def test_each_shape_has_the_published_models_parameters(shape, count, tied):
    config, _ = llama_1b.SHAPES[shape]
    assert sum(math.prod(dims) for dims in llama_1b.tensor_shapes(config).values()) == count
    ours = config_from_hf(config)
    assert ours.tie_embeddings == tied and ours.d_model == config["hidden_size"]
    assert ours.d_model // ours.n_head == config["head_dim"]
