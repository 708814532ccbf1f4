"""`benchmarks.serve`'s parts, without a jaxformer server: the checkpoint folder it writes,
the workload's prompt lengths, the figures from known timestamps, the parsing of a stream,
a server started and stopped, and the ratios. No timing is asserted."""

import importlib.util
import sys
from types import SimpleNamespace

import pytest

from benchmarks import serve

TINY = ["--vocab-size", "300", "--words", "60", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--max-seq-len", "64", "--prompt-lengths", "3", "9", "20", "--new-tokens", "4", "8",
        "--clients", "1", "2", "--requests", "6"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("serve-bench-model"))
    return folder, *serve.make_checkpoint(folder, serve.parse_args(TINY))


def test_the_checkpoint_is_a_hugging_face_folder(checkpoint):
    folder, tokenizer, words, model = checkpoint
    assert model["vocab_size"] == tokenizer.vocab_size <= 300 and model["d_model"] == 32 and model["params"] > 0
    assert len(words) == len(set(words)) == 60
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return
    import transformers
    loaded = transformers.AutoTokenizer.from_pretrained(folder)  # as `transformers serve` loads it
    assert loaded(" " + " ".join(words[:5]))["input_ids"] == tokenizer.encode(" " + " ".join(words[:5]))
    assert transformers.AutoModelForCausalLM.from_pretrained(folder).config.vocab_size == tokenizer.vocab_size


def test_prompts_have_the_token_lengths_drawn(checkpoint):
    _, tokenizer, words, _ = checkpoint
    workload = serve.make_workload(tokenizer, words, 40, [3, 9, 20], [4, 8], seed=0)
    lengths = [len(tokenizer.encode(prompt)) for prompt, _ in workload]
    assert set(lengths) == {3, 9, 20}  # each of them drawn, and every prompt exactly one of them
    assert {new for _, new in workload} == {4, 8}
    assert workload == serve.make_workload(tokenizer, words, 40, [3, 9, 20], [4, 8], seed=0)
    assert workload != serve.make_workload(tokenizer, words, 40, [3, 9, 20], [4, 8], seed=1)


def test_percentiles_and_figures_from_known_timestamps():
    assert serve.percentiles([0.0, 10.0, 20.0, 30.0]) == pytest.approx({"p50": 15.0, "p95": 28.5})  # linear
    assert serve.percentiles([]) == {"p50": None, "p95": None}
    # Two requests over 2 s: sent at 0 and 1, text chunks after them; one chunk carried two tokens.
    timings = [serve.Timing(sent=0.0, chunks=[0.1, 0.3, 0.4], prompt_tokens=5, completion_tokens=4),
               serve.Timing(sent=1.0, chunks=[1.3, 1.4], prompt_tokens=7, completion_tokens=2)]
    assert timings[0].ttft == pytest.approx(0.1) and timings[0].gaps == pytest.approx([0.2, 0.1])
    row = serve.summarise(timings, wall_s=2.0)
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"], row["chunks"]) == (2, 12, 6, 5)
    assert row["tokens_per_s"] == 3.0
    assert row["ttft_ms"] == pytest.approx({"p50": 200.0, "p95": 290.0})  # of 100 and 300 ms
    assert row["itl_ms"] == pytest.approx({"p50": 100.0, "p95": 190.0})  # of 200, 100, 100 ms


def _client(chunks):
    """An `openai.OpenAI` stand-in whose streams yield `chunks`."""
    create = lambda **kwargs: iter(chunks)  # noqa: E731
    return SimpleNamespace(completions=SimpleNamespace(create=create),
                           chat=SimpleNamespace(completions=SimpleNamespace(create=create)))


