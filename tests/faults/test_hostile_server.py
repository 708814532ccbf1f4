"""Hostile clients of `jaxformer-serve`, the real server on a free loopback port:
a client's mistake gets an OpenAI-shaped 4xx and never a 500, nothing a client sends puts a
traceback in the log, one request cannot hold up the others, and a stop keeps its promise.

Sections (each a table or a test a new endpoint or field extends):
  Bodies: `BAD_BODIES`, each refused with its 4xx and a message naming the field, the
    server going on: JSON nested past the parser, token ids outside the vocabulary in any
    position, values that only fit as huge reprs (the message quotes them cut short).
  Connections: a client that announces a longer body and closes; 200 connections that
    send headers and never a body (each gets a 408 once `--body-timeout` passes).
  Stop strings: four of 250,000 characters, one matching the text all along; the answer is
    the text, and the server answers /health meanwhile (how fast: benchmarks/serve.py).
  Sampling knobs at the edge of float32: a top_p or temperature float32 rounds to 0.
  Starting: a busy port is found before the model loads; a long compile says what it does.
  Stopping: a second SIGINT or SIGTERM during the graceful stop ends every running request
    at once, each stream with a last error event and the others with a 503, exit status
    130 or 0, no traceback.

The model is the serving tests' tiny chat model at random weights (its text is not under
test here; `tests/serving/test_app.py` checks answers), and a wider one whose requests run
long enough to be stopped.
"""

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import init_params

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from server import KEY, NAME, Server  # noqa: E402
from tiny import CONFIG, SLOW, save_folder  # noqa: E402

from jaxformer.commands.serve import PROG  # noqa: E402

VOCAB = CONFIG.vocab_size
BODY_TIMEOUT_S = 1
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return save_folder(init_params(CONFIG), str(tmp_path_factory.mktemp("tiny-random")))


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """Logging at uvicorn's info level: every request has a line, and none may be a traceback."""
    server = Server(folder, str(tmp_path_factory.mktemp("log") / "server.log"), "--max-batch", "4",
                    "--max-seq-len", str(CONFIG.max_seq_len), "--body-timeout", str(BODY_TIMEOUT_S))
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log() and " 500 " not in server.log(), server.log()


def completion(**fields) -> dict:
    return {"model": NAME, "prompt": "The cat", "max_tokens": 4, **fields}


# Each: (id, the body: bytes, or JSON as a dict, the status, what the message holds).
BAD_BODIES = [
    ("arrays-nested-100000-deep", b"[" * 100_000 + b"]" * 100_000, 400,
     "the request body is not valid JSON here: it nests deeper than this server parses"),
    ("objects-nested-100000-deep", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400, "nests deeper"),
    ("prompt-id-minus-one-last", completion(prompt=[5, 6, -1]), 400,
     f"prompt holds token id -1, outside the model's vocabulary [0, {VOCAB})"),
    ("prompt-id-10**30-last", completion(prompt=[5, 10**30]), 400,
     f"prompt holds token id 1000000000000000000000000000000, outside the model's vocabulary [0, {VOCAB})"),
    ("prompt-id-minus-one-first", completion(prompt=[-1, 5, 6]), 400, "prompt holds token id -1"),
    ("prompt-id-the-vocabulary-size", completion(prompt=[5, VOCAB]), 400, f"prompt holds token id {VOCAB},"),
    ("prompt-ids-of-floats", completion(prompt=[5.5]), 400,
     "prompt must be a string, a list of token ids, or a list of those (got 5.5 at prompt)"),
    ("an-integer-of-5000-digits", b'{"model": "%s", "prompt": "x", "max_tokens": %s}' % (NAME.encode(), b"9" * 5000),
     400, "the request body is not valid JSON"),
    ("temperature-a-long-string", completion(temperature="hot" * 100_000), 400,
     "temperature must be a number in [0, 2] (got 'hothot"),  # (cut short: the message is under 300 characters)
    ("temperature-nan", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % NAME.encode(), 400,
     "temperature must be a number in [0, 2] (got nan)"),
    ("max_tokens-10**30", completion(max_tokens=10**30), 400, "past the server's max_seq_len"),
    ("stop-a-deep-list", completion(stop=[[["x"]]]), 400, "stop must be a non-empty string or a list of up to 4"),
    ("model-a-long-list", completion(model=list(range(100_000))), 400, "model must be a string"),
    ("content-null", {"model": NAME, "messages": [{"role": "user", "content": None}]}, 400,
     "messages[0].content must be a string or a list of text parts"),
    ("body-not-utf-8", b'{"model": "\xff"}', 400, "the request body is not valid JSON"),
]


@pytest.mark.parametrize("body, status, message", [case[1:] for case in BAD_BODIES],
                         ids=[case[0] for case in BAD_BODIES])
def test_a_bad_body_gets_an_openai_shaped_4xx_never_a_500(server, body, status, message):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = server.post(path, **kwargs)
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert message in error["message"] and len(error["message"]) < 300, error["message"][:500]
    assert server.post("/v1/completions", json=completion()).status_code == 200  # and the server goes on


