"""lm-evaluation-harness (a peer: the peers extra) run against the server through its
`local-completions` model, and against the same checkpoint through its `hf` backend
(transformers): a multiple-choice task gives the same log-likelihood for every choice of
every item, the same greedy flags and the same accuracy; a generation task the same text.

Both tasks are made here from the tiny model's dialogues (a jsonl and a task YAML in a
temporary folder, read by `TaskManager(include_path=...)`), so nothing is downloaded."""

import json

import pytest
from conftest import import_peer
from server import KEY, NAME, Server
from tiny import CONFIG, COUNT, DIALOGUES, save_folder, trained_params

import_peer("torch")
import_peer("transformers")
lm_eval = import_peer("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402 (after the skip)

pytestmark = [pytest.mark.peers, pytest.mark.full]

TOLERANCE = 1e-4  # float32 log-likelihoods (sums of a few token log-probabilities) of two implementations
UNSEEN = ["What is a cat?", "Why?"]  # questions the model never saw: its choice there is a close call


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
    """The two tasks' jsonl and YAML files in `folder` (YAML written as JSON, which it includes)."""
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
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder / "datasets")},
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


def evaluate(model: str, model_args: dict, tasks_folder) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tiny_mc", "tiny_gen"],
                                   task_manager=TaskManager(include_path=str(tasks_folder)), log_samples=True,
                                   bootstrap_iters=0)


def test_lm_eval_through_the_server_matches_its_hf_backend(folder, server, tmp_path, monkeypatch):
    for variable in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what local-completions sends as its bearer token
    write_tasks(tmp_path)

    # Batches of 8: lists of prompts in one request.
    served = evaluate("local-completions", {
        "model": NAME, "base_url": f"{server.url}/v1/completions", "tokenizer": folder,
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 8, "num_concurrent": 1,
        "max_retries": 1, "max_length": CONFIG.max_seq_len}, tmp_path)
    peer = evaluate("hf", {"pretrained": folder, "dtype": "float32", "device": "cpu", "batch_size": 1}, tmp_path)

    served_mc, peer_mc = (sorted(run["samples"]["tiny_mc"], key=lambda s: s["doc_id"]) for run in (served, peer))
    items = multiple_choice_items()
    assert len(served_mc) == len(peer_mc) == len(items)
    worst = 0.0
    for item, ours, theirs in zip(items, served_mc, peer_mc):
        ours_ll, ours_greedy = zip(*ours["filtered_resps"])
        theirs_ll, theirs_greedy = zip(*theirs["filtered_resps"])
        assert len(ours_ll) == len(item["choices"]), ours
        worst = max(worst, *(abs(a - b) for a, b in zip(ours_ll, theirs_ll)))
        assert ours_ll == pytest.approx(theirs_ll, abs=TOLERANCE, rel=0), item
        assert ours_greedy == theirs_greedy, item
        assert ours["acc"] == theirs["acc"], item
    accuracy = served["results"]["tiny_mc"]["acc,none"]
    print(f"\nlog-likelihoods: largest difference {worst:.2e} over {sum(len(i['choices']) for i in items)}; "
          f"accuracy {accuracy} (server) and {peer['results']['tiny_mc']['acc,none']} (hf)")
    assert accuracy == peer["results"]["tiny_mc"]["acc,none"]
    assert accuracy > 0.75  # the 12 cut dialogues learned by heart, far above chance (1/4)

    served_gen, peer_gen = ([s["filtered_resps"][0] for s in sorted(run["samples"]["tiny_gen"],
                                                                     key=lambda s: s["doc_id"])]
                            for run in (served, peer))
    print("generations:", served_gen)
    assert served_gen == peer_gen
    assert served_gen[:4] == [answer.split(".")[0] for _, answer in DIALOGUES]  # learned by heart, cut at "."