def test_a_stream_counts_text_chunks_and_usage():
    def chunk(text=None, usage=None, choices=True):
        choice = SimpleNamespace(text=text, delta=SimpleNamespace(content=text))
        return SimpleNamespace(choices=[choice] if choices else [], usage=usage)

    usage = SimpleNamespace(prompt_tokens=9, completion_tokens=5)
    for endpoint in ("completions", "chat"):
        # (An empty chunk, a held-back byte, a chunk of text, a usage chunk with no choices.)
        chunks = [chunk(""), chunk("ab"), chunk(None), chunk("c"), chunk(usage=usage, choices=False)]
        timing = serve.stream_request(_client(chunks), "m", endpoint, "a prompt", 5)
        assert len(timing.chunks) == 2 and timing.chunks[0] >= timing.sent
        assert (timing.prompt_tokens, timing.completion_tokens) == (9, 5)
    with pytest.raises(RuntimeError, match="usage"):
        serve.stream_request(_client([chunk("ab")]), "m", "completions", "a prompt", 5)
    row = serve.run_load(_client([chunk("ab"), chunk(usage=usage)]), "m", "completions", [("p", 5)] * 3, 2)
    assert (row["requests"], row["completion_tokens"], row["chunks"], row["other_cpu_pct"]) == (3, 15, 3, None)


HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_server_is_waited_for_and_stopped(tmp_path):
    port = serve.free_port()
    command = [sys.executable, "-c", HEALTHY, str(port)]
    with serve.running(command, port, tmp_path / "ok.log", 60) as (process, startup_s):
        assert startup_s > 0 and process.poll() is None
        if sys.platform == "linux":  # (the machine's CPU time, and the server's and this process's)
            busy, ours = serve.cpu_seconds(process.pid)
            assert busy >= ours > 0
    assert process.poll() is not None  # stopped
    # (A server that exits is reported at once, not waited for until the timeout.)
    with pytest.raises(RuntimeError, match="exited with 3"):
        with serve.running([sys.executable, "-c", "raise SystemExit(3)"], port, tmp_path / "exit.log", 60):
            pass


def test_commands_follow_the_contract():
    args = serve.parse_args(TINY + ["--prefill-chunk", "16"])
    command = serve.jaxformer_command("/ckpt", 8001, 1, args)
    assert command[1:3] == ["-m", "jaxformer.commands.serve"]
    assert " ".join(command[3:]) == ("--checkpoint /ckpt --port 8001 --host 127.0.0.1 --max-batch 1 "
                                     "--max-seq-len 64 --prefill-chunk 16")
    command = serve.transformers_command("/ckpt", 8002)
    assert command[1:3] == ["serve", "--continuous-batching"] and command[-1] == "/ckpt"
    with pytest.raises(SystemExit):
        serve.parse_args(TINY + ["--requests", "1"])  # fewer requests than clients
    with pytest.raises(SystemExit):
        serve.parse_args(TINY + ["--new-tokens", "60"])  # past --max-seq-len
    with pytest.raises(SystemExit):
        serve.parse_args(TINY + ["--shared-prefix", "40"])  # the shared prefix too
    shared = serve.jaxformer_command("/ckpt", 8003, 16, args, "--prefix-cache-mb", "0")
    assert shared[-4:-2] == ["--prefix-cache-mb", "0"]


def test_ratios_of_the_run():
    def row(server, clients, tokens_per_s, ttft_p50):
        return {"server": server, "clients": clients, "tokens_per_s": tokens_per_s,
                "ttft_ms": {"p50": ttft_p50, "p95": None}}

    rows = [row(serve.ENGINE, 1, 100.0, 20.0), row(serve.ENGINE, 16, 800.0, 50.0),
            row(serve.ONE_AT_A_TIME, 16, 100.0, 900.0), row(serve.TRANSFORMERS, 16, 400.0, 60.0)]
    assert serve.ratios(rows, 16) == {"clients": 16, "engine_vs_one_at_a_time": 8.0,
                                      "engine_vs_transformers": 2.0, "engine_ttft_most_vs_one_client": 2.5,
                                      "prefix_cache_throughput": None, "prefix_cache_ttft": None}
    cached = serve.ratios(rows + [row(serve.NO_PREFIX_CACHE, 16, 500.0, 150.0)], 16)
    assert (cached["prefix_cache_throughput"], cached["prefix_cache_ttft"]) == (1.6, 3.0)
    missing = serve.ratios(rows[:2], 16)  # transformers serve skipped: no ratio to it
    assert missing["engine_vs_transformers"] is None and missing["engine_vs_one_at_a_time"] is None


def test_without_the_transformers_cli_says_why(monkeypatch):
    monkeypatch.setattr(serve.shutil, "which", lambda name: None)
    assert "no `transformers` command" in serve.transformers_serve_problem()
