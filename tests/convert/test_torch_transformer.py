"""`from_torch_transformer` against a real `torch.nn.Transformer`: the same memory and
logits to 1e-5 in float32, post-norm and pre-norm, tied and untied embeddings."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_peer

from jaxformer import DecoderConfig, VanillaConfig, VanillaTransformer
from jaxformer.convert.torch_transformer import from_torch_transformer

torch = import_peer("torch")
nn = torch.nn

pytestmark = pytest.mark.peers

D_MODEL, N_HEAD, N_LAYER, D_FF, VOCAB, PAD, BOS = 32, 4, 2, 64, 13, 0, 1
SRC_LENGTHS, TGT_LENGTHS = (9, 5, 2), (8, 3, 6)  # right-padded with PAD after these lengths


def _sinusoids(length: int, d: int) -> np.ndarray:
    """The paper's table, written out: PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(...)."""
    pe = np.zeros((length, d))
    for pos in range(length):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            pe[pos, 2 * i], pe[pos, 2 * i + 1] = math.sin(angle), math.cos(angle)
    return pe.astype(np.float32)


class TorchSeq2Seq(nn.Module):
    """`nn.Transformer` with what jaxformer puts around it: embeddings scaled by
    sqrt(d_model), sinusoids, padding and causal masks, an output layer."""

    def __init__(self, norm_first: bool, tie: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        kwargs = dict(d_model=D_MODEL, nhead=N_HEAD, dim_feedforward=D_FF, dropout=0.0, batch_first=True,
                      norm_first=norm_first)
        # In eval mode with a source padding mask, nn.TransformerEncoder takes a nested-tensor
        # fast path that skips the padded positions: they come out as zeros, then as the final
        # norm's bias. The logits would not notice (memory_key_padding_mask hides those
        # positions from cross-attention), but the memory could then only be compared at
        # real tokens. With
        # enable_nested_tensor=False every position is computed, as jaxformer does, so the
        # memory is compared everywhere; the state dict keys are the same.
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kwargs), N_LAYER, nn.LayerNorm(D_MODEL),
                                        enable_nested_tensor=False)
        self.transformer = nn.Transformer(num_encoder_layers=N_LAYER, num_decoder_layers=N_LAYER,
                                          custom_encoder=encoder, **kwargs)
        self.src_embed = nn.Embedding(VOCAB, D_MODEL)
        self.tgt_embed = self.src_embed if tie else nn.Embedding(VOCAB, D_MODEL)
        self.out = nn.Linear(D_MODEL, VOCAB)
        if tie:
            self.out.weight = self.src_embed.weight
        # Redrawn at a large scale: sharp attention, so a wrong Q/K/V split, head split or
        # transpose changes the logits a lot. LayerNorm weights around 1, every bias nonzero.
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.3)
        self.eval()

    @torch.no_grad()
    def forward(self, src: np.ndarray, tgt_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(memory [batch, S, d_model], logits [batch, T, vocab]) as numpy."""
        src, tgt_in = torch.from_numpy(src), torch.from_numpy(tgt_in)
        S, T = src.shape[1], tgt_in.shape[1]
        pe = torch.from_numpy(_sinusoids(max(S, T), D_MODEL))
        x = self.src_embed(src) * math.sqrt(D_MODEL) + pe[:S]
        y = self.tgt_embed(tgt_in) * math.sqrt(D_MODEL) + pe[:T]
        src_pad, tgt_pad = src == PAD, tgt_in == PAD  # True = masked, torch's convention
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)  # True above the diagonal: the future
        memory = self.transformer.encoder(x, src_key_padding_mask=src_pad)
        h = self.transformer(x, y, tgt_mask=causal, src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                             memory_key_padding_mask=src_pad)
        return memory.numpy(), self.out(h).numpy()


def _config(norm_first: bool, tie: bool, **changes) -> VanillaConfig:
    return VanillaConfig(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, n_layer=N_LAYER, d_model=D_MODEL, d_ff=D_FF,
                         n_head=N_HEAD, dropout=0.0, pad_id=PAD, max_seq_len=16, norm_first=norm_first,
                         tie_embeddings=tie, final_norm=True).replace(**changes)


def _batch() -> tuple[np.ndarray, np.ndarray]:
    """src [3, 9] and tgt_in [3, 8] (BOS first), every row a different length."""
    rng = np.random.default_rng(0)
    src = np.full((len(SRC_LENGTHS), max(SRC_LENGTHS)), PAD, np.int64)
    tgt_in = np.full((len(TGT_LENGTHS), max(TGT_LENGTHS)), PAD, np.int64)
    for row, (n_src, n_tgt) in enumerate(zip(SRC_LENGTHS, TGT_LENGTHS)):
        src[row, :n_src] = rng.integers(BOS + 1, VOCAB, n_src)
        tgt_in[row, :n_tgt] = [BOS, *rng.integers(BOS + 1, VOCAB, n_tgt - 1)]
    return src, tgt_in


def _convert(model: TorchSeq2Seq, config: VanillaConfig, state_dict=None):
    embeddings = dict(src_embedding=model.src_embed.weight, out_proj_bias=model.out.bias)
    if not config.tie_embeddings:
        embeddings |= dict(tgt_embedding=model.tgt_embed.weight, out_proj_weight=model.out.weight)
    state_dict = model.transformer.state_dict() if state_dict is None else state_dict
    return from_torch_transformer(state_dict, config, **embeddings)


def _jax_forward(config: VanillaConfig, params, src, tgt_in) -> tuple[np.ndarray, np.ndarray]:
    model, variables = VanillaTransformer(config), {"params": params}
    src, tgt_in = jnp.asarray(src, jnp.int32), jnp.asarray(tgt_in, jnp.int32)
    return (np.asarray(model.apply(variables, src, method="encode")),
            np.asarray(model.apply(variables, src, tgt_in)))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "norm_first"])
def test_memory_and_logits_match_torch(norm_first, tie):
    """Every position is compared, padded ones included: a padded target query still reads
    BOS and the earlier real tokens, and both models compute it the same way."""
    model = TorchSeq2Seq(norm_first, tie)
    src, tgt_in = _batch()
    torch_memory, torch_logits = model(src, tgt_in)
    config = _config(norm_first, tie)
    memory, logits = _jax_forward(config, _convert(model, config), src, tgt_in)
    memory_diff, logits_diff = np.abs(memory - torch_memory).max(), np.abs(logits - torch_logits).max()
    print(f"norm_first={norm_first} tie={tie}: max |logit| {np.abs(torch_logits).max():.2f}, "
          f"max abs diff memory {memory_diff:.2e}, logits {logits_diff:.2e}")
    assert np.abs(torch_logits).max() > 1 and np.std(torch_logits) > 0.5  # far from trivial
    assert memory_diff < 1e-5
    assert logits_diff < 1e-5


def test_tree_matches_init():
    for tie in (True, False):
        config = _config(False, tie)
        params = _convert(TorchSeq2Seq(False, tie), config)
        init = jax.eval_shape(VanillaTransformer(config).init, jax.random.key(0),
                              jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32))["params"]
        assert jax.tree.structure(params) == jax.tree.structure(init)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(init)):
            assert got.shape == want.shape and got.dtype == jnp.float32


def test_numpy_state_dict_gives_the_same_params():
    model, config = TorchSeq2Seq(True, False), _config(True, False)
    from_numpy = from_torch_transformer(
        {k: v.numpy() for k, v in model.transformer.state_dict().items()}, config,
        src_embedding=model.src_embed.weight.detach().numpy(), tgt_embedding=model.tgt_embed.weight.detach().numpy(),
        out_proj_weight=model.out.weight.detach().numpy())
    from_torch = _convert(model, config)
    np.testing.assert_array_equal(from_numpy["out_bias"], np.zeros(VOCAB))  # None: zeros
    from_numpy["out_bias"] = from_torch["out_bias"]
    jax.tree.map(np.testing.assert_array_equal, from_numpy, from_torch)


def _swap_q_and_k(w):
    return torch.cat([w[D_MODEL:2 * D_MODEL], w[:D_MODEL], w[2 * D_MODEL:]])


@pytest.mark.parametrize("key, corrupt", [
    ("encoder.layers.0.self_attn.in_proj_weight", _swap_q_and_k),
    ("decoder.layers.1.multihead_attn.in_proj_weight", _swap_q_and_k),
    ("decoder.layers.0.self_attn.out_proj.weight", torch.t),  # square: passes the shape check
])
def test_one_wrong_layout_is_caught(key, corrupt):
    """The parity test has teeth: one tensor read the wrong way moves the logits far past 1e-5."""
    model, config = TorchSeq2Seq(False, True), _config(False, True)
    src, tgt_in = _batch()
    _, torch_logits = model(src, tgt_in)
    state_dict = model.transformer.state_dict()
    state_dict[key] = corrupt(state_dict[key])
    _, logits = _jax_forward(config, _convert(model, config, state_dict), src, tgt_in)
    assert np.abs(logits - torch_logits).max() > 1e-2


@pytest.fixture(scope="module")
def post_norm():
    return TorchSeq2Seq(False, True), _config(False, True)


@pytest.mark.parametrize("changes, match", [
    (dict(final_norm=False), "VanillaConfig.final_norm"),
    (dict(final_norm=None), "VanillaConfig.final_norm"),  # None follows norm_first=False: no final norm
    (dict(n_layer=3), "2 encoder layers .* config.n_layer is 3"),
    (dict(d_ff=128), re.escape("encoder.layers.0.linear1.weight: expected shape (128, 32), got (64, 32)")),
])
def test_config_mismatch_raises(post_norm, changes, match):
    model, config = post_norm
    with pytest.raises(ValueError, match=match):
        _convert(model, config.replace(**changes))


def test_not_a_vanilla_config_raises(post_norm):
    model, _ = post_norm
    with pytest.raises(TypeError, match="VanillaConfig"):
        from_torch_transformer(model.transformer.state_dict(), DecoderConfig(), src_embedding=model.src_embed.weight)


def test_state_dict_mismatch_raises(post_norm):
    model, config = post_norm
    state_dict = model.transformer.state_dict()
    fewer = {k: v for k, v in state_dict.items() if not k.startswith("decoder.layers.1.")}
    with pytest.raises(ValueError, match="1 decoder layers .* config.n_layer is 2"):
        _convert(model, config, fewer)
    renamed = dict(state_dict)
    renamed["decoder.layers.1.norm4.weight"] = renamed.pop("decoder.layers.1.norm3.weight")
    with pytest.raises(ValueError, match=r"missing \['decoder.layers.1.norm3.weight'\], "
                                         r"unknown \['decoder.layers.1.norm4.weight'\]"):
        _convert(model, config, renamed)
    reshaped = dict(state_dict, **{"decoder.norm.bias": torch.zeros(D_MODEL - 1)})
    with pytest.raises(ValueError, match=re.escape("decoder.norm.bias: expected shape (32,), got (31,)")):
        _convert(model, config, reshaped)


def test_embedding_arguments_must_fit_the_config(post_norm):
    model, tied = post_norm
    state_dict, embed = model.transformer.state_dict(), model.src_embed.weight
    with pytest.raises(ValueError, match="tie_embeddings is True: pass only src_embedding"):
        from_torch_transformer(state_dict, tied, src_embedding=embed, tgt_embedding=embed)
    with pytest.raises(ValueError, match="tie_embeddings is False"):
        from_torch_transformer(state_dict, tied.replace(tie_embeddings=False), src_embedding=embed)
    with pytest.raises(ValueError, match=re.escape("src_embedding: expected shape (13, 32), got (12, 32)")):
        from_torch_transformer(state_dict, tied, src_embedding=embed[:-1])
    with pytest.raises(ValueError, match=re.escape("out_proj_bias: expected shape (13,), got (32,)")):
        from_torch_transformer(state_dict, tied, src_embedding=embed, out_proj_bias=torch.zeros(D_MODEL))
