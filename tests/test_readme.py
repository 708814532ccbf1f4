"""The README's code examples run as written."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxformer
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
