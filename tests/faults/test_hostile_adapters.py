"""Hostile adapter folders: what `--adapter DIR` of `jaxformer-generate` and
`jaxformer-perplexity` is given, and `jaxformer.convert.peft.load_peft` reads.

An adapter folder is someone else's file, like a checkpoint: each damage below is refused
with one line naming the file (and the tensor), exit status 2, before the base's weights
are read, by the library and by both commands. A new adapter format or field adds a row to
`DAMAGE`.

Everything runs on the tiny random checkpoint of tiny_llama.py and a LoRA adapter for it
saved by `jaxformer.convert.peft.save_peft` (no network, no torch); the commands run in-process.
"""

import json
import shutil
import struct
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_main
from harness import snapshot
from safetensors.numpy import load_file, save_file
from tiny_llama import CONFIG, checkpoint_and_text, params

from jaxformer.commands import generate, perplexity
from jaxformer.convert.peft import load_peft, save_peft
from jaxformer.lora import LoraConfig, init_lora, merge

LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
STEM = "base_model.model.model.layers.0"
WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """`checkpoint/`, `adapter/` (trained-looking: b not zero) and `text.txt`."""
    root = checkpoint_and_text(tmp_path_factory.mktemp("hostile-adapters"),
                               "The cat sat on the mat, and the dog sat on the log. " * 8)
    adapters = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(1), x.shape),
                            init_lora(params(), LORA, jax.random.key(0)))
    save_peft(CONFIG, adapters, LORA, str(root / "adapter"))
    return root


def rewrite_config(**changes):
    def damage(folder: Path) -> None:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        (folder / ADAPTER_CONFIG).write_text(json.dumps({**config, **changes}))
    return damage


def write_config(text: str):
    return lambda folder: (folder / ADAPTER_CONFIG).write_text(text)


def rewrite_tensors(change):
    def damage(folder: Path) -> None:
        tensors = {k: v.copy() for k, v in load_file(str(folder / WEIGHTS)).items()}
        change(tensors)
        save_file(tensors, str(folder / WEIGHTS))
    return damage


