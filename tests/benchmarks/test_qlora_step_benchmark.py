"""`python -m benchmarks.qlora_step` on a tiny random checkpoint (no timing asserted): jaxformer's QLoRA
step in a process of its own reports its time, its quantized base's bytes (below float32's), its
compiled step's memory and its peak against the goal; its first loss is the float model's over the
dequantized base (the adapters start at zero). The peer's row runs where bitsandbytes imports, and
says it was skipped where it does not."""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import import_peer

from benchmarks import finetune, llama_1b, qlora_step

pytestmark = pytest.mark.peers  # transformers writes the checkpoint

SEQ_LEN = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama-shaped checkpoint (2 layers of 128, 512 ids) with a byte-level BPE tokenizer."""
    import_peer("transformers")
    torch = import_peer("torch")
    path = str(tmp_path_factory.mktemp("qlora") / "checkpoint")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        finetune.make_checkpoint(path, d_model=128, layers=2, vocab=512, seq_len=64)
    llama_1b.write_tokenizer(path, llama_1b.tokenizer())  # (ids below 400: inside the 512)
    return path


def dequantized_loss(path: str, base_dtype=jnp.float32, head: bool = False) -> float:
    """The float model's next-token loss (float32) over the NF4 base (with `head`, its embedding and
    head too), read as the benchmark reads it (what is not quantized in `base_dtype`), dequantized; on
    the benchmark's batch."""
    from jaxformer import Decoder, chunked_cross_entropy
    from jaxformer.convert import load_hf
    from jaxformer.quantized import QArray, Quantization, dequantize

    config, base = load_hf(path, param_dtype=base_dtype, quantize=Quantization("nf4", head=head))
    params = jax.tree.map(lambda w: dequantize(w) if isinstance(w, QArray) else w, base,
                          is_leaf=lambda w: isinstance(w, QArray))
    model = Decoder(config)
    ids = finetune.batch_ids(config.vocab_size, 1, SEQ_LEN)
    hidden, _ = model.apply({"params": params}, ids[:, :-1], hidden=True)
    return float(chunked_cross_entropy(hidden, ids[:, 1:], model.output_head(params), 0.0))


def test_the_step_reports_its_time_bytes_memory_and_the_goals_ratio(checkpoint, tmp_path, capsys):
    out = tmp_path / "q.json"
    qlora_step.main([checkpoint, "--seq-len", str(SEQ_LEN), "--steps", "2", "--out", str(out)])
    ours, *peer = json.loads(out.read_text())["results"]
    assert ours["impl"] == "jaxformer" and "failed" not in ours, ours
    assert len(ours["times_s"]) == 2 and ours["step_s"] > 0 and ours["compile_s"] > 0
    assert 0 < ours["base_bytes"] < ours["float32_bytes"]  # NF4 matrices; the embedding, head and norms float32
    assert ours["temp_bytes"] > 0 and ours["argument_bytes"] > ours["base_bytes"]  # (the base is an argument)
    assert ours["peak_rss"] >= ours["steps_peak_rss"] > 0
    # The adapters start at B = 0: the first loss is the dequantized base's, its float32 sums in another order.
    np.testing.assert_allclose(ours["first_loss"], dequantized_loss(checkpoint), rtol=1e-5)
    printed = capsys.readouterr().out
    ratio = ours["peak_rss"] / (ours["base_bytes"] + ours["temp_bytes"])
    assert f"peak RSS / (quantized base + temporaries) = {ratio:.2f} (goal: within 2: " in printed
    if importlib.util.find_spec("bitsandbytes") is None:
        assert peer == [{"impl": "peft + bitsandbytes", "skipped": peer[0]["skipped"]}]
        assert "peft + bitsandbytes: skipped: bitsandbytes is not importable in " in printed
    else:
        assert peer[0]["step_s"] > 0 and "jaxformer's step takes " in printed


def test_remat_the_head_and_the_memory_ordering_change_the_program_not_the_loss(checkpoint, tmp_path, capsys):
    out = tmp_path / "q.json"
    qlora_step.main([checkpoint, "--seq-len", str(SEQ_LEN), "--remat", "--quantize-head", "--memory-scheduler",
                     "--base-dtype", "bfloat16", "--no-peer", "--out", str(out)])
    (ours,) = json.loads(out.read_text())["results"]
    assert ours["remat"] and ours["head"] and ours["scheduler"] == "memory" and ours["base_dtype"] == "bfloat16"
    printed = capsys.readouterr().out
    assert "jaxformer nf4 --remat --quantize-head --base-dtype bfloat16 ordered for memory: step " in printed
    np.testing.assert_allclose(ours["first_loss"], dequantized_loss(checkpoint, jnp.bfloat16, head=True), rtol=1e-5)