def test_a_client_that_closes_before_its_announced_body_ends_leaves_no_trace(server):
    """(The module's teardown reads the log: no traceback.)"""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    assert server.post("/v1/completions", json=completion()).status_code == 200


def test_connections_that_never_send_their_body_get_408_and_the_server_answers_meanwhile(server):
    """200 connections send their headers and stop; each gets a 408 once --body-timeout has
    passed, and /health and a real request are answered while they wait."""
    sockets = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    try:
        for s in sockets:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Length: 100\r\n\r\n")
        assert server.health()["status"] == "ok"
        assert server.post("/v1/completions", json=completion()).status_code == 200
        for s in sockets:
            s.settimeout(BODY_TIMEOUT_S + 30)
            assert s.recv(1 << 16).startswith(b"HTTP/1.1 408 "), "a connection without its body got no 408"
    finally:
        for s in sockets:
            s.close()


def test_stop_strings_of_250000_characters_answer_the_text_while_health_answers(server):
    """Four stop strings under the 1 MiB body limit, one of them the text itself and then
    more, so that the whole text is held back as a possible start of it to the last token:
    the answer is the text the same request gives without them."""
    body = completion(prompt="The cat sat", max_tokens=24, temperature=0)
    plain = server.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stops = [plain + "~" * 250_000, "ab" * 125_000, "~" * 250_000, "The cat " * 31_250]
    assert len(json.dumps({**body, "stop": stops})) < 1 << 20
    answers, healths = [], []
    thread = threading.Thread(target=lambda: answers.append(server.post("/v1/completions", json={**body,
                                                                                                 "stop": stops})))
    thread.start()
    while thread.is_alive():
        healths.append(server.health()["status"])  # (each within the client's 10 s; the figures: benchmarks/serve.py)
    thread.join()
    assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == plain
    assert healths and set(healths) == {"ok"}


@pytest.mark.parametrize("knob", [{"top_p": 1e-300}, {"temperature": 1e-40}, {"temperature": 2e-38}],
                         ids=["top_p-1e-300", "temperature-1e-40", "temperature-2e-38"])
def test_a_knob_that_float32_rounds_to_zero_samples_as_its_limit_the_likeliest_token(server, knob):
    """top_p below float32's smallest number keeps the likeliest token alone, as any p that
    small does; a temperature near 0 is greedy, even where logits / T passes float32's range."""
    body = completion(prompt="The cat sat on", max_tokens=12, seed=3)
    greedy = server.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    answer = server.post("/v1/completions", json={"temperature": 1.0, **body, **knob})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == greedy


def test_the_compile_says_what_it_does_before_the_server_is_ready(server):
    log = server.log()
    ready = log.index(f"{PROG}: {NAME} ready in")
    assert log.index(f"{PROG}: {NAME} loaded in") < log.index(f"{PROG}: compiled 1 of ") < ready


def test_a_busy_port_is_refused_before_the_model_loads(server, folder):
    done = subprocess.run([sys.executable, "-m", "jaxformer.commands.serve", "--checkpoint", folder, "--port",
                           str(server.port)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"{PROG}: error: --host 127.0.0.1 --port {server.port}: cannot listen there: Address already in use"]


@pytest.fixture(scope="module")
def slow_folder(tmp_path_factory) -> str:
    return save_folder(init_params(SLOW), str(tmp_path_factory.mktemp("slow")), SLOW)


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_a_second_signal_ends_every_running_request_with_a_last_event_and_no_traceback(slow_folder, tmp_path, sig,
                                                                                       status):
    server = Server(slow_folder, str(tmp_path / "server.log"), "--max-batch", "8", "--max-seq-len", "448")
    body = {"model": NAME, "prompt": "The cat", "max_tokens": 400, "temperature": 0}

    def run(i: int):
        if i % 2:  # half stream, half do not
            return httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=120) as response:
            return [line for line in response.iter_lines() if line]

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(run, i) for i in range(8)]
            deadline = time.monotonic() + 60
            while server.health()["running"] < 8:
                assert time.monotonic() < deadline, server.health()
            server.process.send_signal(sig)
            while "Waiting for connections to close" not in server.log():  # the first one is under way
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.01)
            server.process.send_signal(sig)
            answers = [answer.result(timeout=120) for answer in answers]
    finally:
        exit_status = server.stop()
    why = f"the server is stopping at once ({sig.name} during its graceful stop): this request was cut short"
    for i, answer in enumerate(answers):
        if i % 2:
            assert answer.status_code == 503 and answer.json()["error"] == {
                "message": why, "type": "server_error", "param": None, "code": None}, answer.text
        else:
            last = json.loads(answer[-1].removeprefix("data: "))
            assert last == {"error": {"message": why, "type": "server_error", "param": None, "code": None}}, answer
    log = server.log()
    assert exit_status == status, log
    assert f"{PROG}: {sig.name} again: ended the 8 running request(s) at once, each with a last error event" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
