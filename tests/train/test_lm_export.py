"""`python -m train.lm` speaks tokens a user can reuse: the run directory keeps its
tokenizer, and `--export DIR` writes a folder that transformers, its `AutoTokenizer` and
`jaxformer-generate` read.

One tiny run of each kind (BPE text, character text, the copy task) is trained once, in
process, and shared. The exported model is checked against the trained parameters as the
run directory's newest checkpoint holds them (not against `load_hf` of the export, which
would only test a round trip).
"""

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import random
import shlex
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_peer

from jaxformer import Decoder, generate
from jaxformer.commands import generate as generate_cli
from jaxformer.text.tokenizer import TOKENIZER_FILE
from jaxformer.training import Checkpointer, TrainState
from jaxformer.training.exports import EXPORT_FILES
from train import lm

TINY = ["--n-layer", "1", "--d-model", "32", "--n-head", "2", "--n-kv-head", "1", "--batch-size", "8",
        "--steps", "20", "--warmup", "2", "--seq-len", "32", "--log-every", "10", "--checkpoint-every", "10"]
# Chinese and ASCII, spaces and punctuation: every character of it is in the data file, so
# that the character vocabulary spells it too.
MIXED = "hello 你好, the model 训练 world."
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world.", "你好,", "世界",
         "模型", "训练", "注意力", "model"]
KINDS = {  # each run's flags besides TINY, --run-dir and --export; {data} is the text file
    "bpe": ["--task", "text", "--data", "{data}", "--tokenizer", "bpe", "--vocab-size", "300", "--sample-tokens", "8"],
    "char": ["--task", "text", "--data", "{data}", "--sample-tokens", "8"],
    "copy": ["--eval-size", "4"],
}
TOLERANCE = 1e-4  # float32 logits
_TRAINED = {}  # run directory -> what Run.trained() gives


