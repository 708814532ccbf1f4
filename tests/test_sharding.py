"""jaxformer.sharding: the logical axis names every parameter declares, on one device;
and the meshes on 8 simulated CPU devices.

JAX fixes its device count when it starts, so the cases in `sharding/eight_devices.py` run
in a subprocess started with `--xla_force_host_platform_device_count=8`; the rest of the
suite keeps its single device.
"""

import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import with_sinks
from jax.sharding import PartitionSpec

from jaxformer import Decoder, DecoderConfig, VanillaConfig, VanillaTransformer
from jaxformer.sharding import EMBED, HEAD_DIM, HEADS, KV_HEADS, MLP, QKV, VOCAB, make_mesh, param_axes, tree_shardings

CASES = Path(__file__).parent / "sharding" / "eight_devices.py"


def test_sharding_cases_on_eight_devices():
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8")
    # (-n 0: the cases run in that one process, not in pytest-xdist workers of their own. Stopped after 40
    # minutes: they took 19 on two cores beside the OLMoE decode.)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", str(CASES)],
                          env=env, capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


DECODER = DecoderConfig(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=16, max_seq_len=8)
VANILLA = VanillaConfig(src_vocab_size=12, tgt_vocab_size=12, n_layer=2, d_model=16, d_ff=24, n_head=4, max_seq_len=8)
MODELS = [Decoder(DECODER), Decoder(DECODER.replace(tie_embeddings=False, qkv_bias=True)), Decoder(with_sinks(DECODER)),
          VanillaTransformer(VANILLA), VanillaTransformer(VANILLA.replace(tie_embeddings=False, src_vocab_size=14,
                                                                          norm_first=True))]


@pytest.mark.parametrize("model", MODELS, ids=["decoder", "decoder-untied-bias", "decoder-sinks", "vanilla",
                                               "vanilla-untied-prenorm"])
def test_every_parameter_names_its_axes(model):
    params = model.init(jax.random.key(0), *model.init_inputs())["params"]
    axes = param_axes(model)
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    named = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0])
    assert len(named) == len(paths) > 10
    for path, leaf in paths:
        names = named[path]
        assert len(names) == leaf.ndim, (jax.tree_util.keystr(path), names, leaf.shape)
        assert set(names) <= {EMBED, VOCAB, HEADS, KV_HEADS, HEAD_DIM, MLP, QKV}
        sizes = {EMBED: model.config.d_model, HEADS: model.config.n_head, HEAD_DIM: model.config.head_dim,
                 MLP: model.config.ffn_dim}
        for name, size in zip(names, leaf.shape):  # the names say what the dimension is
            assert sizes.get(name, size) == size, (jax.tree_util.keystr(path), names, leaf.shape)


class _Unnamed(nn.Module):
    """A model whose one matrix is created with a plain `self.param`."""

    @nn.compact
    def __call__(self, x):
        return x @ self.param("w", nn.initializers.ones, (4, 4))

    @nn.nowrap
    def init_inputs(self):
        return (jnp.ones((1, 4)),)


def test_an_unnamed_parameter_fails_loudly():
    with pytest.raises(ValueError, match="parameter w has no logical axis names"):
        param_axes(_Unnamed())
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    with pytest.raises(ValueError, match=r"\['b'\] \(4,\): no parameter of this name has logical axis names"):
        tree_shardings(params, {"w": (EMBED, MLP)}, make_mesh(), "fsdp")
    with pytest.raises(ValueError, match="2-D, but its logical axes are"):
        tree_shardings({"w": jnp.ones((4, 4))}, {"w": (EMBED,)}, make_mesh(), "fsdp")
    # A scalar an optimizer keeps per parameter (under the parameter's path) is replicated.
    scalar = tree_shardings({"count": {"w": jnp.float32(0)}}, {"w": (EMBED, MLP)}, make_mesh(), "fsdp")
    assert scalar["count"]["w"].spec == PartitionSpec()


def test_the_mesh_check_reads_each_layers_heads():
    """Tensor parallelism splits whole heads of every layer: a layer whose mixer has other heads than
    the config's flat `n_head` is checked by its own."""
    import dataclasses
    import types

    from jaxformer.layers import layer_specs
    from jaxformer.sharding import check_mesh_fits

    config = DecoderConfig(vocab_size=32, n_layer=2, n_head=4, n_kv_head=1, d_model=32)
    specs = layer_specs(config)
    two = types.SimpleNamespace(shape={"data": 1, "model": 2})
    check_mesh_fits(config.replace(layers=specs), two)
    odd = config.replace(layers=(specs[0], dataclasses.replace(specs[1], mixer=dataclasses.replace(specs[1].mixer,
                                                                                                    n_head=3))))
    with pytest.raises(ValueError, match=r"DecoderConfig.layers\[1\].mixer.n_head=3 is not divisible by the mesh's "
                                         r"model axis \(2\)"):
        check_mesh_fits(odd, two)


def test_the_new_mixers_weights_name_their_axes_and_split_by_heads():
    """A hybrid's Gated DeltaNet layers and latent attention layers: every parameter names its axes, and
    on a model axis of 2 the rules split whole heads (value heads as query heads, key heads as kv heads)
    and never a latent's width or a convolution's taps."""
    import dataclasses
    import types

    from jaxformer.deltanet import GatedDeltaNetSpec
    from jaxformer.feedforward import GatedMLPSpec
    from jaxformer.latent_attention import LatentAttentionSpec
    from jaxformer.layers import LayerSpec, layer_specs
    from jaxformer.sharding import partition_spec

    linear = dataclasses.replace(layer_specs(DECODER)[0], mixer=GatedDeltaNetSpec(2, 4, 8, 8))
    latent = LayerSpec(LatentAttentionSpec(n_head=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                                           qk_rope_head_dim=8, v_head_dim=6, rope_theta=1e4, rope_scaling=None,
                                           rope_pairing="split_half"), GatedMLPSpec(24))
    mesh = types.SimpleNamespace(shape={"data": 2, "model": 2})
    P = PartitionSpec
    for layer, want in [(linear, {"wq": P(None, "model", None), "wv": P(None, "model", None),
                                  "conv_k": P("model", None, None), "a_log": P("model"), "wo": P("model", None, None)}),
                        (latent, {"wq_b": P(None, "model", None), "wkv_a": P(None, None),
                                  "wkv_b": P(None, "model", None), "wo": P("model", None, None)})]:
        model = Decoder(DECODER.replace(layers=(layer,) * 2))
        axes = param_axes(model)  # (refuses a parameter without names)
        params = jax.eval_shape(model.init, jax.random.key(0), *model.init_inputs())["params"]
        for (path, leaf), names in zip(jax.tree_util.tree_leaves_with_path(params),
                                       jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), strict=True):
            assert len(names) == leaf.ndim, (jax.tree_util.keystr(path), names, leaf.shape)
        attn = params["block_0"]["attn"]
        got = {name: partition_spec(axes["block_0"]["attn"][name], attn[name].shape, mesh) for name in want}
        assert got == want
