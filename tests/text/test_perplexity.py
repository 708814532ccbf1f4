"""`jaxformer.text.perplexity`: the sliding-window perplexity against a direct formula on each
window's own logits, against transformers' documented recipe on torch (base, adapter through
peft, merged folder), one compile for every window, and the command's refusals."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from checkpoints import CHAT_TEMPLATE, CORPUS, bpe_tokenizer, save_adapted_checkpoint, save_random_checkpoint
from conftest import GEMMA4_DECODING, count_compiles, import_peer, jit_apply, run_main, tiny_gemma4

from benchmarks.perplexity import transformers_nll
from jaxformer import Decoder, DecoderConfig
from jaxformer.commands import perplexity as command
from jaxformer.convert import load_hf
from jaxformer.experts import ExpertsSpec
from jaxformer.layers import layer_specs
from jaxformer.text import Tokenizer, load_tokenizer
from jaxformer.text.perplexity import perplexity, window_spans

TEXT = CORPUS[:900]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A random Llama-shaped checkpoint (context 48), an adapter for it, the two merged, and a text file."""
    root = tmp_path_factory.mktemp("perplexity")
    tokenizer = Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
                          chat_template=CHAT_TEMPLATE)
    config = DecoderConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                           max_seq_len=48, tie_embeddings=False)
    save_adapted_checkpoint(root, config, tokenizer, TEXT, scale=0.2)
    return root


def slow_nll(model, params, ids, window, stride) -> float:
    """The formula, window by window on each window's own (unpadded) logits, in float64."""
    total = weights = 0.0
    for begin, end, targets in window_spans(len(ids), window, stride):
        logits = np.asarray(jit_apply(model, {"params": params}, jnp.asarray([ids[begin:end]]))[0][0], np.float64)
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        picked = [-log_probs[t - 1, ids[begin + t]] for t in range(max(end - begin - targets, 1), end - begin)]
        if targets > 1:
            total += np.mean(picked) * (targets - 1)
            weights += targets - 1
    return total / weights


@pytest.fixture(scope="module")
def experts_folder(tmp_path_factory):
    """The tiny Qwen3-MoE checkpoint (`save_random_checkpoint(experts=True)`: each layer 2 of 4 experts a
    token, dropless) and the text file."""
    root = tmp_path_factory.mktemp("perplexity-experts")
    save_random_checkpoint(root / "moe", experts=True)
    (root / "text.txt").write_text(TEXT)
    return root


def test_a_mixture_of_experts_perplexity_is_the_formula_and_the_commands(experts_folder):
    """The last window, padded to the window's length, routes its padding to experts too: dropless,
    a scored id's experts are its own choice, so the perplexity is still the formula on each window's
    own unpadded logits; and the command prints that number."""
    config, params = load_hf(str(experts_folder / "moe"))
    assert all(isinstance(spec.ffn, ExpertsSpec) for spec in layer_specs(config))
    ids = load_tokenizer(str(experts_folder / "moe")).encode(TEXT)
    model = Decoder(config)
    result = perplexity(model, params, ids, 32, 12)
    begin, end, _ = window_spans(len(ids), 32, 12)[-1]
    assert end - begin < 32 and result.windows == len(window_spans(len(ids), 32, 12))  # the last window padded
    np.testing.assert_allclose(result.nll, slow_nll(model, params, ids, 32, 12), rtol=1e-5)
    done = run_main(command.main, ["--checkpoint", str(experts_folder / "moe"), "--data",
                                   str(experts_folder / "text.txt"), "--window", "32", "--stride", "12", "--json"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["nll"] == pytest.approx(result.nll, rel=1e-6)


@pytest.mark.peers
def test_a_mixture_of_experts_perplexity_equals_transformers(experts_folder):
    torch = import_peer("torch")
    transformers = import_peer("transformers")
    ids = load_tokenizer(str(experts_folder / "moe")).encode(TEXT)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(experts_folder / "moe"), dtype=torch.float32).eval()
    config, params = load_hf(str(experts_folder / "moe"))
    ours = perplexity(Decoder(config), params, ids, 32, 12)
    np.testing.assert_allclose(ours.nll, transformers_nll(theirs, ids, 32, 12, torch), rtol=1e-5)


def test_the_windows_cover_the_text_once():
    assert window_spans(10, 4, 4) == [(0, 4, 4), (4, 8, 4), (8, 10, 2)]
    assert window_spans(10, 4, 2) == [(0, 4, 4), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    assert window_spans(3, 8, 4) == [(0, 3, 3)]


@pytest.mark.parametrize("window, stride", [(32, 32), (32, 12), (48, 47)])
def test_perplexity_is_the_formula_on_each_windows_own_logits_with_one_compile(folders, window, stride):
    config, params = load_hf(str(folders / "base"))
    ids = load_tokenizer(str(folders / "base")).encode(TEXT)
    model = Decoder(config)
    perplexity(model, params, ids[:window + 3], window, stride)  # compiled here
    with count_compiles() as compiles:
        result = perplexity(model, params, ids, window, stride)
    assert compiles == []  # every window, the last (padded) one too, runs the program compiled above
    assert result.tokens == len(ids) and result.windows == len(window_spans(len(ids), window, stride))
    np.testing.assert_allclose(result.nll, slow_nll(model, params, ids, window, stride), rtol=1e-5)
    assert result.perplexity == pytest.approx(np.exp(result.nll))


@pytest.mark.peers
@pytest.mark.parametrize("window, stride", [(32, 32), (32, 12)])
def test_perplexity_equals_transformers_on_the_base_the_adapter_and_the_merged_folder(folders, window, stride):
    torch = import_peer("torch")
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    ids = load_tokenizer(str(folders / "base")).encode(TEXT)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folders / "base"), dtype=torch.float32).eval()
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(str(folders / "base"), dtype=torch.float32),
        str(folders / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(folders / "merged"), dtype=torch.float32).eval()
    for argv, peer in ((["--checkpoint", str(folders / "base")], theirs),
                       (["--checkpoint", str(folders / "base"), "--adapter", str(folders / "adapter")], adapted),
                       (["--checkpoint", str(folders / "merged")], merged)):
        done = run_main(command.main, [*argv, "--data", str(folders / "text.txt"), "--window", str(window),
                                       "--stride", str(stride), "--json"])
        assert done.returncode == 0, done.stderr
        ours = json.loads(done.stdout)
        assert ours["tokens"] == len(ids) and (ours["window"], ours["stride"]) == (window, stride)
        np.testing.assert_allclose(ours["nll"], transformers_nll(peer, ids, window, stride, torch), rtol=1e-5)


