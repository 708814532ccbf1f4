"""`jaxformer-finetune`: LoRA and full fine-tuning of a checkpoint folder end to end,
the held-out perplexity, resume, the adapters and the merged folder (against peft and
transformers with the peers extra), and bad flags (a tiny checkpoint made here)."""

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import count_compiles, import_peer, jit_apply, run_main
from report_page import check_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
from checkpoints import save_random_checkpoint  # noqa: E402

from jaxformer import Decoder  # noqa: E402
from jaxformer.commands import finetune, report  # noqa: E402
from jaxformer.convert import load_hf  # noqa: E402
from jaxformer.convert.peft import load_peft  # noqa: E402
from jaxformer.lora import merge  # noqa: E402
from jaxformer.text import load_tokenizer  # noqa: E402
from jaxformer.text.dataset import IGNORE, FinetuneData  # noqa: E402
from jaxformer.training import read_metrics  # noqa: E402
from jaxformer.training.report_page import SNAPSHOTS_FILE, read_snapshots  # noqa: E402

FAST = ["--log-every", "4", "--checkpoint-every", "4", "--warmup", "2", "--batch-size", "4", "--seq-len", "32",
        "--lora-rank", "4"]
# Text the checkpoint never saw: its perplexity on the held-out tail must fall as it learns it.
NEW_TEXT = "Keys and values are cached, so each new token costs one step. " * 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random Llama-shaped checkpoint folder with a byte-level BPE tokenizer and a chat template."""
    path = tmp_path_factory.mktemp("finetune") / "checkpoint"
    save_random_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def lora_run(checkpoint, tmp_path_factory):
    """A LoRA run of 12 steps on `NEW_TEXT`, its adapters merged into `merged`."""
    root = tmp_path_factory.mktemp("lora")
    data = root / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(data), "--steps", "12",
                                    "--lr", "1e-2", "--run-dir", str(root / "run"), "--merge", str(root / "merged"),
                                    *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root, done


def test_lora_lowers_the_held_out_perplexity_and_writes_adapters_and_a_merged_folder(checkpoint, lora_run):
    root, done = lora_run
    run_dir = root / "run"
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["validation_perplexity"] < 0.8 * results["validation_perplexity_before"], results
    assert results["validation_perplexity"] == pytest.approx(np.exp(results["validation_loss"]))
    assert "held-out loss before" in done.stdout and "training LoRA r=4" in done.stdout
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [4, 8, 12]
    page = check_report(run_dir)
    assert page.snapshot_steps == [0, 4, 8, 12] and "samples" in page.sections
    # The merged folder computes what the base and the adapters do, unmerged.
    config, base = load_hf(str(checkpoint))
    adapters, lora = load_peft(config, str(run_dir / "adapter"))
    assert (lora.rank, lora.alpha, len(lora.targets)) == (4, 16.0, 7)
    merged_config, merged = load_hf(str(root / "merged"))
    assert merged_config.lora is None and (root / "merged" / "tokenizer.json").is_file()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 20)))
    unmerged = jit_apply(Decoder(config.replace(lora=lora)), {"params": base, "lora": adapters}, tokens)[0]
    np.testing.assert_allclose(jit_apply(Decoder(merged_config), {"params": merged}, tokens)[0], unmerged,
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(jit_apply(Decoder(config), {"params": base}, tokens)[0], unmerged, atol=1e-3)


def test_the_report_knows_a_fine_tuning_run_and_recomputes_its_snapshots(lora_run, tmp_path):
    """`jaxformer-report` on a LoRA run whose snapshots file is gone: it rebuilds each kept
    checkpoint's snapshot from the base and that checkpoint's adapters, equal to the run's own."""
    root, _ = lora_run
    run_dir = tmp_path / "run"
    shutil.copytree(root / "run", run_dir)
    recorded = {s["step"]: s for s in read_snapshots(run_dir)}
    (run_dir / SNAPSHOTS_FILE).unlink()
    made_by, settings = report.demo_of(run_dir)
    assert made_by is finetune and settings.lora_rank == 4
    done = run_main(report.main, [str(run_dir)])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "snapshots of checkpoints 4, 8, 12 added to the page" in done.stdout
    computed = report.snapshot_checkpoints(run_dir, made_by, settings)
    assert computed == [recorded[step] for step in (4, 8, 12)]


