"""`--quantize`, `--quantize-group` and `--quantize-affine` of `jaxformer-generate`, `jaxformer-serve`
and `jaxformer-perplexity` (`command_line.add_quantize_flags`): each command's output is the
library's on the model `load_hf(quantize=...)` reads (an adapter merged into the float matrices
first, then quantized), and every combination that means nothing is refused in one line before a
weight is read."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import bpe_tokenizer, save_adapted_checkpoint  # noqa: E402

from jaxformer import Decoder, DecoderConfig, generate  # noqa: E402
from jaxformer.commands import generate as generate_command  # noqa: E402
from jaxformer.commands import perplexity as perplexity_command  # noqa: E402
from jaxformer.commands import serve as serve_command  # noqa: E402
from jaxformer.convert import load_hf  # noqa: E402
from jaxformer.quantized import QArray, Quantization  # noqa: E402
from jaxformer.text import Tokenizer  # noqa: E402
from jaxformer.text.perplexity import perplexity  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
# d_model 32: every matrix's inputs are 32 (or 4 heads of 8, o's), so int4's and nf4's default group of 64
# does not tile them, and 32 does. Random weights: greedy tokens that int8's rounding changes (15 of 16 here).
CONFIG = DecoderConfig(vocab_size=TOKENIZER.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                       max_seq_len=48, tie_embeddings=False)
PROMPT = "the cat sat on"
NEW = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The random checkpoint, an adapter for it, the two merged, and a text file."""
    root = tmp_path_factory.mktemp("quantize-flags")
    save_adapted_checkpoint(root, CONFIG, TOKENIZER, "the cat sat on the mat, and the dog sat on the log. " * 3,
                            scale=0.3)
    return root


def parsed(command, *flags):
    """The `Quantization` a command's parse makes of `flags`."""
    argv = {generate_command: ["--prompt", "hi"], perplexity_command: ["--data", "t.txt"], serve_command: []}[command]
    return command.parse_args(["--checkpoint", "dir", *argv, *flags]).quantization


@pytest.mark.parametrize("command", [generate_command, perplexity_command, serve_command], ids=lambda c: c.PROG)
def test_each_command_turns_the_flags_into_one_quantization(command, capsys):
    assert parsed(command) is None
    assert parsed(command, "--quantize", "int8") == Quantization("int8")
    assert parsed(command, "--quantize", "nf4", "--quantize-group", "32") == Quantization("nf4", 32)
    assert parsed(command, "--quantize", "int4", "--quantize-affine") == Quantization("int4", 64, affine=True)
    assert parsed(command, "--quantize", "int8", "--quantize-head") == Quantization("int8", head=True)
    with pytest.raises(SystemExit):
        command.parse_args(["--help"])
    help = " ".join(capsys.readouterr().out.split())  # (argparse wraps the lines)
    assert "--quantize {int8,int4,nf4}" in help and "--quantize-group {32,64,128}" in help
    assert "inputs that share a scale (default: 64)" in help and "--quantize-affine" in help
    assert "--quantize-head" in help


def not_read(folders, tmp_path) -> str:
    """A copy of the checkpoint whose weights file fails if read."""
    copy = tmp_path / "copy"
    shutil.copytree(folders / "base", copy)
    (copy / "model.safetensors").write_bytes(b"not read")
    return str(copy)


GROUP_64 = r"--quantize-group 64 does not divide the matrix's inputs [32] (shape (32, 2, 8)); pick one of (32,)"


@pytest.mark.parametrize("flags, message", [
    (["--quantize", "int4"], GROUP_64),  # (the default group)
    (["--quantize", "nf4", "--quantize-group", "128", "--adapter", "ADAPTER"],
     GROUP_64.replace("64", "128")),  # (checked before the float weights an adapter is merged into are read)
    (["--quantize", "nf4", "--quantize-affine"], "--quantize-affine goes with --quantize int4 alone, not nf4"),
    (["--quantize-group", "32"], "--quantize-group needs --quantize"),
    (["--quantize-affine"], "--quantize-affine needs --quantize"),
    (["--quantize-head"], "--quantize-head needs --quantize"),
    (["--quantize", "int8", "--quantize-group", "32"], "--quantize-group does not go with --quantize int8, which "
     "has one scale per output channel"),
    (["--quantize", "int2"], "argument --quantize: invalid choice: 'int2' (choose from 'int8', 'int4', 'nf4')"),
    (["--quantize", "int4", "--quantize-group", "16"], "argument --quantize-group: invalid choice: 16"),
], ids=["default-group", "group-adapter", "affine-nf4", "group-alone", "affine-alone", "head-alone", "group-int8",
         "format", "group-choice"])
def test_generate_refuses_bad_quantize_flags_before_the_weights_are_read(folders, tmp_path, flags, message):
    flags = [str(folders / "adapter") if flag == "ADAPTER" else flag for flag in flags]
    done = run_main(generate_command.main, ["--checkpoint", not_read(folders, tmp_path), "--prompt", "hi", *flags])
    assert (done.returncode, done.stdout) == (2, "") and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"jaxformer-generate: error: {message}"), done.stderr


