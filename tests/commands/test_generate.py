"""`jaxformer-generate`: a checkpoint folder and text in, text out.

Most tests use a folder jaxformer writes itself (`save_hf` + `save_tokenizer`); the
parity test uses one transformers writes, and its `generate` + `decode` as the peer.
"""

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_peer, memorised_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import CORPUS, save_tiny_llama, set_eos

from jaxformer import Decoder, DecoderConfig, generate
from jaxformer.commands import generate as cli
from jaxformer.convert import save_hf
from jaxformer.text import completion_text, load_tokenizer, save_tokenizer, train_bpe

# A small vocabulary: many Chinese characters stay spelled in two or three byte tokens.
BPE = train_bpe([CORPUS], 280)
CONFIG = DecoderConfig(vocab_size=BPE.vocab_size, n_layer=1, n_head=4, n_kv_head=2, d_model=64, max_seq_len=48)
# Different lengths: a ragged batch. Every test decodes 24 new tokens, so that the CLI's
# programs (one per batch shape) compile once for the module.
PROMPTS = ["今天天气很好，我们", "Keys and values", "注意力"]
NEW = ["--max-new-tokens", "24"]


@pytest.fixture(scope="module")
def params():
    # 300 updates of 8 windows (half memorised_params' batch, half its cost): the recitations the tests
    # read come out greedy, each token ahead of the runner-up by 2.7 logits or more (measured with
    # XLA's optimisations off, the tests', and on; 16 windows: 3.2).
    return memorised_params(CONFIG, BPE.encode(CORPUS, add_special_tokens=False), batch=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, params):
    """A checkpoint folder written by jaxformer, with a byte-level BPE tokenizer."""
    path = str(tmp_path_factory.mktemp("jaxformer-checkpoint"))
    save_hf(CONFIG, params, path, bos_id=BPE.bos_id, eos_id=BPE.eos_id, pad_id=BPE.pad_id)
    save_tokenizer(BPE, path)
    return path