@pytest.mark.peers
def test_peft_and_transformers_open_the_adapters_and_the_merged_folder(checkpoint, lora_run):
    torch = import_peer("torch")
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    root, _ = lora_run
    tokens = np.random.default_rng(1).integers(0, 400, (2, 20))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(root / "run" / "adapter")).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32)
    with torch.no_grad():
        want = adapted(input_ids=torch.tensor(tokens)).logits.numpy()
        got = merged(input_ids=torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    config, params = load_hf(str(root / "merged"))
    np.testing.assert_allclose(jit_apply(Decoder(config), {"params": params}, jnp.asarray(tokens))[0], want,
                               rtol=1e-4, atol=1e-4)


def test_resume_mid_run_gives_the_uninterrupted_runs_adapters_bit_for_bit(checkpoint, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Where {i}?"},
                                                     {"role": "assistant", "content": "On the mat."}]}) + "\n"
                            for i in range(12)))
    common = ["--checkpoint", str(checkpoint), "--data", str(data), "--steps", "8", "--lora-dropout", "0.1",
              "--lora-targets", "q_proj,v_proj,down_proj", *FAST, "--seq-len", "48"]
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    assert run_main(finetune.main, [*common, "--run-dir", str(straight)]).returncode == 0
    # The run to interrupt: the same flags again would write this same directory (a run is deterministic),
    # so it starts as a copy rather than as a second run.
    shutil.copytree(straight, interrupted)
    # A crash after step 4's checkpoint: the last checkpoint and what was written after it never landed.
    shutil.rmtree(interrupted / "checkpoints" / "8")
    shutil.rmtree(interrupted / "adapter")
    done = run_main(finetune.main, [*common, "--run-dir", str(interrupted), "--resume"])
    assert done.returncode == 0 and "resuming at step 4 of 8" in done.stdout
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (straight / "adapter" / name).read_bytes() == (interrupted / "adapter" / name).read_bytes()
    a, b = (read_metrics(d / "metrics.jsonl") for d in (straight, interrupted))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]


def test_full_fine_tuning_trains_every_parameter(checkpoint, tmp_path):
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(data), "--steps", "4", "--full",
                                    "--lr", "1e-3", "--remat", "--run-dir", str(tmp_path / "run"),
                                    "--merge", str(tmp_path / "tuned"), *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "training every parameter" in done.stdout and not (tmp_path / "run" / "adapter").exists()
    _, before = load_hf(str(checkpoint))
    _, after = load_hf(str(tmp_path / "tuned"))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        assert not np.array_equal(x, y)  # every leaf moved (Adam's first step moves each by ~lr)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    """A random Qwen3-MoE checkpoint folder (4 experts of 16, 2 a token) with the same tokenizer."""
    path = tmp_path_factory.mktemp("finetune-moe") / "checkpoint"
    save_random_checkpoint(path, experts=True)
    return path


