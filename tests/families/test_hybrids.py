"""The linear-attention hybrids against transformers itself: Qwen3-Next (a checkpoint of its own),
Qwen3.5 and Qwen3.6 (image-text checkpoints, whose text model loads), each a tiny copy of its shipped
config.json (`shipped.tiny`) saved by transformers as sharded bfloat16 and loaded by jaxformer.

The reference is transformers' forward of the same (bfloat16-valued) weights. Gated DeltaNet's
chunked form sums many products: in float32 these tiny hybrids' logits lie up to about 1e-4 from
their float64 values in transformers' torch code as in ours, as far as the dense families' tolerance,
so the logits are held to transformers' float64 forward (`within_float32`). The chunk is shrunk to 8,
as the sliding window is, so that a 24-token prompt is three chunks and the recurrent form decodes
after them.
"""

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import greedy_tokens_compared, import_peer, jit_apply, torch_peer
from safetensors.numpy import save_file
from shipped import scaled_up, tiny

from jaxformer import Decoder, KVCache, generate
from jaxformer.convert import load_hf, save_hf, with_scan_layers
from jaxformer.decoding import PromptLookup
from jaxformer.deltanet import GatedDeltaNetSpec

torch = torch_peer()
transformers = import_peer("transformers")

pytestmark = pytest.mark.peers

HYBRIDS = ["Qwen3-Next-80B-A3B-Instruct", "Qwen3.5-9B", "Qwen3.6-35B-A3B"]
CHUNK = 8
MAX_SEQ_LEN = 64
TOLERANCE = 1e-4  # float32, logits of magnitude ~10 (tests/families/test_families.py's)
PROMPT_LEN, NEW_TOKENS = 12, 40
# Each family's token seed: none of its tokens routes within 1e-5 of a tie between its k-th and next
# expert (`routing_gap`), where float32 rounding could rightly pick either and move the logits by more
# than any tolerance.
SEEDS = {"Qwen3-Next-80B-A3B-Instruct": 0, "Qwen3.5-9B": 2, "Qwen3.6-35B-A3B": 0}
# Each feature these families switch on, and their full-attention layers' spec with it off (the gate's
# half of each head's `wq` dropped with it): the logits must move.
FEATURES_OFF = {"output_gate": dict(output_gate=False), "partial_rotary_factor": dict(partial_rotary_factor=1.0)}


def switched_off(config, params, feature: str):
    """`(config, params)` with `feature` off in every full-attention layer."""
    changes, params = FEATURES_OFF[feature], jax.tree.map(lambda a: a, params)
    layers = []
    for i, spec in enumerate(config.layers):
        if not isinstance(spec.mixer, GatedDeltaNetSpec):
            spec = dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, **changes))
            if feature == "output_gate":
                attn = params[f"block_{i}"]["attn"]
                attn["wq"] = attn["wq"][..., :spec.mixer.head_dim]
        layers.append(spec)
    return config.replace(layers=tuple(layers)), params


def _classes(model_type: str):
    """transformers' class of a checkpoint of `model_type`, and of the text model `save_hf` writes."""
    return {"qwen3_next": (transformers.Qwen3NextForCausalLM,) * 2,
            "qwen3_5": (transformers.Qwen3_5ForConditionalGeneration, transformers.Qwen3_5ForCausalLM),
            "qwen3_5_moe": (transformers.Qwen3_5MoeForConditionalGeneration, transformers.Qwen3_5MoeForCausalLM),
            }[model_type]


def shrunk_chunks(config, chunk: int = CHUNK):
    """`config` with its Gated DeltaNet layers' chunk `chunk` (the math is the same at any chunk; a
    checkpoint states none, and one loads at `GatedDeltaNetSpec`'s default)."""
    return config.replace(layers=tuple(
        dataclasses.replace(spec, mixer=dataclasses.replace(spec.mixer, chunk=chunk))
        if isinstance(spec.mixer, GatedDeltaNetSpec) else spec for spec in config.layers))


DEFAULT_CHUNK = GatedDeltaNetSpec(1, 1, 1, 1).chunk


def moderate(model, seed: int):
    """`scaled_up`'s model with what these layers accumulate kept moderate, as trained ones keep it: each
    Gated DeltaNet's decay rates `A` in [0.05, 0.5] and its decay and write-strength projections
    (`in_proj_ba`, `in_proj_a`, `in_proj_b`) a tenth of the rest, so a token's decay stays near 1 (at
    `scaled_up`'s scale a chunk's decays span 1e17, and float32 keeps few digits of the rule); and the
    routers a fifth, so that no token's k-th expert weighs next to nothing, where two near-equal
    probabilities of no weight would stand at every token."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.05, 0.5, generator=generator)))
            elif any(f"in_proj_{x}." in name for x in ("ba", "a", "b")):
                p.mul_(0.1)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(0.2)
    return model


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, tmp_path_factory):
    """(name, transformers' float32 model, its float64 one, config, params, path)."""
    name = request.param
    hf_config = transformers.AutoConfig.for_model(**tiny(name))
    cls, _ = _classes(hf_config.model_type)
    path = tmp_path_factory.mktemp(name)
    moderate(scaled_up(cls(hf_config), seed=0), seed=0).to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    config, params = load_hf(str(path), max_seq_len=MAX_SEQ_LEN)
    exact = dict(experts_implementation="eager")  # (torch's grouped product takes no float64)
    return (name, cls.from_pretrained(path, dtype=torch.float32).eval(),
            cls.from_pretrained(path, dtype=torch.float64, **exact).eval(), shrunk_chunks(config), params, path)


def _tokens(name, config, shape):
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(SEEDS[name]))


