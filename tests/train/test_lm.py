"""`python -m train.lm`: both tasks end to end, their tokenizers, and bad flags or data
(tiny settings). The run directory's tokenizer and `--export`: test_lm_export.py."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import run_main
from report_page import check_report

from jaxformer.text import train_bpe
from jaxformer.training import read_metrics
from jaxformer.training.report_page import read_snapshots
from train import lm
from train.tasks import COPY_BOS, COPY_LEN, COPY_SEP, COPY_VOCAB, TextCorpus, copy_tokenizer

TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--n-kv-head", "1", "--batch-size", "8",
        "--log-every", "5", "--checkpoint-every", "5", "--warmup", "2"]


def test_copy_task_end_to_end(tmp_path):
    run_dir = tmp_path / "copy"
    done = run_main(lm.main, ["--steps", "10", "--eval-size", "20", "--run-dir", str(run_dir), *TINY])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for expected in ("params", "chance loss", "KV-cached greedy decoding on 20 unseen patterns", "exact match"):
        assert expected in done.stdout
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [5, 10]
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["steps"] == 10 and 0.0 <= results["exact_match"] <= 1.0
    # The report page: the self-attention of the one layer's two heads at steps 0, 5 and 10,
    # and each step's greedy decoding of the two unseen patterns, set against them.
    page = check_report(run_dir)
    assert page.snapshot_steps == [0, 5, 10] and len(page.images) == 3 * 2 and "samples" in page.sections
    snapshots = read_snapshots(run_dir)
    assert [len(s["samples"]) for s in snapshots] == [lm.SNAPSHOT_PROMPTS] * 3
    sample = snapshots[-1]["samples"][0]
    assert len(sample["output"]) == len(sample["target"]) == COPY_LEN
    assert snapshots[0]["attention"][0]["rows"][:1] == ["<bos>"] and len(snapshots[0]["attention"][0]["rows"]) == 65


def test_text_task_samples_a_continuation(tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    run_dir = tmp_path / "text"
    assert lm.main(["--task", "text", "--data", str(data), "--steps", "6", "--seq-len", "16",
                    "--sample-tokens", "30", "--prompt", "the ", "--top-p", "0.9", "--run-dir", str(run_dir),
                    *TINY]) == 0
    out = capsys.readouterr().out
    assert "validation loss" in out
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["sample"].startswith("the ") and len(results["sample"]) == 4 + 30
    assert set(results["sample"]) <= set("the quick brown fox jumps over the lazy dog. ")
    # At every checkpoint, the same continuation sampled with the weights of the time.
    check_report(run_dir)
    samples = [s["samples"][0]["output"] for s in read_snapshots(run_dir)]
    assert len(samples) == 3 and samples[-1] == results["sample"]  # steps 0, 5 and 6; the last one evaluated


def test_resume_continues_the_same_loss_curve(tmp_path, capsys):
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "15", "--eval-size", "4", *TINY]
    assert lm.main(["--run-dir", str(straight), *common]) == 0
    assert lm.main(["--run-dir", str(interrupted), *common]) == 0
    # A crash after step 10's checkpoint: the last checkpoint never landed.
    shutil.rmtree(interrupted / "checkpoints" / "15")
    assert lm.main(["--run-dir", str(interrupted), "--resume", *common]) == 0
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(interrupted / "metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == [5, 10, 15]
    np.testing.assert_array_equal([m["loss"] for m in a], [m["loss"] for m in b])
    # The snapshot of step 15 recorded before the crash was dropped and redone.
    assert read_snapshots(straight) == read_snapshots(interrupted) and len(read_snapshots(straight)) == 4
    check_report(interrupted)
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a different recipe is refused
        lm.main(["--run-dir", str(interrupted), "--resume", *common, "--lr", "1e-3"])
    assert "holds a different config" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be a positive int (got 0)"),
    (["--task", "text"], "--data must be a UTF-8 text file with --task text (got None)"),
    (["--task", "text", "--data", "/nonexistent/file.txt"], "cannot read --data"),
    (["--n-head", "3"], "DecoderConfig.d_model must be divisible by n_head=3"),
    (["--warmup", "900"], "--warmup must be an int in [1, --steps=800] (got 900)"),
    (["--task", "poem"], "invalid choice"),
])
def test_bad_flags_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lm.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("content, message", [(b"", "too few"), (b"abc" * 5, "too few"),
                                              (b"\xff\xfe\x00bad", "is not UTF-8 text (byte 0xff at offset 0)")])
def test_bad_data_files(tmp_path, capsys, content, message):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    with pytest.raises(SystemExit):
        lm.main(["--task", "text", "--data", str(data), "--seq-len", "16", "--run-dir", str(tmp_path / "r"), *TINY])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_copy_task_reads_its_ids_as_words():
    tokenizer = copy_tokenizer()
    assert tokenizer.vocab_size == COPY_VOCAB and tokenizer.bos_id == COPY_BOS
    assert tokenizer.encode("<bos> 0 47 3 <sep>") == [COPY_BOS, 0, 47, 3, COPY_SEP]
    assert tokenizer.decode([COPY_BOS, 5, 7, COPY_SEP], skip_special_tokens=False) == "<bos> 5 7 <sep>"


def test_char_ids_are_the_sorted_distinct_characters(tmp_path):
    text = "ba 你好\n" * 20
    (tmp_path / "data.txt").write_text(text, encoding="utf-8")
    corpus = TextCorpus(tmp_path / "data.txt", 8)
    chars = sorted(set(text))
    assert corpus.tokenizer.vocab_size == len(chars)
    np.testing.assert_array_equal(corpus.train[:7], [chars.index(c) for c in text[:7]])
    assert corpus.tokenizer.decode(corpus.train[:7]) == text[:7]


BPE_SAMPLE = "The quick brown fox 跳过了 the lazy dog; 注意力 is all you need.\n" * 30
BPE_SCRIPT = ("import sys; from jaxformer.text import train_bpe; "
              "sys.stdout.write(train_bpe([sys.stdin.read()], 300).backend.to_str(pretty=True))")


def test_bpe_training_is_deterministic():
    """What --resume relies on: the same text trains the same tokenizer, here and in a
    fresh process (the tokenizers library's hash maps are seeded per process)."""
    first = train_bpe([BPE_SAMPLE], 300).backend.to_str(pretty=True)
    assert train_bpe([BPE_SAMPLE], 300).backend.to_str(pretty=True) == first
    other = subprocess.run([sys.executable, "-c", BPE_SCRIPT], input=BPE_SAMPLE, capture_output=True, text=True,
                           encoding="utf-8", timeout=120, check=True)
    assert other.stdout == first


# Refused as the flags are parsed, before a device is touched: {data} is a text file,
# {file} a plain file, {run} a directory that must stay absent.
TOKEN_FLAG_REFUSALS = [
    ("vocab-size-100", ["--task", "text", "--data", "{data}", "--tokenizer", "bpe", "--vocab-size", "100"],
     "--vocab-size must be an int >= 257 (got 100)"),
    ("bpe-with-copy", ["--tokenizer", "bpe"],
     "--tokenizer must be left out with --task copy, whose vocabulary is its own (48 symbols, BOS and SEP) "
     "(got 'bpe')"),
    ("vocab-size-with-char", ["--task", "text", "--data", "{data}", "--vocab-size", "300"],
     "--vocab-size must be left out unless --task text --tokenizer bpe, not with --task text --tokenizer char "
     "(got 300)"),
    ("vocab-size-with-copy", ["--vocab-size", "300"],
     "--vocab-size must be left out unless --task text --tokenizer bpe, not with --task copy (got 300)"),
    ("export-to-a-file", ["--export", "{file}"], "--export {file} is a file, not a directory"),
    ("export-under-a-file", ["--export", "{file}/hf"], "--export {file}/hf cannot be created: {file} is a file"),
    ("export-to-the-run-dir", ["--export", "{run}"], "--export {run} is the run directory"),
    ("export-to-another-folder", ["--export", "{tmp}"], "--export {tmp} holds data.txt, file: not a previous export"),
]


@pytest.mark.parametrize("argv, message", [case[1:] for case in TOKEN_FLAG_REFUSALS],
                         ids=[case[0] for case in TOKEN_FLAG_REFUSALS])
def test_token_flags_are_refused_in_one_line_before_any_work(tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("not a directory\n")
    (tmp_path / "data.txt").write_text("some text. " * 100)
    paths = {"{data}": tmp_path / "data.txt", "{file}": tmp_path / "file", "{run}": tmp_path / "run",
             "{tmp}": tmp_path}

    def fill(text: str) -> str:
        for key, path in paths.items():
            text = text.replace(key, str(path))
        return text

    with pytest.raises(SystemExit) as exit_info:
        lm.main([*map(fill, argv), "--run-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and fill(message) in lines[0], captured.err
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["data.txt", "file"]


def test_a_prompt_the_characters_cannot_spell_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "data.txt").write_text("abc abc. " * 40)
    with pytest.raises(SystemExit):
        lm.main(["--task", "text", "--data", str(tmp_path / "data.txt"), "--seq-len", "16", "--prompt", "cab€z",
                 "--run-dir", str(tmp_path / "run"), *TINY])
    err = capsys.readouterr().err.strip()
    assert err.endswith("--prompt holds characters the corpus does not: ['z', '€']"), err
    assert not (tmp_path / "run").exists()
