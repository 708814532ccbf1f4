"""The README's code examples run as written."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
from conftest import import_peer

import jaxformer
from jaxformer.convert import save_hf
from train.tasks import reverse_batch

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_decoder_only_example_runs():
    namespace = {}
    exec(compile(BLOCKS[0].replace("print(token)", "assert token.shape == (1,)"), "README block 1", "exec"), namespace)
    assert namespace["out"].shape == (2, 4 + 20)


def test_encoder_decoder_example_runs():
    batch = reverse_batch(jax.random.key(0), 4)
    namespace = {"jax": jax, "jnp": jnp, "jf": jaxformer, "key": jax.random.key(1), **batch}
    exec(compile(BLOCKS[1], "README block 2", "exec"), namespace)
    assert namespace["out"].shape == (4, 12) and namespace["cross"].shape == (4, 4, 11, 10)


def test_hugging_face_example_runs(tmp_path):
    config = jaxformer.DecoderConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=16)
    params = jaxformer.Decoder(config).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]
    save_hf(config, params, str(tmp_path / "checkpoint"))
    code = BLOCKS[2].replace("path/to/", f"{tmp_path}/")
    namespace = {"jax": jax, "jnp": jnp, "jf": jaxformer}
    exec(compile(code, "README block 3", "exec"), namespace)
    assert namespace["out"].shape == (1, 4 + 20)
    assert (tmp_path / "copy" / "model.safetensors").exists()


def test_torch_transformer_example_runs():
    import_peer("torch")
    batch = reverse_batch(jax.random.key(0), 4)
    namespace = {"jax": jax, "jnp": jnp, "jf": jaxformer, **batch}
    exec(compile(BLOCKS[3], "README block 4", "exec"), namespace)
    assert namespace["logits"].shape == (4, 11, 19)