def test_a_mixture_of_experts_trains_with_its_load_balancing_loss(moe_checkpoint, tmp_path):
    # Full fine-tuning of a Qwen3-MoE: every parameter moves, the experts' too, and the routers'
    # load-balancing loss is part of the loss and logged.
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(moe_checkpoint), "--data", str(data), "--steps", "4",
                                    "--full", "--lr", "1e-3", "--run-dir", str(tmp_path / "run"),
                                    "--merge", str(tmp_path / "tuned"), *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, before = load_hf(str(moe_checkpoint))
    _, after = load_hf(str(tmp_path / "tuned"))
    assert before["block_0"]["mlp"]["w_up"].shape == (4, 32, 16)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        assert not np.array_equal(x, y)
    logged = [row for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "load_balancing_loss" in row]
    assert logged and all(2.0 <= row["load_balancing_loss"] < 4.0 for row in logged)  # k = 2 when even, E * k at most
    assert not any("dropped_pairs" in row for row in logged)  # dropless: nothing to count
    # The report page shows each layer's expert load at each snapshot (and `jaxformer-report` computes it again
    # from a checkpoint): the pairs each expert got of the router's top 2 over the first held-out rows' scored
    # positions, counted here from the router logits a forward of the weights at that step sows.
    snapshots = {s["step"]: s for s in read_snapshots(tmp_path / "run")}
    page = check_report(tmp_path / "run")
    assert "experts" in page.sections and page.load_steps == [0, 4]
    config, _ = load_hf(str(moe_checkpoint))
    rows = FinetuneData(str(data), load_tokenizer(str(moe_checkpoint)), 32).validation_batches(finetune.LOAD_ROWS)[0]
    scored = rows["targets"] != IGNORE
    for step, params in ((0, before), (4, after)):
        _, sown = jit_apply(Decoder(config), {"params": params}, jnp.asarray(rows["tokens"]), mutable=("router",))
        want = []
        for i in range(config.n_layer):
            chosen = np.asarray(jax.lax.top_k(sown["router"][f"block_{i}"]["mlp"]["logits"][0], 2)[1])  # [rows, T, 2]
            want.append({"layer": i, "counts": np.bincount(chosen[scored].reshape(-1), minlength=4).tolist()})
        assert [{"layer": g["layer"], "counts": g["counts"]} for g in snapshots[step]["experts"]] == want
        assert all(sum(g["counts"]) == 2 * scored.sum() for g in want) and scored.sum() >= 32
    assert snapshots[0]["experts"] != snapshots[4]["experts"]  # the load moved as the routers trained
    run_dir = tmp_path / "again"
    shutil.copytree(tmp_path / "run", run_dir)
    (run_dir / SNAPSHOTS_FILE).unlink()
    done = run_main(report.main, [str(run_dir)])
    assert done.returncode == 0 and "snapshots of checkpoints 4 added to the page" in done.stdout, done.stderr
    computed = report.snapshot_checkpoints(run_dir, *report.demo_of(run_dir))
    assert computed == [snapshots[4]]
    assert check_report(run_dir, computed).load_steps == [4]
    # With a capacity (half an even share), the steps drop pairs and log how many; the model saved is dropless.
    done = run_main(finetune.main, ["--checkpoint", str(moe_checkpoint), "--data", str(data), "--steps", "4",
                                    "--full", "--capacity-factor", "0.5", "--run-dir", str(tmp_path / "capped"),
                                    "--merge", str(tmp_path / "capped-model"), *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    dropped = [row["dropped_pairs"] for row in read_metrics(tmp_path / "capped" / "metrics.jsonl")
               if "dropped_pairs" in row]
    # 4 rows x 32 tokens x k=2 pairs a layer, 2 layers: at least half of the 512 pairs dropped
    assert dropped and all(256 <= d < 512 for d in dropped)
    assert load_hf(str(tmp_path / "capped-model"))[0].layers[0].ffn.capacity_factor is None


# LoRA on a mixture of experts: on its attention (what --lora-targets all adapts there), and on its
# experts' stacked matrices (peft's target_parameters), each expert an adapter of its own.
MOE_TARGETS = {"attention": "q_proj,v_proj", "experts": "q_proj,mlp.experts.gate_up_proj,mlp.experts.down_proj"}


@pytest.fixture(scope="module", params=sorted(MOE_TARGETS))
def moe_lora_run(moe_checkpoint, tmp_path_factory, request):
    """A LoRA run of 8 steps on the Qwen3-MoE, its adapters merged into `merged`: (root, stdout)."""
    root = tmp_path_factory.mktemp(f"moe-lora-{request.param}")
    data = root / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(moe_checkpoint), "--data", str(data), "--steps", "8",
                                    "--lr", "1e-2", "--lora-targets", MOE_TARGETS[request.param],
                                    "--run-dir", str(root / "run"), "--merge", str(root / "merged"), *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root, done.stdout


def moe_logits_unmerged(checkpoint, adapter_dir, tokens):
    """Our model of the checkpoint with the adapter folder's adapters beside it."""
    config, base = load_hf(str(checkpoint))
    adapters, lora = load_peft(config, str(adapter_dir))
    return np.asarray(jit_apply(Decoder(config.replace(lora=lora)), {"params": base, "lora": adapters},
                                jnp.asarray(tokens))[0]), adapters, lora


def test_lora_on_a_mixture_of_experts_trains_its_targets_and_merges(moe_checkpoint, moe_lora_run):
    root, stdout = moe_lora_run
    tokens = np.random.default_rng(1).integers(0, 400, (2, 20))
    unmerged, adapters, lora = moe_logits_unmerged(moe_checkpoint, root / "run" / "adapter", tokens)
    assert "training LoRA r=4" in stdout and all(target in stdout for target in lora.targets)
    trained = {name for parts in adapters.values() for adapters_of in parts.values()
               for name, ab in adapters_of.items() if np.abs(np.asarray(ab["b"])).max() > 0}
    assert trained == ({"wq", "wv"} if "v_proj" in lora.targets else {"wq", "experts_gate_up", "experts_down"})
    if "mlp.experts.down_proj" in lora.targets:
        moved = np.abs(np.asarray(adapters["block_0"]["mlp"]["experts_down"]["b"])).max(axis=(1, 2))
        assert (moved > 0).all()  # each expert's own adapter, each routed to and trained
    merged_config, merged = load_hf(str(root / "merged"))
    np.testing.assert_allclose(jit_apply(Decoder(merged_config), {"params": merged}, jnp.asarray(tokens))[0],
                               unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.peers
def test_peft_opens_the_adapters_of_a_mixture_of_experts_on_transformers(moe_checkpoint, moe_lora_run):
    torch = import_peer("torch")
    transformers = import_peer("transformers")
    peft = import_peer("peft")
    root, _ = moe_lora_run
    tokens = np.random.default_rng(1).integers(0, 400, (2, 20))
    unmerged, _, lora = moe_logits_unmerged(moe_checkpoint, root / "run" / "adapter", tokens)
    written = json.loads((root / "run" / "adapter" / "adapter_config.json").read_text())
    assert (written["target_modules"], written["target_parameters"]) == (
        sorted(lora.module_targets), sorted(lora.parameter_targets) or None)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(moe_checkpoint), dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=torch.tensor(tokens)).logits.numpy()
    adapted = peft.PeftModel.from_pretrained(base, str(root / "run" / "adapter")).eval()
    with torch.no_grad():
        want = adapted(input_ids=torch.tensor(tokens)).logits.numpy()
    assert np.abs(want - plain).max() > 1e-2  # the adapters change the model, and peft read them
    np.testing.assert_allclose(unmerged, want, rtol=1e-4, atol=1e-4)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(merged(input_ids=torch.tensor(tokens)).logits.numpy(), want, rtol=1e-4, atol=1e-4)


def test_a_mixture_of_experts_refuses_the_mlps_module_targets_in_one_line(moe_checkpoint, tmp_path):
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(moe_checkpoint), "--data", str(data), "--steps", "20",
                                    "--run-dir", str(tmp_path / "run"), "--seq-len", "32",
                                    "--lora-targets", "q_proj,down_proj"])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert ("--lora-targets q_proj,down_proj: down_proj is not a module of a qwen3_moe checkpoint (layer 0's MLP is "
            "its experts, whose matrices are parameters: mlp.experts.gate_up_proj, mlp.experts.down_proj); its "
            "targets: q_proj, k_proj, v_proj, o_proj, mlp.experts.gate_up_proj, mlp.experts.down_proj") in done.stderr



