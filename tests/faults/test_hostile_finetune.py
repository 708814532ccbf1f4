"""Hostile input to `jaxformer-finetune` (and the outputs of `train.lm`): each case is
refused in one line before any work, or ends in one line saying why, and nothing saved changes.

Sections (each a table a new flag or format extends):
  Outputs apart from inputs: `--merge`, `--run-dir` (and so its adapter folder) and
    `train.lm --export` that are, hold or lie inside `--checkpoint` or `--data` (by any
    spelling: `..`, a symlink), refused at parse time, the checkpoint unchanged; a run
    directory another process holds is refused, `--resume` included.
  Data: records of every JSON kind but the two formats, messages that are not objects of
    strings, bytes that are not UTF-8, JSON nested past the parser, and a training or
    held-out split with no token to score within `--seq-len` (named, with the length it
    needs), each naming the file and line.
  Sizes: a LoRA rank past the narrow side of the adapted matrices, and a run whose state
    cannot fit the free memory, refused with the bytes before a weight is read; the device
    running out of memory mid-run ends in one line.
  Results that are not numbers: a checkpoint whose weights hold NaN, or whose logits
    overflow, or whose loss is too large for its exponential, ends with status 1 naming the
    cause, never printing the figure, and leaves no run directory.

Everything runs in-process (`run_main`) on the tiny random checkpoint of tiny_llama.py.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_main
from harness import snapshot
from tiny_llama import CONFIG, TOKENIZER, checkpoint_and_text, params, save_checkpoint

from jaxformer.commands import finetune
from jaxformer.losses import CHUNK_BYTES
from jaxformer.memory import format_bytes
from train import lm

FAST = ["--steps", "4", "--warmup", "1", "--batch-size", "2", "--seq-len", "16", "--lora-rank", "4",
        "--log-every", "2", "--checkpoint-every", "2"]
TEXT = "Keys and values are cached, so each new token costs one step. " * 30
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The cat sat."}]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """`checkpoint/` (holding exactly what an export writes) and `text.txt`."""
    return checkpoint_and_text(tmp_path_factory.mktemp("hostile-finetune"), TEXT)


def finetune_in_process(*argv) -> subprocess.CompletedProcess:
    return run_main(finetune.main, [str(a) for a in argv])


def assert_one_line(done, status: int, message: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == status and lines and message in lines[-1], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len([line for line in lines if "error:" in line]) == 1, done.stderr


# Each: (id, the flags given the case's paths, the message). `ck`: the checkpoint, `data`: the
# text file, `tmp`: a folder of the case's own.
OVERLAPS = [
    ("merge-is-the-checkpoint", lambda ck, data, tmp: ["--merge", ck], "is the same place as --checkpoint"),
    ("merge-is-the-checkpoint-spelled-with-dots", lambda ck, data, tmp: ["--merge", ck / ".." / ck.name],
     "is the same place as --checkpoint"),
    ("merge-is-a-symlink-to-the-checkpoint", lambda ck, data, tmp: ["--merge", link(tmp / "link", ck)],
     "is the same place as --checkpoint"),
    ("merge-inside-the-checkpoint", lambda ck, data, tmp: ["--merge", ck / "merged"], "lies inside --checkpoint"),
    ("merge-holds-the-data", lambda ck, data, tmp: ["--merge", data.parent], "holds --data"),
    ("merge-is-the-data", lambda ck, data, tmp: ["--merge", data], "is the same place as --data"),
    ("run-dir-inside-the-checkpoint", lambda ck, data, tmp: ["--run-dir", ck / "run"], "lies inside --checkpoint"),
    ("run-dir-is-the-checkpoint-resumed", lambda ck, data, tmp: ["--run-dir", ck, "--resume"],
     "--run-dir {ck} is the same place as --checkpoint"),
    ("run-dir-holds-the-data", lambda ck, data, tmp: ["--run-dir", data.parent, "--resume"], "holds --data"),
]


def link(path: Path, target: Path) -> Path:
    path.symlink_to(target, target_is_directory=True)
    return path


@pytest.mark.parametrize("flags, message", [case[1:] for case in OVERLAPS], ids=[case[0] for case in OVERLAPS])
def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused_before_any_work(root, tmp_path, flags, message):
    ck = shutil.copytree(root / "checkpoint", tmp_path / "checkpoint")
    data = tmp_path / "data" / "text.txt"
    data.parent.mkdir()
    data.write_text(TEXT)
    given = flags(ck, data, tmp_path)
    before = snapshot(tmp_path)
    if "--run-dir" not in given:
        given += ["--run-dir", tmp_path / "run"]
    done = finetune_in_process("--checkpoint", ck, "--data", data, *given, *FAST)
    assert_one_line(done, 2, message.format(ck=ck))
    assert snapshot(tmp_path) == before  # the checkpoint, the data and everything beside them as they were


def test_lm_refuses_an_export_that_holds_its_data(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    done = run_main(lm.main, ["--task", "text", "--data", str(data), "--export", str(tmp_path),
                              "--run-dir", str(tmp_path / "run")])
    assert_one_line(done, 2, f"--export {tmp_path} holds --data {data}")
    assert sorted(os.listdir(tmp_path)) == ["text.txt"]


def test_a_run_directory_another_process_holds_is_refused_also_to_a_resume(root, tmp_path):
    """One writer at a time: a process holding the run's lock (as a running run does) keeps a
    `--resume` out, and the resume changes nothing."""
    run_dir = tmp_path / "run"
    done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", root / "text.txt", "--run-dir", run_dir,
                               *FAST)
    assert done.returncode == 0, done.stderr[-3000:]
    before = snapshot(run_dir)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from jaxformer.training import lock_run_dir; "
                               f"lock_run_dir({str(run_dir)!r}); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", root / "text.txt", "--run-dir",
                                   run_dir, "--resume", *FAST[:1], "8", *FAST[2:])
    finally:
        holder.communicate("")
    assert_one_line(done, 2, f"run directory {run_dir} is in use by another process")
    assert snapshot(run_dir) == before


# Each: (id, the file's lines, bytes after them, the message). Nine good records first, so
# that a damaged one is the tenth line.
RECORDS = [
    ("record-a-list", [[1, 2]], b"", ":10: a record is {\"messages\""),
    ("record-a-number", [3], b"", "(got the number 3)"),
    ("record-a-string", ["hi"], b"", "(got the string 'hi')"),
    ("record-null", [None], b"", "(got null)"),
    ("messages-an-object", [{"messages": {"role": "user"}}], b"", ":10: messages must be a list"),
    ("message-a-string", [{"messages": ["hello", GOOD["messages"][1]]}], b"",
     ":10: messages[0] must be a {\"role\": str, \"content\": str} object (got the string 'hello')"),
    ("message-null", [{"messages": [None]}], b"", ":10: messages[0] must be a {\"role\": str, \"content\": str} "
                                                  "object (got null)"),
    ("content-null", [{"messages": [{"role": "user", "content": None}]}], b"",
     ":10: messages[0].content must be a string (got null)"),
    ("role-a-number", [{"messages": [{"role": 1, "content": "x"}]}], b"", ":10: messages[0].role must be a string"),
    ("completion-a-list", [{"prompt": "a", "completion": ["b"]}], b"", "(completion: got a list of 1)"),
    ("not-utf-8", [], b'{"prompt": "\xff", "completion": "x"}\n', ":10: not UTF-8 text (byte 0xff at column 13)"),
    ("not-json", [], b"{oops\n", ":10: not JSON"),
    ("an-integer-of-5000-digits", [], b'{"prompt": "a", "completion": ' + b"9" * 5000 + b"}\n",
     ":10: not JSON (Exceeds"),
    ("nested-past-the-parser", [], b"[" * 100_000 + b"\n", ":10: its JSON nests too deeply to read"),
]


@pytest.mark.parametrize("records, tail, message", [case[1:] for case in RECORDS], ids=[case[0] for case in RECORDS])
def test_a_data_file_that_does_not_hold_records_is_refused_naming_the_line(root, tmp_path, records, tail, message):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in [GOOD] * 9 + records) + tail)
    done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", data, "--run-dir", tmp_path / "run",
                               *FAST, "--seq-len", "32")
    assert_one_line(done, 2, message)
    assert not (tmp_path / "run").exists()


# A record whose completion starts past --seq-len 32: its first scored token is the first of
# the completion, after BOS and the prompt's tokens (the prompt ends at a word's end, so the
# completion's tokens are the same alone and after it).
LONG_PROMPT = "The cat sat on the mat." * 8
LONG = {"prompt": LONG_PROMPT, "completion": " Yes."}
NEEDED = len(TOKENIZER.encode(LONG_PROMPT))


@pytest.mark.parametrize("split, records, lines", [("held-out", [GOOD] * 9 + [LONG], "line 10"),
                                                  ("training", [LONG] * 9 + [GOOD], "lines 1-9")])
def test_a_split_with_nothing_to_score_is_refused_with_the_length_it_needs(root, tmp_path, split, records, lines):
    assert NEEDED > 32
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", data, "--run-dir", tmp_path / "run",
                               *FAST, "--seq-len", "32")
    line = "10" if split == "held-out" else "1"
    assert_one_line(done, 2, f"the {split} records ({lines}) have no scored token within --seq-len 32, so their loss "
                             f"would be 0/0, no result: the earliest, line {line}'s, is token {NEEDED} of its record, "
                             f"which a --seq-len of {NEEDED} or more reaches")


def test_a_text_file_that_is_not_utf8_is_refused_with_the_offset(root, tmp_path):
    data = tmp_path / "data.txt"
    data.write_bytes(TEXT.encode() + b"\xc3\x28")
    done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", data, "--run-dir", tmp_path / "run",
                               *FAST)
    assert_one_line(done, 2, f"--data {data} is not UTF-8 text (byte 0xc3 at offset {len(TEXT):,})")


# The adapted matrices of CONFIG, (n_in, n_out) per layer: q and o 32 x 32, k and v 32 x 16,
# gate and up 32 x 64, down 64 x 32; an adapter of rank r holds r (n_in + n_out) floats.
ADAPTED = CONFIG.n_layer * (2 * (32 + 32) + 2 * (32 + 16) + 3 * (32 + 64))
PARAMS = CONFIG.vocab_size * 32 + CONFIG.n_layer * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32


@pytest.mark.parametrize("rank", [1_000_000, 17])
def test_a_rank_past_the_matrices_is_refused_with_its_bytes_before_a_weight_is_read(root, tmp_path, monkeypatch, rank):
    monkeypatch.setattr(finetune, "load_hf", _no_weights)
    done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", root / "text.txt", "--run-dir",
                               tmp_path / "run", *FAST, "--lora-rank", rank)
    assert_one_line(done, 2, f"--lora-rank must be at most 16, the narrow side of k_proj (32 in, 16 out): A B has "
                             f"rank at most that, so a larger rank adds parameters ({format_bytes(4 * rank * ADAPTED)} "
                             f"of adapters at this rank, 4x that with their gradients and Adam's moments) but no "
                             f"freedom (got {rank})")


def _no_weights(*args, **kwargs):
    raise AssertionError("the weights were read before the refusal")


@pytest.mark.parametrize("flags, frozen, trained, rows", [(["--full"], 0, PARAMS, 2), ([], 4 * PARAMS, 4 * ADAPTED, 2),
                                                         (["--batch-size", "300000"], 4 * PARAMS, 4 * ADAPTED, 300000)],
                         ids=["full", "lora", "a-batch-of-300000"])
def test_a_run_that_cannot_fit_is_refused_with_the_bytes_before_a_weight_is_read(root, tmp_path, monkeypatch,
                                                                                 flags, frozen, trained, rows):
    """What a step holds at least: the trained parameters (every one with --full; LoRA's r = 4
    adapters), each float32 with its gradient and Adam's two moments, 16 bytes; LoRA's float32
    base; each block's input, rows x 16 x 2 x 32 floats, and the loss's one chunk of float32
    logits, at most CHUNK_BYTES of them, never the whole rows x 16 x vocab."""
    free = 1024 if rows == 2 else 1 << 30  # (a GiB: the state fits, 300,000 rows' activations do not)
    monkeypatch.setattr("jaxformer.memory.UNCHECKED_BYTES", 0)
    monkeypatch.setattr("jaxformer.memory.free_bytes", lambda: (free, "the host"))
    monkeypatch.setattr(finetune, "load_hf", _no_weights)
    done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", root / "text.txt", "--run-dir",
                               tmp_path / "run", *FAST, *flags)
    chunk = min(rows * 16, CHUNK_BYTES // (4 * CONFIG.vocab_size))  # positions
    activations = rows * 16 * 2 * 32 * 4 + chunk * CONFIG.vocab_size * 4
    assert_one_line(done, 2, f"fine-tuning with these flags ({format_bytes(frozen)} of frozen base in float32, "
                             f"{format_bytes(16 * trained)} of trained parameters with their gradients and Adam's "
                             f"moments, and at least {format_bytes(activations)} of activations for --batch-size "
                             f"{rows} x --seq-len 16) needs about {format_bytes(frozen + 16 * trained + activations)} "
                             f"of memory, more than the {format_bytes(free)} free on the host")


def test_running_out_of_memory_mid_run_ends_in_one_line(root, tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123456 bytes.")

    monkeypatch.setattr("jaxformer.training.runs.train_loop", out_of_memory)
    done = finetune_in_process("--checkpoint", root / "checkpoint", "--data", root / "text.txt", "--run-dir",
                               tmp_path / "run", *FAST)
    assert_one_line(done, 1, "out of memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123456 bytes.;"
                             f" no checkpoint had been saved, so nothing of the run in {tmp_path / 'run'} was kept. A "
                             "smaller --batch-size or --seq-len needs less")
    assert not (tmp_path / "run").exists()


# Each: (id, how the weights are damaged, the message).
NOT_NUMBERS = [
    ("nan-weights", lambda p: p["block_0"]["attn"]["wq"].__setitem__((0, 0, 0), np.nan),
     "the held-out loss before training is nan, not a result: the checkpoint's weights hold NaN or inf (first in "
     "block_0/attn/wq)"),
    ("logits-past-float32", lambda p: p["final_norm"]["weight"].__setitem__(slice(None), 1e38),
     "the held-out loss before training is nan, not a result: the logits overflowed in float32 though every weight "
     "is finite"),
    ("loss-past-its-exponential", lambda p: p["final_norm"]["weight"].__setitem__(slice(None), 1e5),
     "not a result: its exponential, the perplexity, overflows: the model gives the held-out tokens almost no "
     "probability"),
]


@pytest.mark.parametrize("change, message", [case[1:] for case in NOT_NUMBERS], ids=[case[0] for case in NOT_NUMBERS])
def test_a_held_out_loss_that_is_not_a_number_ends_the_run_naming_its_cause(tmp_path, change, message):
    ck = save_checkpoint(tmp_path / "checkpoint", params(change))
    (tmp_path / "text.txt").write_text(TEXT)
    done = finetune_in_process("--checkpoint", ck, "--data", tmp_path / "text.txt", "--run-dir", tmp_path / "run",
                               *FAST)
    assert_one_line(done, 1, message)
    assert "perplexity" not in done.stdout and not (tmp_path / "run").exists()