def run(argv, stdin=""):
    """`(stdout, stderr lines)` of the CLI run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(argv, stdin=io.StringIO(stdin), stdout=out) == 0
    return out.getvalue(), err.getvalue().splitlines()


def _flags(prompts):
    return [flag for prompt in prompts for flag in ("--prompt", prompt)]


def test_greedy_completions_are_generate_and_decode(folder, params):
    out, err = run(["--checkpoint", folder, *_flags(PROMPTS), *NEW, "--json"])
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    ids = [BPE.encode(prompt) for prompt in PROMPTS]
    batch = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for row, prompt_ids in zip(batch, ids):
        row[:len(prompt_ids)] = prompt_ids
    want = np.asarray(generate(Decoder(CONFIG), params, batch, max_new_tokens=24,
                               prompt_lengths=[len(i) for i in ids]))[:, batch.shape[1]:]
    for prompt_ids, new, row in zip(ids, want.tolist(), rows):
        assert row["token_ids"] == new and row["finish_reason"] == "length"
        assert row["completion"] == completion_text(BPE, prompt_ids, new)
        assert (row["prompt_tokens"], row["completion_tokens"]) == (len(prompt_ids), 24)
    assert rows[1]["completion"].startswith(" are cached, so")  # the model recites its corpus
    # --scan-layers loads the same weights stacked and decodes the same tokens.
    scanned, _ = run(["--checkpoint", folder, *_flags(PROMPTS), *NEW, "--json", "--scan-layers"])
    assert scanned == out
    # Plain output: the completions, a line each.
    plain, _ = run(["--checkpoint", folder, *_flags(PROMPTS), *NEW])
    assert plain == "".join(r["completion"] + "\n" for r in rows)
    assert [line.split()[0] for line in err] == ["loaded", "compile:", "prefill:", "decode:"]


def test_stream_prints_the_same_text(folder):
    argv = ["--checkpoint", folder, *_flags(PROMPTS), *NEW]
    whole, _ = run(argv)
    streamed, _ = run(argv + ["--stream"])  # (one prompt after another)
    assert streamed == whole
    # The model recites the corpus: Chinese characters (some of them two or three byte
    # tokens) and spaces, with no broken character but one cut by --max-new-tokens.
    first, second, _ = whole.splitlines()
    assert first.startswith("去公园散步吧。明") and second.startswith(" are cached, so each")
    assert "\ufffd" not in first.rstrip("\ufffd") + second


def test_prompts_from_a_file_and_from_standard_input(folder, tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    by_flag, _ = run(["--checkpoint", folder, *_flags(PROMPTS), *NEW])
    by_file, _ = run(["--checkpoint", folder, "--prompts-file", str(file), *NEW])
    by_lines, _ = run(["--checkpoint", folder, "--prompts-file", "-", *NEW], stdin=file.read_text())
    assert by_flag == by_file == by_lines
    alone, _ = run(["--checkpoint", folder, *NEW], stdin=PROMPTS[1] + "\n")
    assert alone == by_flag.splitlines(keepends=True)[1]


def test_generation_stops_at_the_folders_eos(folder, tmp_path):
    # (The module's batch of prompts, whose programs the tests above compiled; the first one is read.)
    free, _ = run(["--checkpoint", folder, *_flags(PROMPTS), *NEW, "--json"])
    ids = json.loads(free.splitlines()[0])["token_ids"]
    stopped = str(tmp_path / "stops")
    shutil.copytree(folder, stopped)
    with open(os.path.join(stopped, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids[6], ids[4]], "pad_token_id": 0}, f)
    out, _ = run(["--checkpoint", stopped, *_flags(PROMPTS), *NEW, "--json"])
    row = json.loads(out.splitlines()[0])
    cut = min(ids.index(ids[4]), ids.index(ids[6])) + 1
    assert row["token_ids"] == ids[:cut] and row["finish_reason"] == "stop"
    assert row["completion"] == completion_text(BPE, BPE.encode(PROMPTS[0]), ids[:cut - 1])


def test_sampling_and_beam_search_reach_generate(folder, params):
    # Sampling: the module's ragged batch (the programs the greedy test compiled; the settings are values).
    ids = [BPE.encode(prompt) for prompt in PROMPTS]
    batch = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for row, prompt_ids in zip(batch, ids):
        row[:len(prompt_ids)] = prompt_ids
    out, _ = run(["--checkpoint", folder, *_flags(PROMPTS), *NEW, "--temperature", "0.9", "--top-k", "20",
                  "--top-p", "0.9", "--seed", "5", "--json"])
    want = generate(Decoder(CONFIG), params, batch, max_new_tokens=24, temperature=0.9, top_k=20, top_p=0.9,
                    key=jax.random.key(5), eos_id=BPE.eos_id, pad_id=BPE.pad_id, prompt_lengths=[len(i) for i in ids])
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == np.asarray(want)[:, batch.shape[1]:].tolist()
    prompt = BPE.encode(PROMPTS[1])
    out, err = run(["--checkpoint", folder, "--prompt", PROMPTS[1], "--max-new-tokens", "6", "--num-beams", "3",
                    "--length-penalty", "0.5", "--json"])
    want = generate(Decoder(CONFIG), params, jnp.asarray([prompt]), max_new_tokens=6, num_beams=3,
                    length_penalty=0.5, eos_id=BPE.eos_id, pad_id=BPE.pad_id)
    assert json.loads(out)["token_ids"] == np.asarray(want)[0, len(prompt):].tolist()
    assert err[2].startswith("beam search (3 beams)")


def test_prompt_lookup_gives_the_same_text_in_fewer_passes(folder):
    """The model recites its corpus, whose "the dog sat on the log" follows "the cat sat on the
    mat": at the second " sat", prompt lookup proposes what followed the first, and " on the"
    is accepted. The tokens stay greedy decoding's, streamed too."""
    argv = ["--checkpoint", folder, "--prompt", "The cat sat on the mat, and the dog", *NEW]
    plain, _ = run(argv + ["--json"])
    assert json.loads(plain)["completion"].startswith(" sat on the log.")
    out, err = run(argv + ["--json", "--prompt-lookup", "4"])
    assert out == plain
    accepted, proposed, per_pass = re.fullmatch(
        r"prompt lookup \(k=4, n=3\): (\d+) of (\d+) proposed tokens accepted \(\d+%\), ([\d.]+) new tokens a row "
        r"per pass of the model after the prefill", err[-1]).groups()
    assert 2 <= int(accepted) < int(proposed) and float(per_pass) > 1
    streamed, err = run(argv + ["--prompt-lookup", "4", "--stream"])
    assert streamed == json.loads(plain)["completion"] + "\n"
    assert err[-1] == "prompt lookup (k=4, n=3): --stream counts no acceptance"


