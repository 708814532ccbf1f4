"""`python -m benchmarks.grpo_rollouts` on a tiny random checkpoint (no timing asserted): the
completions sampled all at once and one at a time are the same (each request's draws are its key's),
every timed call is recorded, and the lines are printed and the JSON holds every figure."""

import json

import pytest
from conftest import import_peer

from benchmarks import finetune, grpo_rollouts, llama_1b

pytestmark = pytest.mark.peers  # transformers writes the checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama-shaped checkpoint (2 layers of 128, 512 ids) with a byte-level BPE tokenizer."""
    import_peer("transformers")
    torch = import_peer("torch")
    path = str(tmp_path_factory.mktemp("grpo") / "checkpoint")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        finetune.make_checkpoint(path, d_model=128, layers=2, vocab=512, seq_len=64)
    llama_1b.write_tokenizer(path, llama_1b.tokenizer())  # (ids below 400: inside the 512)
    return path


def test_a_tiny_run_samples_the_same_completions_both_ways(checkpoint, tmp_path, capsys):
    out = tmp_path / "grpo.json"
    grpo_rollouts.main([checkpoint, "--prompts", "2", "--num-generations", "3", "--max-new", "8", "--repeats", "2",
                        "--out", str(out)])
    results = json.loads(out.read_text())
    assert set(results) == {"machine", "settings", "sampling", "steps", "ratios"}
    sampled, steps = results["sampling"], results["steps"]
    assert sampled["completions"] == 6 and sampled["same_completions"] == 6
    assert 0 < sampled["all_at_once_tokens"] == sampled["one_at_a_time_tokens"] <= 6 * 8
    assert len(sampled["all_at_once_s"]) == 2 and len(sampled["one_at_a_time_s"]) == 6
    assert len(steps["rollouts_s"]) == len(steps["step_s"]) == 2
    # The rollouts timed alone sample what their step then samples: the same weights and keys.
    assert all(alone == in_step for alone, in_step in steps["completion_lengths"])
    assert set(results["ratios"]) == {"all_at_once_completions_per_s", "one_at_a_time_completions_per_s",
                                      "rollouts_share_of_step", "all_at_once_over_one_at_a_time"}
    printed = capsys.readouterr().out
    assert " cores; jax " in printed and "all at once (Engine.submit_all): " in printed
    assert "one at a time (the same engine, each request finished before the next): " in printed
    assert "the same completions: 6 of 6" in printed and "GRPO step: " in printed


def test_prompts_file_leaves_the_asked_prompts_to_train_on(checkpoint, tmp_path):
    from jaxformer.text import load_tokenizer
    from jaxformer.text.prompts import PromptData

    for prompts in (1, 4, 9, 10, 30):
        data = PromptData(grpo_rollouts.prompts_file(str(tmp_path), prompts), load_tokenizer(checkpoint),
                          grpo_rollouts.PROMPT_ROOM, "the room")
        assert len(data.train) == prompts, prompts