def test_lora_on_a_hybrid_trains_its_linear_and_attention_layers_adapters(tmp_path):
    # A Qwen3.5-shaped checkpoint (3 Gated DeltaNet layers, then a gated attention layer) with the
    # fine-tuning tokenizer: LoRA on the attention layers' q_proj and o_proj and the linear layers'
    # in_proj_qkv, in_proj_z and out_proj trains, and its adapter folder loads with those targets.
    save_random_checkpoint(tmp_path / "checkpoint", shipped="Qwen3.5-9B")
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    targets = "q_proj,o_proj,in_proj_qkv,in_proj_z,out_proj"
    done = run_main(finetune.main, ["--checkpoint", str(tmp_path / "checkpoint"), "--data", str(data), "--steps", "8",
                                    "--lr", "1e-2", "--lora-targets", targets, "--run-dir", str(tmp_path / "run"),
                                    *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert results["validation_perplexity"] < 0.8 * results["validation_perplexity_before"], results
    config, _ = load_hf(str(tmp_path / "checkpoint"))
    adapters, lora = load_peft(config, str(tmp_path / "run" / "adapter"))
    assert sorted(lora.targets) == sorted(targets.split(","))
    assert sorted(adapters["block_0"]["attn"]) == ["linear_o", "linear_qkv", "linear_z"]
    assert sorted(adapters["block_3"]["attn"]) == ["wo", "wq"]


def test_a_bfloat16_base_is_held_in_bfloat16_and_the_adapters_in_float32(checkpoint, tmp_path):
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    setup = finetune.build(finetune.Settings(checkpoint=str(checkpoint), data=str(data), base_dtype="bfloat16",
                                              seq_len=32))
    assert {x.dtype for x in jax.tree.leaves(finetune.base_of(setup))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(setup.params)} == {jnp.dtype(jnp.float32)}
    batch = setup.make_batch(jax.random.key(0))
    loss, _ = jax.jit(setup.loss_fn)(setup.params, batch, jax.random.key(1), setup.frozen)  # (one compile)
    assert np.isfinite(float(loss))


def test_qlora_trains_adapters_over_a_quantized_base_and_merges_into_a_float_folder(checkpoint, tmp_path):
    """--quantize nf4: the base is held quantized (its matrices NF4, the rest as stored), the adapters
    learn through it, and --merge writes a float folder equal to the adapters merged into the
    dequantized base."""
    from jaxformer.quantized import QArray, Quantization, dequantize, format_of

    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    setup = finetune.build(finetune.Settings(checkpoint=str(checkpoint), data=str(data), seq_len=32,
                                              quantize="nf4", quantize_group=32))
    base = finetune.base_of(setup)
    quantized = [w for w in jax.tree.leaves(base, is_leaf=lambda w: isinstance(w, QArray)) if isinstance(w, QArray)]
    assert quantized and {format_of(w) for w in quantized} == {"nf4"}
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(data), "--steps", "12",
                                    "--lr", "1e-2", "--run-dir", str(tmp_path / "run"), "--merge",
                                    str(tmp_path / "merged"), "--quantize", "nf4", "--quantize-group", "32", *FAST])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert results["validation_perplexity"] < 0.8 * results["validation_perplexity_before"], results
    config, _ = load_hf(str(checkpoint))
    _, quantized_base = load_hf(str(checkpoint), quantize=Quantization("nf4", 32))
    adapters, lora = load_peft(config, str(tmp_path / "run" / "adapter"))
    want = merge(jax.tree.map(lambda w: dequantize(w) if isinstance(w, QArray) else w, quantized_base,
                              is_leaf=lambda w: isinstance(w, QArray)), adapters, lora)
    _, merged = load_hf(str(tmp_path / "merged"))
    for got, expected in zip(jax.tree.leaves(merged), jax.tree.leaves(want)):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_qlora_with_a_quantized_head_learns_through_it(checkpoint, tmp_path):
    """--quantize-head: the embedding and head of the frozen base quantized too; the adapters'
    gradient flows back through the quantized head (a step lowers the loss)."""
    from jaxformer.quantized import QArray

    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    setup = finetune.build(finetune.Settings(checkpoint=str(checkpoint), data=str(data), seq_len=32,
                                              quantize="int8", quantize_head=True))
    base = finetune.base_of(setup)
    assert isinstance(base["embed"], QArray)
    batch = setup.make_batch(jax.random.key(0))
    loss = jax.jit(lambda params, base: setup.loss_fn(params, batch, jax.random.key(1), base)[0])  # (base: an argument)
    grads = jax.grad(loss)(setup.params, base)
    stepped = jax.tree.map(lambda p, g: p - 1e-2 * g, setup.params, grads)
    assert float(loss(stepped, base)) < float(loss(setup.params, base))


