"""`write_safetensors` against safetensors' own reader, and `save_hf` keeping the parameters' dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_params
from safetensors import safe_open

from jaxformer import DecoderConfig
from jaxformer.convert import load_hf, save_hf
from jaxformer.convert.safetensors_file import SafetensorsFile, write_safetensors


def test_safetensors_reads_what_write_safetensors_wrote(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float16),
               "c": rng.standard_normal((2, 3, 4)).astype(jnp.bfloat16)}
    asked = []

    def read(name):
        asked.append(name)
        return tensors[name]
    write_safetensors(tmp_path / "t.safetensors", [(k, v.shape, v.dtype) for k, v in tensors.items()], read,
                      {"format": "pt"})
    assert asked == ["a", "b", "c"]  # each asked for once, in order
    with safe_open(str(tmp_path / "t.safetensors"), framework="numpy") as f:  # safetensors' checks of the header
        assert f.metadata() == {"format": "pt"}
        np.testing.assert_array_equal(f.get_tensor("a"), tensors["a"])
        np.testing.assert_array_equal(f.get_tensor("b"), tensors["b"])
    ours = SafetensorsFile(str(tmp_path / "t.safetensors"))
    np.testing.assert_array_equal(ours.tensor("c").view(np.uint16), tensors["c"].view(np.uint16))


def test_write_safetensors_refuses_a_tensor_unlike_its_announcement(tmp_path):
    with pytest.raises(ValueError, match=r"a: announced \(2,\) float32, given \(3,\) float32"):
        write_safetensors(tmp_path / "t.safetensors", [("a", (2,), np.float32)], lambda _: np.zeros(3, np.float32))


def test_save_hf_writes_the_parameters_dtype_bit_for_bit(tmp_path):
    config = DecoderConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, d_model=16, max_seq_len=32,
                           param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), random_params(config, seed=0))
    save_hf(config, params, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    _, again = load_hf(str(tmp_path), dtype=jnp.bfloat16)
    assert jax.tree.all(jax.tree.map(lambda a, b: a.dtype == b.dtype and bool(jnp.array_equal(a, b)), params, again))