def _snapshot(path):
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


def _without(folder, tmp_path, name):
    copy = str(tmp_path / f"without-{name}")
    shutil.copytree(folder, copy)
    os.remove(os.path.join(copy, name))
    return copy


@pytest.mark.parametrize("argv, message", [
    (lambda f, t: ["--checkpoint", _without(f, t, "model.safetensors"), "--prompt", "hi"],
     r"no model.safetensors or model.safetensors.index.json in .*without-model.safetensors$"),
    (lambda f, t: ["--checkpoint", _without(f, t, "tokenizer.json"), "--prompt", "hi"],
     r"without-tokenizer.json/tokenizer.json: missing"),
    (lambda f, t: ["--checkpoint", str(t / "nowhere"), "--prompt", "hi"], r"nowhere: no such checkpoint folder"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--prompt", " "], r"--prompt 2 is an empty prompt$"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "天气" * 20, *NEW],
     r"prompt 1 \('天气天气.*'\.\.\.\) is \d+ tokens: with --max-new-tokens 24 that passes max_seq_len 48$"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--dtype", "float16"],
     r"--dtype must be one of float32, bfloat16 \(got 'float16'\)$"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--chat"], r"--chat: .*: the tokenizer has no chat template"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--stream", "--json"], r"--stream and --json do not go"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--top-k", "301"],
     r"--top-k must be None or an int in \[1, vocab_size=280\] \(got 301\)"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--num-beams", "2", "--temperature", "1"],
     r"beam search is deterministic: with --num-beams > 1 leave --temperature at 0"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--temperature", "nan"], r"--temperature must be >= 0"),
    (lambda f, t: ["--checkpoint", f], r"no prompt: give --prompt TEXT"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--prompt-lookup", "0"],
     r"--prompt-lookup must be a positive int \(got 0\)$"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--prompt-lookup", "2", "--num-beams", "2"],
     r"--prompt-lookup proposes one continuation per row: it does not go with beam search"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--prompt-lookup-ngram", "2"],
     r"--prompt-lookup-ngram needs --prompt-lookup$"),
    (lambda f, t: ["--checkpoint", f, "--prompt", "hi", "--prompt-lookup", "2", "--prompt-lookup-ngram", "0"],
     r"--prompt-lookup-ngram must be a positive int \(got 0\)$"),
], ids=["no-weights", "no-tokenizer", "no-folder", "empty-prompt", "prompt-too-long", "dtype", "chat-no-template",
        "stream-json", "top-k", "beams-sampling", "temperature-nan", "no-prompt", "lookup-zero", "lookup-beams",
        "ngram-alone", "ngram-zero"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(folder, tmp_path, capsys, monkeypatch, argv, message):
    before = _snapshot(folder)
    tty = io.StringIO()
    tty.isatty = lambda: True  # no text piped in
    with pytest.raises(SystemExit) as exit_:
        cli.main(NEW + argv(folder, tmp_path), stdin=tty)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"{cli.PROG}: error: ")
    assert re.search(message, err.strip()), err
    assert _snapshot(folder) == before


# transformers as the peer.

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny Llama and its tokenizer saved by transformers (`save_tiny_llama`), once for the
    peer tests; a test that changes it changes a copy."""
    import_peer("torch")
    import_peer("transformers")
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_tiny_llama(path)
    return path


@pytest.mark.peers
def test_completions_equal_transformers_generate_and_decode(tiny_llama, tmp_path):
    """A tiny Llama and its tokenizer saved by transformers: each prompt's greedy text from
    the CLI (one ragged batch) is `model.generate` + `tokenizer.decode` of that prompt
    alone, up to the EOS ids of generation_config.json."""
    torch = import_peer("torch")
    transformers = import_peer("transformers")
    path = str(tmp_path / "llama")
    shutil.copytree(tiny_llama, path)  # (its EOS ids are set below)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    free = model.generate(torch.tensor([tokenizer(PROMPTS[0])["input_ids"]]), max_new_tokens=16, do_sample=False)
    n = len(tokenizer(PROMPTS[0])["input_ids"])
    set_eos(path, [int(free[0, n + 6]), int(free[0, n + 9])])  # prompt 0 stops after 7 tokens or fewer
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    out, _ = run(["--checkpoint", path, *_flags(PROMPTS), "--max-new-tokens", "16", "--json"])
    rows = [json.loads(line) for line in out.splitlines()]
    stop_ids = load_tokenizer(path).stop_ids
    for prompt, row in zip(PROMPTS, rows):
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        stops = [i for i, t in enumerate(new) if t in stop_ids]
        new = new[:stops[0] + 1] if stops else new  # transformers pads after the EOS
        assert row["token_ids"] == new
        assert row["completion"] == tokenizer.decode(new[:-1] if stops else new, skip_special_tokens=True)
    assert rows[0]["finish_reason"] == "stop" and len(rows[0]["token_ids"]) <= 7


@pytest.mark.peers
def test_chat_prompts_are_apply_chat_template(tiny_llama):
    transformers = import_peer("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    out, _ = run(["--checkpoint", tiny_llama, "--chat", "--system", "Be brief.", "--prompt", "今天天气",
                  "--max-new-tokens", "4", "--json"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "今天天气"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert json.loads(out)["prompt_tokens"] == len(ids)


def test_an_adapter_decodes_as_the_merged_checkpoint_does(folder, params, tmp_path):
    from jaxformer.convert.peft import save_peft
    from jaxformer.lora import LoraConfig, init_lora, merge

    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "o_proj", "up_proj"))
    adapters = jax.tree.map(lambda x: 0.5 * jax.random.normal(jax.random.key(1), x.shape),
                            init_lora(params, lora, jax.random.key(0)))
    save_peft(CONFIG, adapters, lora, str(tmp_path / "adapter"))
    save_hf(CONFIG, merge(params, adapters, lora), str(tmp_path / "merged"), bos_id=BPE.bos_id, eos_id=BPE.eos_id,
            pad_id=BPE.pad_id)
    save_tokenizer(BPE, str(tmp_path / "merged"))
    flags = [*_flags(PROMPTS), *NEW, "--json"]
    adapted, _ = run(["--checkpoint", folder, "--adapter", str(tmp_path / "adapter"), *flags])
    merged, _ = run(["--checkpoint", str(tmp_path / "merged"), *flags])
    base, _ = run(["--checkpoint", folder, *flags])
    assert adapted == merged and adapted != base
    scanned, _ = run(["--checkpoint", folder, "--adapter", str(tmp_path / "adapter"), "--scan-layers", *flags])
    assert scanned == adapted  # merged into the per-layer tree, then stacked
    with pytest.raises(SystemExit):
        cli.main(["--checkpoint", folder, "--adapter", str(tmp_path), "--prompt", "Keys"])