def routing_gap(hf_model, tokens) -> float:
    """The smallest gap, over every router of `hf_model` and token of `tokens` whose k-th expert
    weighs more than 1e-5, between the k-th and the next expert's probability (inf without routers):
    float32 may pick either of two so close, which moves the logits by about the k-th's weight."""
    gaps = [np.inf]

    def hook(module, inputs, out):
        p = torch.softmax(out[0].double(), dim=-1)
        top = torch.topk(p, module.top_k + 1, dim=-1).values
        at_stake = top[:, -2] > 1e-5  # (a tie between two experts of no weight moves nothing)
        gaps.extend((top[:, -2] - top[:, -1])[at_stake].tolist())

    handles = [m.register_forward_hook(hook) for m in hf_model.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        hf_model(tokens, use_cache=False)
    for h in handles:
        h.remove()
    return min(gaps)


def within_float32(got, hf32, hf64) -> None:
    """`got` within float32's error of transformers' float64 logits: 1e-4 (the dense families'
    tolerance), or twice as far as transformers' own float32 logits lie from them where that is more."""
    bound = max(TOLERANCE, 2 * np.abs(hf32 - hf64).max())
    assert np.abs(hf64).max() > 1.0 and bound < 1e-3
    np.testing.assert_allclose(got, hf64, atol=bound, rtol=0)


def test_logits_equal_transformers_and_each_feature_counts(hybrid):
    name, hf32, hf64, config, params, _ = hybrid
    tokens = _tokens(name, config, (2, 24))
    assert routing_gap(hf64, tokens) > 1e-5
    with torch.no_grad():
        want32, want = hf32(tokens, use_cache=False).logits.numpy(), hf64(tokens, use_cache=False).logits.numpy()
    got, _ = jit_apply(Decoder(config), {"params": params}, tokens.numpy())
    within_float32(got, want32, want)
    scanned_config, scanned_params = with_scan_layers(config, params, True)  # a scan of 3 linear bodies and 1 full
    scanned, _ = jit_apply(Decoder(scanned_config), {"params": scanned_params}, tokens.numpy())
    within_float32(scanned, want32, want)
    for feature in FEATURES_OFF:
        off_config, off_params = switched_off(config, params, feature)
        off_logits, _ = jit_apply(Decoder(off_config), {"params": off_params}, tokens.numpy())
        assert np.abs(off_logits - want).max() > 0.1, f"{name}: {feature} off leaves the logits as they were"


@pytest.fixture(scope="module")
def hf_greedy(hybrid):
    """transformers' greedy continuation of a prompt of 12 (a chunk and a half), and the logits of
    each of its steps (its own cached decoding: the recurrent form, one token a step)."""
    name, hf32, _, config, _, _ = hybrid
    prompt = _tokens(name, config, (2, PROMPT_LEN))
    out = hf32.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0, output_logits=True,
                        return_dict_in_generate=True)
    return prompt.numpy(), out.sequences.numpy(), torch.stack(out.logits, dim=1).numpy()


def test_greedy_tokens_equal_transformers(hybrid, hf_greedy):
    _, _, _, config, params, _ = hybrid
    prompt, want, logits = hf_greedy
    got = generate(Decoder(config), params, jnp.asarray(prompt), max_new_tokens=NEW_TOKENS)
    assert len(np.unique(want[:, PROMPT_LEN:])) > 5  # a varied continuation
    np.testing.assert_array_equal(got[:, :PROMPT_LEN], prompt)
    compared = greedy_tokens_compared(got[:, PROMPT_LEN:], want[:, PROMPT_LEN:], logits, bound=1e-3)
    assert compared >= want[:, PROMPT_LEN:].size // 2


# Each family's seed of a sequence of PROMPT_LEN + NEW_TOKENS whose routings are all 1e-4 from a tie: the
# cached steps (the recurrent form) lie further from float64 than the full forward, and a closer tie
# could rightly route them otherwise.
DECODED_SEEDS = {"Qwen3-Next-80B-A3B-Instruct": 6, "Qwen3.5-9B": 2, "Qwen3.6-35B-A3B": 6}


_DECODED = {}  # family -> _transformers_decoding's result (both forms of a test read one)


