"""`jaxformer-finetune --method grpo` end to end on a tiny checkpoint and a checkable task made
here (reversing three letters, each answer's share of letters in place its reward): the reward
rises, rollouts repeat from the seed, a resumed run continues bit for bit, the KL penalty and
several updates a batch, the report page, and the refusals. (The objective against its formula:
tests/test_grpo.py; the rewards: tests/test_rewards.py.)"""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import random_params, run_main
from report_page import check_report

from jaxformer import DecoderConfig
from jaxformer.commands import finetune
from jaxformer.convert import save_hf
from jaxformer.text import save_tokenizer
from jaxformer.text.tokenizer import word_tokenizer
from jaxformer.training import read_metrics

REWARD = '''
def reversed_share(prompt, completion, answer):
    """The share of the answer's letters the completion has in their place."""
    got, want = completion.split(), answer.split()
    return sum(g == w for g, w in zip(got, want)) / len(want)
'''
LOGGED = ("loss", "reward", "reward_std", "kl", "clip_ratio", "completion_length")


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """A random 2-layer checkpoint over the words a, b, c, d, = (and BOS/EOS), 60 prompts "x y z ="
    with their reversal as `answer`, and the reward's module `reverse_reward.py`."""
    root = tmp_path_factory.mktemp("grpo")
    tokenizer = word_tokenizer(["a", "b", "c", "d", "=", "<s>", "</s>"], bos_token="<s>", eos_token="</s>",
                               pad_token="</s>")
    config = DecoderConfig(vocab_size=tokenizer.vocab_size, n_layer=2, n_head=4, n_kv_head=2, d_model=32,
                           max_seq_len=32)
    save_hf(config, random_params(config, seed=0, scale=0.1), str(root / "checkpoint"), bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    save_tokenizer(tokenizer, str(root / "checkpoint"))
    rng = np.random.default_rng(0)
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(60):
            letters = list(rng.choice(list("abcd"), 3))
            f.write(json.dumps({"prompt": " ".join(letters) + " =", "answer": " ".join(letters[::-1])}) + "\n")
    (root / "reverse_reward.py").write_text(REWARD)
    return root


@pytest.fixture
def on_path(task, monkeypatch):
    monkeypatch.syspath_prepend(str(task))  # where --reward reverse_reward:reversed_share is imported from
    return task


def grpo(task: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--checkpoint", str(task / "checkpoint"), "--data", str(task / "prompts.jsonl"), "--method", "grpo",
            "--reward", "reverse_reward:reversed_share", "--seq-len", "16", "--max-completion-length", "4",
            "--num-generations", "8", "--warmup", "2", "--run-dir", str(run_dir), *extra]


def test_the_reward_of_the_reversal_rises_over_a_few_hundred_steps(on_path, tmp_path):
    done = run_main(finetune.main, grpo(on_path, tmp_path / "run", "--full", "--steps", "400", "--lr", "3e-3",
                                        "--batch-size", "8", "--warmup", "10", "--log-every", "1",
                                        "--checkpoint-every", "400"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rewards = np.array([m["reward"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")])  # [400]
    # Three letters of four kinds: a guess is right at a quarter of the places; each step's mean over 64 answers.
    first, last = rewards[:50].mean(), rewards[-50:].mean()
    assert first < 0.5 and last > first + 0.2, (first, last)
    results = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert results["eval_reward"] > results["eval_reward_before"]  # the held-out prompts, answered greedily


def test_lora_with_a_kl_penalty_and_two_updates_a_batch_logs_what_grpo_logs(on_path, tmp_path):
    done = run_main(finetune.main, grpo(on_path, tmp_path / "run", "--steps", "4", "--lr", "1e-2", "--beta", "0.04",
                                        "--iterations", "2", "--batch-size", "2", "--lora-rank", "4",
                                        "--log-every", "1", "--checkpoint-every", "2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(set(LOGGED) <= m.keys() for m in metrics)
    # Step 1's first update: the adapters are zero, so the policy is the reference and the sampler.
    assert metrics[0]["completion_length"] <= 4 and metrics[-1]["kl"] > 0
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
    check_report(tmp_path / "run")  # the reward's curves and a held-out completion at each checkpoint
    assert "reward" in json.loads((tmp_path / "run" / "eval.json").read_text())["labels"]["eval_reward"]["label"]


def test_a_resumed_run_repeats_the_uninterrupted_runs_rollouts_and_weights_bit_for_bit(on_path, tmp_path):
    common = grpo(on_path, tmp_path / "a", "--steps", "6", "--lr", "1e-2", "--batch-size", "2", "--lora-rank", "4",
                  "--log-every", "1", "--checkpoint-every", "3", "--lora-dropout", "0.1")
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    assert run_main(finetune.main, common).returncode == 0
    shutil.copytree(straight, interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "6")  # a crash after step 3's checkpoint
    shutil.rmtree(interrupted / "adapter")
    done = run_main(finetune.main, [*common, "--run-dir", str(interrupted), "--resume"])  # (the last --run-dir counts)
    assert done.returncode == 0 and "resuming at step 3 of 6" in done.stdout, done.stdout[-2000:] + done.stderr
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (straight / "adapter" / name).read_bytes() == (interrupted / "adapter" / name).read_bytes()
    a, b = (read_metrics(d / "metrics.jsonl") for d in (straight, interrupted))
    # The same completions sampled (their rewards and lengths) and learned from, step for step.
    assert [{k: m[k] for k in LOGGED} for m in a] == [{k: m[k] for k in LOGGED} for m in b]
    assert len({m["reward"] for m in a}) > 1  # (rewards that vary: a run that sampled nothing would pass too)


def test_the_engine_samples_with_the_weights_it_is_given_and_repeats_from_a_key(on_path):
    from jaxformer.convert import load_hf
    from jaxformer.text import load_tokenizer

    settings = finetune.Settings(checkpoint=str(on_path / "checkpoint"), data=str(on_path / "prompts.jsonl"),
                                 method="grpo", reward="reverse_reward:reversed_share", seq_len=16,
                                 max_completion_length=4, full=True, batch_size=2)
    setup = finetune.build(settings)
    objective = setup.objective
    prompts = objective.data.train[:2]
    keys = jax.random.split(jax.random.key(3), 2)
    first, again = (objective.rollouts(setup.params, prompts, keys)[0] for _ in range(2))
    assert all(np.array_equal(first[name], again[name]) for name in first)
    other = objective.rollouts(setup.params, prompts, jax.random.split(jax.random.key(4), 2))[0]
    assert not np.array_equal(first["tokens"], other["tokens"])
    # Other weights (here: the checkpoint's reversed in sign) sample other completions from the same key.
    _, params = load_hf(str(on_path / "checkpoint"))
    flipped = objective.rollouts(jax.tree.map(lambda x: -x, params), prompts, keys)[0]
    assert not np.array_equal(first["tokens"], flipped["tokens"])
    tokenizer = load_tokenizer(str(on_path / "checkpoint"))
    assert tokenizer.decode(first["tokens"][0][:len(prompts[0].ids)]) == prompts[0].prompt  # each row: its prompt


@pytest.mark.parametrize("extra, message", [
    (["--num-generations", "1"], "--num-generations must be"),
    (["--temperature", "0"], "--temperature must be"),
    (["--max-completion-length", "16"], "--max-completion-length must be an int in [1, --seq-len - 1=15]"),
    (["--beta", "-1"], "--beta must be"),
    (["--reward", "exact", "--reward-pattern", "a"], "--reward-pattern"),
    (["--reward", "no_such_module:f"], "--reward 'no_such_module:f': no module named 'no_such_module'"),
])
def test_bad_flags_are_refused_in_one_line(on_path, tmp_path, extra, message):
    done = run_main(finetune.main, grpo(on_path, tmp_path / "run", "--steps", "4", *extra))
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_grpo_settings_without_grpo_and_prompts_past_the_room_are_refused(on_path, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "a b =", "chosen": "b a", "rejected": "a b"}) + "\n"
                             for _ in range(4)))
    done = run_main(finetune.main, ["--checkpoint", str(on_path / "checkpoint"), "--data", str(pairs), "--method",
                                    "dpo", "--num-generations", "8", "--run-dir", str(tmp_path / "run")])
    assert done.returncode == 2 and "--num-generations must be given only with --method grpo" in done.stderr
    done = run_main(finetune.main, grpo(on_path, tmp_path / "run", "--steps", "4", "--max-completion-length", "14"))
    assert done.returncode == 2 and "prompts.jsonl:1: the prompt is 4 tokens, past --seq-len - " \
                                    "--max-completion-length = 2" in done.stderr, done.stderr
    missing = grpo(on_path, tmp_path / "run", "--steps", "4")
    del missing[missing.index("--reward"):missing.index("--reward") + 2]
    done = run_main(finetune.main, missing)
    assert done.returncode == 2 and "--reward must be given with --method grpo" in done.stderr, done.stderr


def test_a_mixture_of_experts_with_a_capacity_samples_with_every_expert_and_trains(tmp_path):
    """A Qwen3-MoE checkpoint, `--capacity-factor` on: the updates' experts drop what overflows,
    the sampler's and the reference's (the model as read) drop nothing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
    from checkpoints import save_random_checkpoint

    save_random_checkpoint(tmp_path / "checkpoint", experts=True)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"The {w} sat on the"}) + "\n" for w in ("cat", "dog", "sun") * 3))
    done = run_main(finetune.main, ["--checkpoint", str(tmp_path / "checkpoint"), "--data", str(data), "--method",
                                    "grpo", "--reward", "regex", "--reward-pattern", ".*a.*", "--steps", "2",
                                    "--batch-size", "2", "--seq-len", "24", "--max-completion-length", "6",
                                    "--capacity-factor", "1.0", "--beta", "0.04", "--warmup", "1", "--log-every", "1",
                                    "--checkpoint-every", "2", "--run-dir", str(tmp_path / "run")])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    objective = finetune.build(finetune.Settings(
        checkpoint=str(tmp_path / "checkpoint"), data=str(data), method="grpo", reward="exact", seq_len=24,
        max_completion_length=6, capacity_factor=1.0, batch_size=2)).objective
    capacities = {spec.ffn.capacity_factor for spec in objective.model.config.layers}
    sampled = {spec.ffn.capacity_factor for spec in objective.engine.model.model.config.layers}
    assert capacities == {1.0} and sampled == {None}


def test_a_reward_that_fails_ends_the_run_in_one_line_naming_it(on_path, tmp_path, monkeypatch):
    (tmp_path / "strict_reward.py").write_text("def judge(prompt, completion, answer):\n"
                                               "    return {'answer': answer}  # (not a number)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    done = run_main(finetune.main, grpo(on_path, tmp_path / "run", "--steps", "2", "--batch-size", "2",
                                        "--reward", "strict_reward:judge"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "reward strict_reward:judge must return a finite number, got {'answer':" in done.stderr
    assert not (tmp_path / "run").exists()  # (a new run that kept nothing is undone)