def test_the_held_out_loss_before_and_after_training_is_one_program(checkpoint, tmp_path):
    """The evaluation after training reuses the one before's program (the parameters are its
    argument), and the loss is the direct mean over the scored tokens."""
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    setup = finetune.build(finetune.Settings(checkpoint=str(checkpoint), data=str(data), seq_len=32))
    before = finetune.validation_loss(setup, setup.params, 4)
    moved = jax.tree.map(lambda x: x + 0.1, setup.params)
    with count_compiles() as compiles:
        after = finetune.validation_loss(setup, moved, 4)
    assert compiles == [] and before != after
    # The reference: the plain model on the base with the adapters merged in (the evaluation applies them unmerged).
    config = setup.model.config
    model, params = Decoder(config.replace(lora=None)), merge(finetune.base_of(setup), moved, config.lora)
    nll, count = 0.0, 0
    for batch in setup.corpus.validation_batches(4):
        logits = np.asarray(jit_apply(model, {"params": params}, batch["tokens"])[0], np.float64)
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        scored = batch["targets"] != -100
        nll -= np.take_along_axis(log_probs, np.where(scored, batch["targets"], 0)[..., None], -1)[..., 0][scored].sum()
        count += scored.sum()
    assert after == pytest.approx(nll / count, rel=1e-5)


