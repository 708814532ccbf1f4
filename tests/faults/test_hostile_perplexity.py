"""Hostile input to `jaxformer-perplexity`: every flag and file is checked
before the weights are read (one line, status 2), and a perplexity that is not a number is
an error naming its cause (status 1), never a result. A new flag adds a row to `FLAGS` or
`FILES`; a new way for the figure to fail, one to `NOT_NUMBERS`. (Damaged `--adapter`
folders: test_hostile_adapters.py.)

Everything runs in-process on the tiny random checkpoint of tiny_llama.py (context 64).
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import run_main
from tiny_llama import CONFIG, TOKENIZER, checkpoint_and_text, params, save_checkpoint

from jaxformer import Decoder
from jaxformer.commands import perplexity
from jaxformer.validation import NotFinite

TEXT = "The cat sat on the mat, and the dog sat on the log. " * 8


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return checkpoint_and_text(tmp_path_factory.mktemp("hostile-perplexity"), TEXT)


def command(*argv) -> tuple[int, str, str]:
    done = run_main(perplexity.main, [str(a) for a in argv])
    return done.returncode, done.stdout, done.stderr


def _no_weights(*args, **kwargs):
    raise AssertionError("the weights were read before the refusal")


# Each: (flags, the message).
FLAGS = [
    (["--stride", "0"], "--stride must be a positive int (got 0)"),
    (["--stride", "-3"], "--stride must be a positive int (got -3)"),
    (["--window", "0"], "--window must be an int >= 2 (got 0)"),
    (["--window", "1"], "--window must be an int >= 2 (got 1)"),
    (["--window", "16", "--stride", "17"], "--stride must be an int in [1, --window=16] (got 17)"),
    (["--window", "65"], "--window must be an int in [2, the model's context=64] (got 65)"),
    (["--stride", "65"], "--stride must be an int in [1, --window=64] (got 65)"),  # the default window: the context
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from 'float32', 'bfloat16')"),
]


@pytest.mark.parametrize("flags, message", FLAGS, ids=[" ".join(f) for f, _ in FLAGS])
def test_a_flag_out_of_range_is_refused_before_the_weights_are_read(root, monkeypatch, flags, message):
    monkeypatch.setattr(perplexity, "load_hf", _no_weights)
    status, out, err = command("--checkpoint", root / "checkpoint", "--data", root / "text.txt", *flags)
    assert status == 2 and err.strip().splitlines() == [f"{perplexity.PROG}: error: {message}"] and not out, err


# Each: (id, the path of the data given a folder of the case's own and the module's root, the
# message; `{data}`: the path).
FILES = [
    ("missing", lambda d, root: d / "none.txt", "cannot read --data {data}: No such file or directory"),
    ("a-directory", lambda d, root: d, "cannot read --data {data}: Is a directory"),
    ("not-utf-8", lambda d, root: _write(d / "x.txt", TEXT.encode() + b"\xff"),
     f"--data {{data}} is not UTF-8 text (byte 0xff at offset {len(TEXT):,})"),
    ("a-checkpoint's-weights", lambda d, root: root / "checkpoint" / "model.safetensors",
     "--data {data} is not UTF-8 text"),
    ("empty", lambda d, root: _write(d / "x.txt", b""), "--data {data} holds 1 token(s): at least 2 are needed"),
]


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make, message", [case[1:] for case in FILES], ids=[case[0] for case in FILES])
def test_a_data_file_that_is_not_text_is_refused_before_the_weights_are_read(root, tmp_path, monkeypatch, make,
                                                                             message):
    monkeypatch.setattr(perplexity, "load_hf", _no_weights)
    data = make(tmp_path, root)
    status, out, err = command("--checkpoint", root / "checkpoint", "--data", data)
    assert status == 2 and len(err.strip().splitlines()) == 1 and message.format(data=data) in err and not out, err


# Each: (id, how the weights are damaged, the message).
NOT_NUMBERS = [
    ("nan-weights", lambda p: p["block_1"]["mlp"]["w_up"].__setitem__((0, 0), np.nan),
     "the mean NLL of the window over ids [0, 32) is nan, not a result: the weights hold NaN or inf (first in "
     "block_1/mlp/w_up)"),
    ("logits-past-float32", lambda p: p["final_norm"]["weight"].__setitem__(slice(None), 1e38),
     "the mean NLL of the window over ids [0, 32) is nan, not a result: the logits overflowed in float32 though every "
     "weight is finite"),
    ("nll-past-its-exponential", lambda p: p["final_norm"]["weight"].__setitem__(slice(None), 1e5),
     "overflows, not a result: the model gives the text almost no probability"),
]


@pytest.mark.parametrize("change, message", [case[1:] for case in NOT_NUMBERS], ids=[case[0] for case in NOT_NUMBERS])
def test_a_perplexity_that_is_not_a_number_is_an_error_naming_its_cause(root, tmp_path, change, message):
    checkpoint = save_checkpoint(tmp_path / "checkpoint", params(change))
    status, out, err = command("--checkpoint", checkpoint, "--data", root / "text.txt", "--window", "32")
    assert status == 1 and len(err.strip().splitlines()) == 1 and message in err and not out, err
    ids = TOKENIZER.encode(TEXT)
    with pytest.raises(NotFinite, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        perplexity.perplexity(Decoder(CONFIG), params(change), ids, 32, 16)


def test_the_undamaged_checkpoint_gives_a_perplexity(root):
    """The control the cases above start from."""
    status, out, err = command("--checkpoint", root / "checkpoint", "--data", root / "text.txt", "--window", "32")
    assert status == 0 and out.startswith("perplexity ") and "stride 16" in out, err
