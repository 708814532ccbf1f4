"""`load_hf(quantize=...)`: each matrix quantized as it is read is the one `quantize_params` makes of
the float model (so the loaded model is the in-memory quantized one), stacked experts and scanned
layers too; everything else as stored; refusals before any tensor is read."""

import jax
import numpy as np
import pytest
from conftest import SMALL, random_params

from jaxformer import Decoder
from jaxformer.convert import config_from_hf, load_hf, save_hf
from jaxformer.quantized import HEAD, MATRICES, QArray, Quantization, quantize_params
from jaxformer.sharding import param_axes

MIXTRAL = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
           "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "num_local_experts": 4, "num_experts_per_tok": 2}
CONFIGS = {"llama": SMALL, "mixtral": config_from_hf(MIXTRAL)}


def leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QArray))[0]


INT8, INT4, NF4 = Quantization("int8"), Quantization("int4", 32, affine=True), Quantization("nf4", 32)
HEADS = Quantization("int8", head=True), Quantization("nf4", 32, head=True)  # the embedding and head too
FAST = [("llama", INT8, False), ("mixtral", NF4, True), ("llama", HEADS[0], False), ("mixtral", HEADS[1], True)]
EVERY = [(family, how, scan) for family in CONFIGS for how in (INT8, INT4, NF4, *HEADS) for scan in (False, True)
         if (family, how, scan) not in FAST]


@pytest.mark.parametrize("family,how,scan_layers", FAST, ids=str)
def test_each_matrix_is_quantized_as_read_and_the_rest_kept(tmp_path, family, how, scan_layers):
    quantized_as_read(tmp_path, family, how, scan_layers)


@pytest.mark.parametrize("family,how,scan_layers", EVERY, ids=str)
def test_every_format_family_and_form_quantizes_as_read(tmp_path, family, how, scan_layers):
    quantized_as_read(tmp_path, family, how, scan_layers)


def quantized_as_read(tmp_path, family, how, scan_layers):
    config = CONFIGS[family]
    params = random_params(config, seed=1)
    save_hf(config, params, str(tmp_path))
    loaded_config, loaded = load_hf(str(tmp_path), quantize=how, scan_layers=scan_layers)
    model = Decoder(loaded_config)
    if scan_layers:
        from jaxformer.convert.layers import with_scan_layers

        loaded_config, loaded = with_scan_layers(loaded_config, loaded, False)
    want = quantize_params(params, param_axes(Decoder(config)), how)
    got, expected = leaves(loaded), leaves(want)
    assert [p for p, _ in got] == [p for p, _ in expected]
    names, n = MATRICES | (HEAD if how.head else frozenset()), 0
    for (path, a), (_, b) in zip(got, expected):
        assert type(a) is type(b), path
        if isinstance(a, QArray):
            n += 1
            assert path[-1].key in names and a.qvalue.dtype == b.qvalue.dtype
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
        else:
            np.testing.assert_array_equal(a, b, err_msg=str(path))
    assert n == sum(path[-1].key in names for path, _ in leaves(params))
    tokens = np.arange(8)[None] % config.vocab_size
    logits = model.apply({"params": load_hf(str(tmp_path), quantize=how, scan_layers=scan_layers)[1]}, tokens)[0]
    np.testing.assert_allclose(logits, Decoder(config).apply({"params": want}, tokens)[0], rtol=1e-5, atol=1e-5)


def test_bad_quantize_options_are_refused_before_any_tensor_is_read(tmp_path):
    save_hf(SMALL, random_params(SMALL, seed=1), str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # would fail if read
    with pytest.raises(ValueError, match="quantize must be one of"):
        load_hf(str(tmp_path), quantize="int2")
    with pytest.raises(ValueError, match="group_size: 128 does not divide the matrix's inputs"):
        load_hf(str(tmp_path), quantize=Quantization("int4", 128))