@pytest.mark.parametrize("extra, message", [
    (["--lora-targets", "q_proj,wk"], "--lora-targets 'q_proj,wk', comma-separated or 'all': LoraConfig.targets "
                                      "must be distinct names among q_proj"),
    (["--lora-targets", "qkv_proj", "--seq-len", "32"],
     "--lora-targets qkv_proj: qkv_proj is not a module of a llama checkpoint "
                                     "(layer 0's attn/wq is in model.layers.0.self_attn.q_proj.weight); its targets: "
                                     "q_proj, k_proj"),
    (["--lora-targets", "mlp.experts.down_proj", "--seq-len", "32"],
     "--lora-targets mlp.experts.down_proj: mlp.experts.down_proj is not a parameter of a llama checkpoint (it has no "
     "layer of experts)"),
    (["--lora-targets", "q_proj,mlp.experts.gate_up_proj", "--lora-dropout", "0.1"],
     "--lora-dropout must be 0 with the experts' targets (mlp.experts.gate_up_proj): peft adapts a parameter without "
     "dropout"),
    (["--seq-len", "65"], "--seq-len must be at most the model's context, 64"),
    (["--full", "--base-dtype", "bfloat16"], "--base-dtype must be float32 with --full"),
    (["--capacity-factor", "1.0", "--seq-len", "32"],
     "--capacity-factor must be given only for a checkpoint whose layers are experts"),
    (["--capacity-factor", "0"], "--capacity-factor must be"),
    (["--lora-dropout", "1"], "--lora-dropout must be"),
    (["--full", "--quantize", "nf4"], "--quantize must be none with --full"),
    (["--quantize", "int8", "--quantize-group", "32"], "--quantize-group"),
])
def test_bad_flags_are_refused_in_one_line(checkpoint, tmp_path, extra, message):
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(data), "--steps", "20",
                                    "--run-dir", str(tmp_path / "run"), *extra])
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_a_missing_checkpoint_or_a_merge_folder_in_use_is_refused_before_training(checkpoint, tmp_path):
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(tmp_path / "none"), "--data", str(data),
                                    "--run-dir", str(tmp_path / "run")])
    assert done.returncode == 2 and "no such checkpoint folder" in done.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    done = run_main(finetune.main, ["--checkpoint", str(checkpoint), "--data", str(data), "--merge",
                                    str(tmp_path / "busy"), "--run-dir", str(tmp_path / "run")])
    assert done.returncode == 2 and "--merge" in done.stderr and "notes.txt" in done.stderr


@pytest.mark.parametrize("shipped", ["DeepSeek-V3", "Qwen3-Next-80B-A3B-Instruct"], ids=["latent", "hybrid"])
def test_full_fine_tuning_of_the_new_mixers_lowers_the_loss_and_reloads(shipped, tmp_path):
    """Full fine-tuning of a tiny DeepSeek-V3 (latent attention, its experts) and a tiny Qwen3-Next (Gated
    DeltaNet layers beside full attention): the training loss falls over 8 steps, every parameter moves
    (but DeepSeek's correction bias, which only chooses experts: no gradient reaches it, as in DeepSeek's
    training, where a rule of its own updates it), and the folder saved reloads with `load_hf` to the
    same family."""
    save_random_checkpoint(tmp_path / "checkpoint", shipped=shipped)
    data = tmp_path / "new.txt"
    data.write_text(NEW_TEXT)
    done = run_main(finetune.main, ["--checkpoint", str(tmp_path / "checkpoint"), "--data", str(data), "--steps", "8",
                                    "--full", "--lr", "3e-3", "--run-dir", str(tmp_path / "run"),
                                    "--merge", str(tmp_path / "tuned"), *FAST, "--log-every", "1"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [row["loss"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in row]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    before_config, before = load_hf(str(tmp_path / "checkpoint"))
    config, after = load_hf(str(tmp_path / "tuned"))
    assert config == before_config
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after), strict=True):
        moves = "correction_bias" not in jax.tree_util.keystr(path)
        assert x.shape == y.shape and np.array_equal(x, y) != moves, jax.tree_util.keystr(path)
