"""`python -m benchmarks.decode_1b` on a tiny random checkpoint (no timing asserted): with
transformers, both sides decode the same prompts and float32's greedy tokens agree (where the
choice is no near-tie); with `--no-peer` (an accelerator run) jaxformer's rows alone, bfloat16
against float32."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import greedy_tokens_compared, import_peer

from benchmarks import decode_1b, finetune
from jaxformer import Decoder
from jaxformer.convert import load_hf

ARGS = ["--batch", "1", "2", "--prompt", "4", "--new", "3", "--reps", "1"]


pytestmark = pytest.mark.peers  # transformers writes the checkpoint


@pytest.fixture
def checkpoint(tmp_path) -> str:
    import_peer("transformers")
    torch = import_peer("torch")
    path = str(tmp_path / "checkpoint")
    with torch.random.fork_rng():  # (transformers draws the weights from torch's generator: the same each run)
        torch.manual_seed(0)
        finetune.make_checkpoint(path, d_model=128, layers=1, vocab=512, seq_len=64)  # the prompts' ids are below 400
    return path


def test_no_peer_times_jaxformer_alone_against_its_float32(checkpoint, tmp_path, capsys):
    out = tmp_path / "decode.json"
    decode_1b.main([checkpoint, *ARGS, "--no-peer", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["dtype"], r["batch"]) for r in rows] == [
        ("jaxformer", dtype, batch) for dtype in ("float32", "bfloat16") for batch in (1, 2)]
    assert all(len(r["tokens"]) == r["batch"] and len(r["tokens"][0]) == 3 for r in rows)
    assert [r["vs_float32"] for r in rows[:2]] == [1.0, 1.0] and all(r["vs_float32"] > 0 for r in rows[2:])
    assert "x float32" in capsys.readouterr().out and not any("vs_transformers" in r for r in rows)


def test_against_transformers_the_float32_tokens_agree(checkpoint, tmp_path):
    """Token for token wherever transformers' choice is no near-tie.

    The error model: each side's float32 logits differ from the exact ones (transformers in
    float64, fed the same tokens) by rounding alone, measured here for each side's forward over
    the whole sequence (about 3e-7 on logits below 1). The greedy runs compute the same sums in
    other orders (cached steps, other kernels): a bound on a float32 sum's rounding holds for
    every order of its terms, and one order's error is of the measured one's size; four times it
    for each side. Two runs can then pick differently only where the exact top two are within
    4 * (measured jaxformer + measured transformers): a choice that close is not compared, nor
    the row's tokens after it."""
    torch = import_peer("torch")
    transformers = import_peer("transformers")
    out = tmp_path / "decode.json"
    decode_1b.main([checkpoint, *ARGS, "--dtypes", "float32", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["batch"]) for r in rows] == [("jaxformer", 1), ("jaxformer", 2), ("transformers", 1),
                                                       ("transformers", 2)]
    assert all(r["vs_transformers"] > 0 for r in rows)
    peer = {r["batch"]: r["tokens"] for r in rows if r["impl"] == "transformers"}
    config, params = load_hf(checkpoint, max_seq_len=4 + 3)
    compared = 0
    for r in (r for r in rows if r["impl"] == "jaxformer"):
        prompt = np.random.default_rng(0).integers(0, 400, (r["batch"], 4))  # the benchmark's prompts
        fed = np.concatenate([prompt, np.asarray(peer[r["batch"]])[:, :-1]], axis=1)  # what each new token follows
        logits = {}
        for dtype in ("float32", "float64"):
            model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).eval()
            with torch.no_grad():
                logits[dtype] = model(torch.as_tensor(fed)).logits[:, 3:].numpy().astype(np.float64)
        ours = np.asarray(Decoder(config).apply({"params": params}, jnp.asarray(fed))[0][:, 3:], np.float64)
        exact = logits["float64"]
        measured = np.abs(ours - exact).max() + np.abs(logits["float32"] - exact).max()
        assert 0 < measured < 1e-5  # float32 rounding, nothing more
        compared += greedy_tokens_compared(r["tokens"], peer[r["batch"]], exact, bound=4 * measured)
    assert compared >= 6  # of 9 (3 rows, 3 tokens each): a near-tie is one choice in thousands here
