"""lm-evaluation-harness (a peer: the peers extra) run against the server through its
`local-completions` model, and against the same checkpoint through its `hf` backend
(transformers): a multiple-choice task gives the same log-likelihood for every choice of
every item, the same greedy flags and the same accuracy; a generation task the same text.

Both tasks are made here from the tiny model's dialogues (a jsonl and a task YAML in a
temporary folder, read by `TaskManager(include_path=...)`), so nothing is downloaded. lm-eval
runs in a process of its own, offline from its start (the Hugging Face libraries read their
*_OFFLINE variables as they are imported) and with its global seeds and logging kept there."""

import json
import os
import subprocess
import sys

import pytest
from conftest import import_peer
from server import KEY, NAME, Server
from tiny import CONFIG, COUNT, DIALOGUES, save_folder, trained_params

import_peer("torch")
import_peer("transformers")
import_peer("lm_eval")  # (a cheap import: its tasks, models, datasets are loaded in the subprocess)

pytestmark = pytest.mark.peers

TOLERANCE = 1e-4  # float32 log-likelihoods (sums of a few token log-probabilities) of two implementations
UNSEEN = ["What is a cat?", "Why?"]  # questions the model never saw: no answer is right, it picks one


def turn(question: str) -> str:
    return f"<|user|>{question}\n<|assistant|>"


def multiple_choice_items() -> list[dict]:
    """Each dialogue cut at three places: which of the four answers' next words follows? And
    the unseen questions: which answer does the model find likelier (label 0, by fiat)?"""
    answers = [answer.split(" ") for _, answer in DIALOGUES]
    items = []
    for i, (question, _) in enumerate(DIALOGUES):
        for start in (0, 3, 6):
            context = turn(question) + " ".join(answers[i][:start])
            choices = [(" " if start else "") + " ".join(words[start:start + 3]) for words in answers]
            items.append({"context": context, "choices": choices, "label": i})
    for question in UNSEEN:
        items.append({"context": turn(question), "choices": [" ".join(words[:4]) for words in answers], "label": 0})
    return items


def generation_items() -> list[dict]:
    """Greedy continuations cut at the first "." or after 48 tokens: the dialogues' first
    sentences, one from the middle of an answer, the count (always 48 tokens) and the unseen."""
    count_prompt = COUNT.split("<|assistant|>")[0] + "<|assistant|>"
    prompts = ([turn(question) for question, _ in DIALOGUES] + [turn(DIALOGUES[3][0]) + "Hello! The cat"]
               + [count_prompt] + [turn(question) for question in UNSEEN])
    return [{"prompt": prompt, "answer": ""} for prompt in prompts]


def write_tasks(folder) -> None:
    """The two tasks' jsonl and YAML files in `folder`, made (YAML written as JSON, which it includes)."""
    folder.mkdir()
    tasks = {
        "tiny_mc": (multiple_choice_items(), {
            "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
            "doc_to_target": "label", "target_delimiter": "",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}),
        "tiny_gen": (generation_items(), {
            "output_type": "generate_until", "doc_to_text": "prompt", "doc_to_target": "answer",
            "generation_kwargs": {"until": ["."], "max_gen_toks": 48, "do_sample": False, "temperature": 0.0},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}),
    }
    for name, (items, config) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(item) + "\n" for item in items))
        (folder / f"{name}.yaml").write_text(json.dumps({
            "task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", **config}, indent=1))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder(trained_params(), str(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """The server as users start it (its prefix cache on), with a batch of 4 rows."""
    server = Server(folder, str(tmp_path_factory.mktemp("log") / "server.log"), "--max-batch", "4",
                    "--max-seq-len", str(CONFIG.max_seq_len), "--log-level", "warning")
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()


# `python -c RUNNER MODEL MODEL_ARGS TASKS_FOLDER OUT`: the two tasks evaluated by lm-eval's
# MODEL backend; each item's responses (after its filters) and scores written to OUT as JSON.
RUNNER = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
model, model_args, folder, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
run = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_gen"],
                              task_manager=TaskManager(include_path=folder), log_samples=True, bootstrap_iters=0)
samples = {task: sorted(({"doc_id": s["doc_id"], "filtered_resps": s["filtered_resps"], "acc": s.get("acc")}
                         for s in items), key=lambda s: s["doc_id"]) for task, items in run["samples"].items()}
with open(out, "w") as f:
    json.dump({"results": run["results"], "samples": samples}, f, default=lambda x: x.item())
"""


def evaluate(model: str, model_args: dict, path) -> dict:
    """`simple_evaluate`'s results and samples of the two tasks of `path`/tasks with lm-eval's
    `model` backend."""
    out = path / f"{model}.json"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(path / "hf-home"),  # (the datasets' cache too): none of the user's read or written
           "OPENAI_API_KEY": KEY}  # what local-completions sends as its bearer token
    done = subprocess.run([sys.executable, "-c", RUNNER, model, json.dumps(model_args), str(path / "tasks"), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-10000:]
    with open(out) as f:
        return json.load(f)


def test_lm_eval_through_the_server_matches_its_hf_backend(folder, server, tmp_path):
    write_tasks(tmp_path / "tasks")

    # Batches of 8: lists of prompts in one request.
    served = evaluate("local-completions", {
        "model": NAME, "base_url": f"{server.url}/v1/completions", "tokenizer": folder,
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 8, "num_concurrent": 1,
        "max_retries": 1, "max_length": CONFIG.max_seq_len}, tmp_path)
    peer = evaluate("hf", {"pretrained": folder, "dtype": "float32", "device": "cpu", "batch_size": 1}, tmp_path)

    served_mc, peer_mc = served["samples"]["tiny_mc"], peer["samples"]["tiny_mc"]
    items = multiple_choice_items()
    assert len(served_mc) == len(peer_mc) == len(items)
    worst, greedy = 0.0, 0
    for item, ours, theirs in zip(items, served_mc, peer_mc):
        ours_ll, ours_greedy = zip(*ours["filtered_resps"])
        theirs_ll, theirs_greedy = zip(*theirs["filtered_resps"])
        assert len(ours_ll) == len(item["choices"]), ours
        worst = max(worst, *(abs(a - b) for a, b in zip(ours_ll, theirs_ll)))
        assert ours_ll == pytest.approx(theirs_ll, abs=TOLERANCE, rel=0), item
        assert ours_greedy == theirs_greedy, item
        greedy += sum(ours_greedy)
        assert ours["acc"] == theirs["acc"], item
    accuracy = served["results"]["tiny_mc"]["acc,none"]
    print(f"\nlog-likelihoods: largest difference {worst:.2e} over {sum(len(i['choices']) for i in items)} "
          f"choices ({greedy} greedy); accuracy {accuracy} (server) and {peer['results']['tiny_mc']['acc,none']} (hf)")
    assert accuracy == peer["results"]["tiny_mc"]["acc,none"]
    assert accuracy > 0.75  # the 12 cut dialogues learned by heart, far above chance (1/4)

    served_gen, peer_gen = ([sample["filtered_resps"][0] for sample in run["samples"]["tiny_gen"]]
                            for run in (served, peer))
    print("generations:", served_gen)
    assert served_gen == peer_gen
    assert served_gen[:4] == [answer.split(".")[0] for _, answer in DIALOGUES]  # learned by heart, cut at "."