@dataclasses.dataclass(frozen=True)
class Run:
    """A finished run with its export."""

    flags: list[str]  # the run's recipe: no --run-dir, no --export
    run_dir: Path
    export: Path
    stdout: str

    def resume(self, run_dir: Path | None = None) -> list[str]:
        """The argv that resumes the run (or its copy in `run_dir`)."""
        return [*self.flags, "--run-dir", str(run_dir or self.run_dir), "--resume"]

    def trained(self):
        """`(setup, params)`: the run rebuilt from its flags, and the parameters of its
        newest checkpoint (rebuilt and restored once per run; the tests only read them)."""
        if self.run_dir not in _TRAINED:
            settings, _ = lm.parse_args(self.resume())
            setup = lm.build(settings)
            with Checkpointer(self.run_dir, read_only=True) as saved:
                restored = saved.restore_newest(TrainState.create(setup.params, setup.optimizer))
            _TRAINED[self.run_dir] = setup, restored.state.params
        return _TRAINED[self.run_dir]

    def hint(self) -> list[str]:
        """The example command printed at the end, as argv (from "jaxformer-generate")."""
        line = next(line for line in self.stdout.splitlines() if line.startswith(f"exported to {self.export}: "))
        return shlex.split(line.split(": ", 1)[1])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """About 6 KB of text: lines of random words, English and Chinese."""
    rng = random.Random(0)
    lines = [MIXED] + [" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(100)]
    path = tmp_path_factory.mktemp("data") / "mixed.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """`runs(kind) -> Run`, each kind trained (and exported) once, on first use."""
    done = {}

    def get(kind: str) -> Run:
        if kind not in done:
            root = tmp_path_factory.mktemp(kind)
            flags = [*TINY, *(a.replace("{data}", str(data)) for a in KINDS[kind])]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):  # (a module-scoped fixture has no capsys)
                assert lm.main([*flags, "--run-dir", str(root / "run"), "--export", str(root / "hf")]) == 0
            done[kind] = Run(flags, root / "run", root / "hf", out.getvalue())
        return done[kind]

    return get


def snapshot(directory: Path) -> dict[str, str]:
    """Every file and folder under `directory` with its content's hash."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(directory.rglob("*"))}


# ---------------------------------------------------------------------------------------
# The run directory's tokenizer.json

def test_the_run_directory_keeps_the_tokenizer(runs):
    for kind in KINDS:
        run = runs(kind)
        setup, _ = run.trained()
        assert (run.run_dir / TOKENIZER_FILE).read_text(encoding="utf-8") == setup.tokenizer.backend.to_str(
            pretty=True)
        recorded = json.loads((run.run_dir / "config.json").read_text())
        assert recorded["model"]["vocab_size"] == setup.tokenizer.vocab_size


def _edit_vocabulary(run_dir: Path) -> None:
    """Swaps the ids of two tokens in the run's tokenizer.json (a data file that changed)."""
    path = run_dir / TOKENIZER_FILE
    saved = json.loads(path.read_text(encoding="utf-8"))
    vocab = saved["model"]["vocab"]
    a, b = list(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(saved, indent=2, ensure_ascii=False), encoding="utf-8")


@pytest.mark.parametrize("damage, message", [
    (_edit_vocabulary, "tokenizer.json differs from the tokenizer this run builds"),
    (lambda run_dir: (run_dir / TOKENIZER_FILE).unlink(), "cannot read "),
], ids=["changed", "missing"])
def test_resume_refuses_another_tokenizer_in_one_line_and_changes_nothing(runs, tmp_path, capsys, damage, message):
    run = runs("bpe")
    run_dir = tmp_path / "run"
    shutil.copytree(run.run_dir, run_dir)
    damage(run_dir)
    before = snapshot(run_dir)
    with pytest.raises(SystemExit) as exit_info:
        lm.main(run.resume(run_dir))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(run_dir / TOKENIZER_FILE) in lines[0], lines
    assert snapshot(run_dir) == before


# ---------------------------------------------------------------------------------------
# --export

def test_export_writes_a_hugging_face_folder_and_says_how_to_decode_it(runs):
    for kind in KINDS:
        run = runs(kind)
        assert sorted(p.name for p in run.export.iterdir()) == sorted(EXPORT_FILES)
        hint = run.hint()
        assert hint[:3] == ["jaxformer-generate", "--checkpoint", str(run.export)], hint
        assert hint[3] == "--prompt" and hint[4].strip(), hint
    assert runs("copy").hint()[4].startswith("<bos> ") and runs("copy").hint()[4].endswith(" <sep>")
    special = json.loads((runs("bpe").export / "generation_config.json").read_text())
    assert special == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def test_resume_of_a_finished_run_exports_it_without_training(runs, tmp_path, capsys):
    run = runs("bpe")
    again = tmp_path / "again"
    assert lm.main([*run.resume(), "--export", str(again)]) == 0
    assert "resuming at step 20 of 20: nothing left to train" in capsys.readouterr().out
    for name in EXPORT_FILES:  # the same parameters, written the same way
        assert (again / name).read_bytes() == (run.export / name).read_bytes(), name


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_generation_cli_decodes_the_export(runs, kind):
    """The printed example command, run: greedy decoding of the folder prints what
    `jaxformer.generate` makes of the trained parameters, cut at EOS and decoded."""
    run = runs(kind)
    setup, params = run.trained()
    tokenizer, hint = setup.tokenizer, run.hint()
    out = io.StringIO()
    assert generate_cli.main([*hint[1:-2], "--max-new-tokens", "8"], stdout=out) == 0
    prompt_ids = tokenizer.encode(hint[4])
    new = np.asarray(generate(Decoder(setup.model.config), params, jnp.asarray([prompt_ids]), max_new_tokens=8))
    new = new[0, len(prompt_ids):].tolist()
    stops = [i for i, token in enumerate(new) if token in tokenizer.stop_ids]
    want = tokenizer.decode(new[:stops[0]] if stops else new)
    # (The copy task's words are decoded behind the prompt's, so its completion starts
    # with the space between them.)
    assert out.getvalue() == (" " if kind == "copy" else "") + want + "\n"


@pytest.fixture(scope="module")
def transformers():
    import_peer("torch")
    return import_peer("transformers")


@functools.partial(jax.jit, static_argnames="model")
def logits(model: Decoder, params, tokens):
    """`model`'s logits `[batch, len, vocab]`: one compile per config, where the eager
    forward compiles each of its operations."""
    return model.apply({"params": params}, tokens)[0]


@pytest.mark.peers
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_transformers_computes_the_trained_models_logits(runs, transformers, kind):
    import torch
    run = runs(kind)
    setup, params = run.trained()
    config = setup.model.config
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(run.export).eval()
    tokens = np.arange(2 * 24).reshape(2, 24) * 7 % config.vocab_size
    with torch.no_grad():
        want = hf_model(torch.from_numpy(tokens)).logits.numpy()
    got = logits(Decoder(config), params, jnp.asarray(tokens))
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    initial = logits(Decoder(config), setup.params, jnp.asarray(tokens))
    assert np.abs(initial - want).max() > 100 * TOLERANCE  # the export holds the trained parameters


@pytest.mark.peers
@pytest.mark.parametrize("kind, text", [("bpe", MIXED), ("char", MIXED), ("copy", "<bos> 3 11 47 0 <sep> 3 11")])
def test_auto_tokenizer_reads_the_text_as_the_run_does(runs, transformers, kind, text):
    setup, _ = runs(kind).trained()
    ours, theirs = setup.tokenizer, transformers.AutoTokenizer.from_pretrained(runs(kind).export)
    ids = ours.encode(text)
    assert theirs.encode(text) == ids and len(ids) > 4
    for skip in (True, False):
        assert theirs.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip_special_tokens=skip)
    if kind != "copy":
        assert ours.decode(ids) == text