def truncate(folder: Path) -> None:
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(data[:len(data) // 2])


def huge_header(folder: Path) -> None:
    """The 8-byte header length claims 2**60 bytes."""
    data = (folder / WEIGHTS).read_bytes()
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", 2**60) + data[8:])


def set_value(key: str, value: float):
    return rewrite_tensors(lambda t: t[key].__setitem__((0, 0), value))


def add_tensor(key: str, value):
    return rewrite_tensors(lambda t: t.__setitem__(key, value))


# Each: (id, damage(folder), the message; `{folder}`: the adapter folder).
DAMAGE = [
    ("weights-truncated", truncate, f"{{folder}}/{WEIGHTS}: not a readable safetensors file"),
    ("weights-header-claims-2**60-bytes", huge_header, f"{{folder}}/{WEIGHTS}: not a readable safetensors file"),
    ("weights-missing", lambda f: (f / WEIGHTS).unlink(), f"{{folder}}/{WEIGHTS}: missing"),
    ("config-missing", lambda f: (f / ADAPTER_CONFIG).unlink(), f"{{folder}}: no {ADAPTER_CONFIG} there"),
    ("config-a-list", write_config("[1, 2]"), f"{{folder}}/{ADAPTER_CONFIG} holds a list, not a JSON object"),
    ("config-not-json", write_config("{oops"), f"{{folder}}/{ADAPTER_CONFIG} is not valid JSON"),
    ("config-nested-past-the-parser", write_config("[" * 100_000), "is not valid JSON here: it nests too deeply"),
    ("config-not-utf-8", lambda f: (f / ADAPTER_CONFIG).write_bytes(b'{"r": "\xff"}'),
     f"{{folder}}/{ADAPTER_CONFIG} is not valid JSON"),
    ("target_modules-an-int", rewrite_config(target_modules=5),
     f"{{folder}}/{ADAPTER_CONFIG}: target_modules must be a module name or a list of them (got 5)"),
    ("target_modules-unknown", rewrite_config(target_modules=["q_proj", "lm_head"]),
     f"{{folder}}/{ADAPTER_CONFIG}: target_modules: LoraConfig.targets must be distinct names among"),
    ("r-a-string", rewrite_config(r="4"), f"{{folder}}/{ADAPTER_CONFIG}: r must be a positive int (got '4')"),
    ("r-zero", rewrite_config(r=0), f"{{folder}}/{ADAPTER_CONFIG}: r must be a positive int (got 0)"),
    ("r-unlike-the-tensors", rewrite_config(r=2),
     f"{{folder}}/{WEIGHTS}: {STEM}.mlp.down_proj.lora_A.weight is (4, 64), not (2, 64)"),
    ("alpha-negative", rewrite_config(lora_alpha=-1), f"{ADAPTER_CONFIG}: lora_alpha must be a finite number > 0"),
    ("dropout-a-list", rewrite_config(lora_dropout=[0.1]), f"{ADAPTER_CONFIG}: lora_dropout must be a finite number"),
    ("not-lora", rewrite_config(peft_type="IA3"), f"{ADAPTER_CONFIG}: peft_type 'IA3' is not read here"),
    ("dora", rewrite_config(use_dora=True), f"{ADAPTER_CONFIG}: use_dora True is not read here (only False)"),
    ("lora-bias", rewrite_config(lora_bias=True), f"{ADAPTER_CONFIG}: lora_bias True is not read here (only False)"),
    ("target_parameters-a-string", rewrite_config(target_parameters="mlp.experts.down_proj"),
     f"{ADAPTER_CONFIG}: target_parameters must be null or a list of parameter names (got 'mlp.experts.down_proj')"),
    ("target_parameters-unknown", rewrite_config(target_parameters=["mlp.experts.w1"]),
     f"{ADAPTER_CONFIG}: target_parameters: 'mlp.experts.w1' is not read here (only the experts' "
     "mlp.experts.gate_up_proj, mlp.experts.down_proj, or a dotted tail of one)"),
    ("target_parameters-of-a-model-without-experts", rewrite_config(target_parameters=["experts.down_proj"]),
     f"{ADAPTER_CONFIG}: target_parameters: mlp.experts.down_proj is not a parameter of a llama checkpoint (it has "
     "no layer of experts)"),
    ("target_parameters-with-dropout", rewrite_config(target_parameters=["mlp.experts.down_proj"], lora_dropout=0.1),
     f"{ADAPTER_CONFIG}: lora_dropout: LoraConfig.dropout must be 0 with the experts' targets"),
    ("a-tensor-missing", rewrite_tensors(lambda t: t.pop(f"{STEM}.self_attn.q_proj.lora_B.weight")),
     f"{{folder}}/{WEIGHTS} lacks {STEM}.self_attn.q_proj.lora_B.weight: not the adapters its adapter_config.json "
     "describes"),
    ("a-tensor-for-a-layer-the-model-lacks",
     add_tensor("base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight", np.zeros((4, 32), np.float32)),
     f"{{folder}}/{WEIGHTS} holds base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight: not the adapters"),
    ("a-tensor-of-ints", rewrite_tensors(lambda t: t.__setitem__(f"{STEM}.self_attn.v_proj.lora_A.weight",
                                                                 t[f"{STEM}.self_attn.v_proj.lora_A.weight"].astype(
                                                                     np.int32))),
     f"{STEM}.self_attn.v_proj.lora_A.weight is stored as I32; only floating tensors"),
    ("nan-in-b", set_value(f"{STEM}.mlp.down_proj.lora_B.weight", np.nan),
     f"{{folder}}/{WEIGHTS}: {STEM}.mlp.down_proj.lora_B.weight holds NaN or inf: not a usable adapter"),
    ("inf-in-a", set_value(f"{STEM}.self_attn.q_proj.lora_A.weight", np.inf),
     f"{STEM}.self_attn.q_proj.lora_A.weight holds NaN or inf"),
]


@pytest.fixture
def damaged(root, tmp_path, request):
    """A copy of the adapter, damaged by the case."""
    folder = Path(shutil.copytree(root / "adapter", tmp_path / "adapter"))
    request.param(folder)
    return folder


@pytest.mark.parametrize("damaged, message", [case[1:] for case in DAMAGE], ids=[case[0] for case in DAMAGE],
                         indirect=["damaged"])
def test_load_peft_refuses_a_damaged_adapter_naming_the_file(damaged, message):
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        load_peft(CONFIG, str(damaged))
    assert message.format(folder=damaged) in str(refused.value)


COMMANDS = {
    "generate": lambda root: (generate.main, ["--checkpoint", str(root / "checkpoint"), "--prompt", "The cat",
                                              "--max-new-tokens", "4"]),
    "perplexity": lambda root: (perplexity.main, ["--checkpoint", str(root / "checkpoint"), "--data",
                                                  str(root / "text.txt"), "--window", "32"]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("damaged, message", [case[1:] for case in DAMAGE], ids=[case[0] for case in DAMAGE],
                         indirect=["damaged"])
def test_the_commands_refuse_a_damaged_adapter_in_one_line_before_reading_the_weights(root, damaged, message, command,
                                                                                      monkeypatch):
    main, argv = COMMANDS[command](root)
    module = sys.modules[main.__module__]
    monkeypatch.setattr(module, "load_hf", _no_weights)
    before = snapshot(root)
    done = run_main(main, [*argv, "--adapter", str(damaged)])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and message.format(folder=damaged) in lines[0], done.stderr
    assert snapshot(root) == before


def _no_weights(*args, **kwargs):
    raise AssertionError("the base's weights were read before the adapter was checked")


def test_the_undamaged_adapter_loads_as_it_was_saved(root):
    """The control: what the damage cases start from loads, and merges into what both commands run."""
    adapters, lora = load_peft(CONFIG, str(root / "adapter"))
    assert sorted(lora.targets) == sorted(LORA.targets) and lora.replace(targets=LORA.targets) == LORA
    base = params()
    saved = init_lora(base, LORA, jax.random.key(0))
    want = jax.tree.map(lambda x: 0.3 * jax.random.normal(jax.random.key(1), x.shape), saved)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), adapters, want)
    assert jax.tree.structure(merge(base, adapters, lora)) == jax.tree.structure(base)
    done = run_main(perplexity.main, ["--checkpoint", str(root / "checkpoint"), "--data", str(root / "text.txt"),
                                      "--window", "32", "--adapter", str(root / "adapter")])
    assert done.returncode == 0 and done.stdout.startswith("perplexity "), done.stderr