def test_the_command_prints_its_figures_and_the_adapter_changes_them(folders):
    data = ["--data", str(folders / "text.txt"), "--window", "32", "--stride", "16"]
    base = run_main(command.main, ["--checkpoint", str(folders / "base"), *data])
    assert base.returncode == 0 and base.stdout.startswith("perplexity ") and "window(s) of up to 32, stride 16" \
        in base.stdout
    adapted = run_main(command.main, ["--checkpoint", str(folders / "base"), "--adapter", str(folders / "adapter"),
                                      *data, "--json"])
    merged = run_main(command.main, ["--checkpoint", str(folders / "merged"), *data, "--json"])
    a, m = json.loads(adapted.stdout), json.loads(merged.stdout)
    assert a["nll"] == pytest.approx(m["nll"], rel=1e-5) and f"{a['perplexity']:.4f}" not in base.stdout


@pytest.mark.parametrize("extra, message", [
    (["--window", "49"], "--window must be an int in [2, the model's context=48] (got 49)"),
    (["--window", "16", "--stride", "17"], "--stride must be an int in [1, --window=16] (got 17)"),
    (["--adapter", "nowhere"], "nowhere: no adapter_config.json there: not a peft adapter folder"),
    (["--data", "missing.txt"], "cannot read --data missing.txt"),
])
def test_bad_arguments_are_refused_in_one_line(folders, extra, message):
    done = run_main(command.main, ["--checkpoint", str(folders / "base"), "--data", str(folders / "text.txt"),
                                   *extra])
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("shipped", ["DeepSeek-V3", "Qwen3-Next-80B-A3B-Instruct"], ids=["latent", "hybrid"])
def test_the_new_mixers_perplexity_is_the_formula_and_the_command(shipped, tmp_path):
    """A tiny DeepSeek-V3 (latent attention) and Qwen3-Next (Gated DeltaNet layers, chunked over each
    window's prompt) folder saved by `save_hf`: the perplexity is the formula on each window's own
    logits, the last window padded, and the command prints that number."""
    save_random_checkpoint(tmp_path / "model", shipped=shipped)
    (tmp_path / "text.txt").write_text(TEXT)
    config, params = load_hf(str(tmp_path / "model"))
    ids = load_tokenizer(str(tmp_path / "model")).encode(TEXT)
    model = Decoder(config)
    result = perplexity(model, params, ids, 32, 12)
    np.testing.assert_allclose(result.nll, slow_nll(model, params, ids, 32, 12), rtol=1e-5)
    done = run_main(command.main, ["--checkpoint", str(tmp_path / "model"), "--data", str(tmp_path / "text.txt"),
                                   "--window", "32", "--stride", "12", "--json"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["nll"] == pytest.approx(result.nll, rel=1e-6)


@pytest.mark.parametrize("name", GEMMA4_DECODING)
def test_gemma_4_perplexity_is_the_formula(name):
    """Gemma 4's tiny E2B (per-layer inputs, its last two layers reading the keys and values of the layers
    before them; `conftest.GEMMA4_DECODING`), windows of 32 past their sliding layers' 8: the
    perplexity is the formula on each window's own logits, the last window padded."""
    model, params = tiny_gemma4(name)
    ids = np.random.RandomState(0).randint(0, model.config.vocab_size, 70).tolist()
    result = perplexity(model, params, ids, 32, 12)
    np.testing.assert_allclose(result.nll, slow_nll(model, params, ids, 32, 12), rtol=1e-5)