@pytest.mark.parametrize("command, flags", [
    (perplexity_command, ["--data", "TEXT"]),
    (perplexity_command, ["--data", "TEXT", "--adapter", "ADAPTER"]),
    (serve_command, ["--port", "0"]),
], ids=["perplexity", "perplexity-adapter", "serve"])
def test_perplexity_and_serve_refuse_a_group_that_does_not_tile_before_the_weights_are_read(folders, tmp_path,
                                                                                           command, flags):
    flags = [{"TEXT": str(folders / "text.txt"), "ADAPTER": str(folders / "adapter")}.get(f, f) for f in flags]
    done = run_main(command.main, ["--checkpoint", not_read(folders, tmp_path), "--quantize", "nf4", *flags])
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"{command.PROG}: error: {GROUP_64}\n"
    done = run_main(command.main, ["--checkpoint", "dir", "--quantize-group", "32", *flags])
    assert done.stderr == f"{command.PROG}: error: --quantize-group needs --quantize\n"


def library_tokens(params) -> list[int]:
    ids = np.array([TOKENIZER.encode(PROMPT)])
    return np.asarray(generate(Decoder(CONFIG), params, ids, max_new_tokens=NEW))[0, ids.shape[1]:].tolist()


def test_generate_int8_prints_the_tokens_of_the_library_on_the_int8_model(folders):
    done = run_main(generate_command.main, ["--checkpoint", str(folders / "base"), "--prompt", PROMPT,
                                            "--max-new-tokens", str(NEW), "--json", "--quantize", "int8"])
    assert done.returncode == 0, done.stderr
    _, params = load_hf(str(folders / "base"), quantize="int8")
    assert isinstance(params["block_0"]["attn"]["wq"], QArray)
    want = library_tokens(params)
    assert json.loads(done.stdout)["token_ids"] == want
    _, float_params = load_hf(str(folders / "base"))
    assert want != library_tokens(float_params)  # (so a flag ignored would fail)
    # The line that says what was loaded names the format, and counts a quantized matrix's weights, not its scales.
    count = sum(x.size for x in jax.tree.leaves(float_params))
    assert done.stderr.splitlines()[0].endswith(f"vocab 400, {count:,} parameters, float32, int8 matrices")


def test_generate_quantizes_the_embedding_and_head_when_asked(folders):
    done = run_main(generate_command.main, ["--checkpoint", str(folders / "base"), "--prompt", PROMPT,
                                            "--max-new-tokens", str(NEW), "--json", "--quantize", "int8",
                                            "--quantize-head"])
    assert done.returncode == 0, done.stderr
    _, params = load_hf(str(folders / "base"), quantize=Quantization("int8", head=True))
    assert isinstance(params["embed"], QArray) and isinstance(params["lm_head"], QArray)
    want = library_tokens(params)
    assert json.loads(done.stdout)["token_ids"] == want
    assert want != library_tokens(load_hf(str(folders / "base"), quantize="int8")[1])  # (the head's rounding shows)
    assert done.stderr.splitlines()[0].endswith("float32, int8 matrices, embedding and head")


def command_nll(folder, *flags) -> float:
    done = run_main(perplexity_command.main, ["--checkpoint", str(folder), "--data", str(folder.parent / "text.txt"),
                                              "--window", "32", "--stride", "16", "--json", *flags])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["nll"]


def test_perplexity_nf4_is_the_library_perplexity_of_the_nf4_model(folders):
    nf4 = command_nll(folders / "base", "--quantize", "nf4", "--quantize-group", "32")
    ids = TOKENIZER.encode((folders / "text.txt").read_text())
    _, params = load_hf(str(folders / "base"), quantize=Quantization("nf4", 32))
    assert nf4 == perplexity(Decoder(CONFIG), params, ids, 32, 16).nll
    assert nf4 != perplexity(Decoder(CONFIG), load_hf(str(folders / "base"))[1], ids, 32, 16).nll


def test_an_adapter_is_merged_into_the_float_matrices_then_quantized(folders):
    """The adapted model quantized is the merged checkpoint loaded quantized: one rounding, of the
    merged matrix."""
    adapted = command_nll(folders / "base", "--adapter", str(folders / "adapter"), "--quantize", "int8")
    assert adapted == command_nll(folders / "merged", "--quantize", "int8")
    assert adapted != command_nll(folders / "merged")


def test_serve_loads_the_quantized_model(folders):
    args = serve_command.parse_args(["--checkpoint", str(folders / "base"), "--quantize", "int4", "--quantize-group",
                                     "32", "--quantize-affine", "--max-batch", "1"])
    engine, _ = serve_command.load(args)
    try:
        _, want = load_hf(str(folders / "base"), quantize=Quantization("int4", 32, affine=True))
        got, expected = (jax.tree.leaves(tree) for tree in (engine.params, want))
        assert [x.dtype for x in got] == [x.dtype for x in expected] and jax.numpy.uint4 in [x.dtype for x in got]
        for x, y in zip(got, expected):
            np.testing.assert_array_equal(x, y)
    finally:
        engine.close()


def test_generate_end_to_end_in_its_own_process(folders):
    """The command as a user runs it, int8 with an adapter merged and the layers scanned: the
    tokens of the merged checkpoint loaded int8 (the in-process run)."""
    flags = ["--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json", "--quantize", "int8"]
    done = subprocess.run([sys.executable, "-m", "jaxformer.commands.generate", "--checkpoint", str(folders / "base"),
                           "--adapter", str(folders / "adapter"), "--scan-layers", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    merged = run_main(generate_command.main, ["--checkpoint", str(folders / "merged"), *flags])
    assert json.loads(done.stdout)["token_ids"] == json.loads(merged.stdout)["token_ids"]
    assert done.stderr.splitlines()[0].endswith("float32, int8 matrices")