def _transformers_decoding(hybrid):
    """`(fed, want32, want, hf_steps)`: the tokens (`DECODED_SEEDS`' draw), transformers' float32 and
    float64 forwards' logits, and its float32 logits prefilling 12 tokens through its cache, then a step each."""
    name, hf32, hf64, config, _, _ = hybrid
    if name not in _DECODED:
        fed = torch.randint(0, config.vocab_size, (2, PROMPT_LEN + NEW_TOKENS),
                            generator=torch.Generator().manual_seed(DECODED_SEEDS[name]))
        with torch.no_grad():
            assert routing_gap(hf64, fed) > 1e-4
            want32, want = (hf(fed, use_cache=False).logits.numpy() for hf in (hf32, hf64))
            out = hf32(fed[:, :PROMPT_LEN], use_cache=True)
            hf_steps, past = [out.logits.numpy()], out.past_key_values
            for t in range(PROMPT_LEN, fed.shape[1]):
                out = hf32(fed[:, t:t + 1], past_key_values=past, use_cache=True)
                hf_steps.append(out.logits.numpy())
                past = out.past_key_values
        _DECODED[name] = fed.numpy(), want32, want, np.concatenate(hf_steps, axis=1)
    return _DECODED[name]


@pytest.mark.parametrize("scan", [False, True], ids=["per layer", "scanned"])
def test_cached_decoding_equals_transformers_and_the_full_forward(hybrid, scan):
    """Prefill 12 tokens (chunked), then one token a step (recurrent) over the cache of states and
    keys, per layer or scanned (a stack of each: `cache.Stacks`): the logits of every step, and of
    the full forward, are transformers' float64 forward's within float32's error for that form
    (transformers' own float32 steps, through its cache, and its float32 forward)."""
    config, params = with_scan_layers(*hybrid[3:5], scan)
    fed, want32, want, hf_steps = _transformers_decoding(hybrid)
    model = Decoder(config)
    step = jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache))
    logits, cache = step(jnp.asarray(fed[:, :PROMPT_LEN]), KVCache.create(config, 2, fed.shape[1]))
    assert cache.has_state and KVCache.create(config, 2, 8).nbytes < KVCache.create(config, 2, 16).nbytes
    got = [logits]
    for t in range(PROMPT_LEN, fed.shape[1]):
        logits, cache = step(jnp.asarray(fed[:, t:t + 1]), cache)
        got.append(logits)
    got = np.concatenate(got, axis=1)
    within_float32(got[:, :PROMPT_LEN], want32[:, :PROMPT_LEN], want[:, :PROMPT_LEN])  # the prefill
    within_float32(got[:, PROMPT_LEN:], hf_steps[:, PROMPT_LEN:], want[:, PROMPT_LEN:])  # the steps
    full, _ = jit_apply(model, {"params": params}, fed)
    within_float32(full, want32, want)


def test_save_hf_writes_the_text_model_that_transformers_reopens(hybrid, tmp_path, caplog):
    """`save_hf` writes the text model (Qwen3.5's as `Qwen3_5ForCausalLM`), which transformers
    reopens with the checkpoint's logits and `load_hf` reads back bit for bit; the image-text
    checkpoint's loading said, in one line, that its vision tower was not read; a multi-token
    prediction head's tensors are left unread."""
    name, hf32, _, config, params, path = hybrid
    text_class = _classes(hf32.config.model_type)[1]
    save_hf(shrunk_chunks(config, DEFAULT_CHUNK), params, str(tmp_path))
    reopened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reopened) is text_class
    tokens = _tokens(name, config, (2, 20))
    with torch.no_grad():
        np.testing.assert_allclose(reopened(tokens).logits.numpy(), hf32(tokens).logits.numpy(), atol=1e-5, rtol=0)
    loaded_config, loaded = load_hf(str(tmp_path), max_seq_len=MAX_SEQ_LEN)
    assert shrunk_chunks(loaded_config) == config
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    save_file({"mtp.fc.weight": np.ones((2, 2), np.float32)}, str(tmp_path / "mtp.safetensors"))  # a draft's
    index = {"weight_map": {**{k: "model.safetensors" for k in _keys(tmp_path / "model.safetensors")},
                            "mtp.fc.weight": "mtp.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING):
        _, again = load_hf(str(tmp_path), max_seq_len=MAX_SEQ_LEN)
        jax.tree.map(np.testing.assert_array_equal, again, params)
        _, image_text = load_hf(str(path), max_seq_len=MAX_SEQ_LEN)
    said = [r.getMessage() for r in caplog.records if "tensors under model.visual." in r.getMessage()]
    assert len(said) == (name != "Qwen3-Next-80B-A3B-Instruct"), said
    jax.tree.map(np.testing.assert_array_equal, image_text, params)


def _keys(file) -> list[str]:
    from safetensors import safe_open
    with safe_open(str(file), "np") as f:
        return list(f.keys())


def test_speculative_decoding_is_refused_in_one_line(hybrid):
    """A row's state holds every token it has read: a speculative round's rejected proposals cannot
    be taken back out of it."""
    _, _, _, config, params, _ = hybrid
    with pytest.raises(ValueError, match="linear-attention layer's state cannot be"):
        generate(Decoder(config), params, jnp.zeros((1, 4), jnp.int32), max_new_tokens=4, speculative=PromptLookup())
