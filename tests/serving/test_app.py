"""The server, started for real (`jaxformer-serve` on a free loopback port) on a tiny
model trained here, and talked to with the official `openai` client (raw HTTP where a client
would not send such a request)."""

import concurrent.futures
import json
import signal
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai  # (the test extra: the server's tests talk to it with the official client)
import pytest
from conftest import init_params
from server import KEY, NAME, Server
from tiny import CONFIG, COUNT, DIALOGUES, SLOW, TOKENIZER, save_folder, trained_params

from jaxformer import Decoder, generate
from jaxformer.text import completion_text, render_chat

COUNT_PROMPT = COUNT.split("<|assistant|>")[0] + "<|assistant|>"  # a request that runs to its max_tokens
QUESTIONS = [q for q, _ in DIALOGUES]
# Completion prompts of many lengths: whole turns, cut ones, a bare word.
PROMPTS = ([f"<|user|>{q}\n<|assistant|>" for q in QUESTIONS] + ["<|user|>What", "Keys", "<|user|>Why cache",
           f"<|user|>{QUESTIONS[3]}\n<|assistant|>Hello! The cat"])


@pytest.fixture(scope="module")
def params():
    return trained_params()


@pytest.fixture(scope="module")
def folder(params, tmp_path_factory):
    return save_folder(params, str(tmp_path_factory.mktemp("tiny-chat")))


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """16 rows, prefill chunks of 8: 16 requests decode at once, long prompts over several steps."""
    server = Server(folder, str(tmp_path_factory.mktemp("log") / "server.log"), "--max-batch", "16",
                    "--prefill-chunk", "8", "--max-queue", "64", "--max-seq-len", str(CONFIG.max_seq_len),
                    "--log-level", "warning")
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()  # no client's error, of all the tests', was logged as a crash


def expected(params, prompt_ids: list[int], max_tokens: int) -> tuple[str, str]:
    """`(text, finish_reason)` of greedy `generate` on the prompt alone, cut at its EOS."""
    new = _greedy_alone(params, tuple(prompt_ids))[:max_tokens]  # greedy: the first tokens of the longest run
    stops = [i for i, token in enumerate(new) if token in TOKENIZER.stop_ids]
    return completion_text(TOKENIZER, prompt_ids, new[:stops[0]] if stops else new), "stop" if stops else "length"


_RUNS = {}


def _greedy_alone(params, prompt_ids: tuple[int, ...]) -> list[int]:
    """The prompt's greedy continuation to the end of the context (one compile a prompt length)."""
    if prompt_ids not in _RUNS:
        out = generate(Decoder(CONFIG), params, jnp.asarray([prompt_ids]),
                       max_new_tokens=CONFIG.max_seq_len - len(prompt_ids), eos_id=list(TOKENIZER.stop_ids))
        _RUNS[prompt_ids] = np.asarray(out)[0, len(prompt_ids):].tolist()
    return _RUNS[prompt_ids]


def streamed(stream) -> tuple[str, str, object]:
    """`(text, finish_reason, usage)` of a streamed completion or chat."""
    text, finish_reason, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append(choice.text if hasattr(choice, "text") else (choice.delta.content or ""))
            finish_reason = choice.finish_reason or finish_reason
    return "".join(text), finish_reason, usage


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == [NAME]
    assert server.client().models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError) as missing:
        server.client().models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found"
    assert server.health()["status"] == "ok"


def test_metrics_count_a_request_its_tokens_and_its_latencies(server):
    from test_server_metrics import samples

    def scrape() -> dict:
        page = httpx.get(server.url + "/metrics", timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
        return samples(page.text)

    before = scrape()
    answer = server.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    after = scrape()
    grew = {key: after[key] - before.get(key, 0) for key in after}
    assert grew[("jaxformer_requests_total", (("route", "/v1/completions"), ("status", "200")))] == 1
    assert grew[("jaxformer_requests_total", (("route", "/metrics"), ("status", "200")))] == 1  # the first scrape
    assert grew[("jaxformer_prompt_tokens_total", ())] == answer.usage.prompt_tokens
    assert grew[("jaxformer_completion_tokens_total", ())] == answer.usage.completion_tokens
    shown = answer.usage.completion_tokens - (answer.choices[0].finish_reason == "stop")  # an EOS is not a token event
    assert grew[("jaxformer_time_to_first_token_seconds_count", ())] == 1
    assert grew[("jaxformer_time_per_output_token_seconds_count", ())] == shown - 1
    assert after[("jaxformer_running_requests", ())] == 0 and after[("jaxformer_waiting_requests", ())] == 0


def test_a_conversations_earlier_turns_come_from_the_prefix_cache(server, params):
    """The second turn copies the first's prompt: the same greedy answer, fewer tokens prefilled
    (/metrics), the copied ones in usage.prompt_tokens_details.cached_tokens."""
    from test_server_metrics import samples

    def scrape() -> dict:
        return samples(httpx.get(server.url + "/metrics", timeout=10).text)

    client = server.client()
    first = [{"role": "user", "content": QUESTIONS[2]}]
    one = client.chat.completions.create(model=NAME, messages=first, max_completion_tokens=30, temperature=0)
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": QUESTIONS[0]}]
    before = scrape()
    two = client.chat.completions.create(model=NAME, messages=second, max_completion_tokens=20, temperature=0)
    grew = {key: value - before.get(key, 0) for key, value in scrape().items()}
    prompt_ids = TOKENIZER.encode(render_chat(TOKENIZER, second), add_special_tokens=False)
    assert (two.choices[0].message.content, two.choices[0].finish_reason) == expected(params, prompt_ids, 20)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens  # (and more, where the answer's tokens begin the second turn too)
    assert grew[("jaxformer_prefix_cache_hits_total", ())] == 1
    assert grew[("jaxformer_prefix_cache_cached_tokens_total", ())] == cached
    assert grew[("jaxformer_prefill_tokens_total", ())] == len(prompt_ids) - cached


def test_tokenize_and_detokenize_round_trip_a_prompt(server):
    tokens = server.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokens["tokens"] == TOKENIZER.encode(PROMPTS[0]) and tokens["count"] == len(tokens["tokens"])
    text = server.post("/detokenize", json={"tokens": TOKENIZER.encode(PROMPTS[0], add_special_tokens=False)})
    assert text.json() == {"prompt": PROMPTS[0]}
    refused = server.post("/detokenize", json={"tokens": [-1]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tokens"
    assert server.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_sixteen_concurrent_greedy_requests_each_get_generate_alone(server, params):
    client = server.client()
    ids = [TOKENIZER.encode(p) for p in PROMPTS] * 2  # 16 at once, 7 prompt lengths, 5 max_tokens
    max_tokens = [10 + 7 * (i % 5) for i in range(len(ids))]
    start = threading.Barrier(len(ids))

    def ask(i: int):
        start.wait()
        r = client.completions.create(model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens[i],
                                      temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage

    with concurrent.futures.ThreadPoolExecutor(len(ids)) as pool:
        answers = list(pool.map(ask, range(len(ids))))
    for row, n, (text, finish_reason, usage) in zip(ids, max_tokens, answers):
        assert (text, finish_reason) == expected(params, row, n)
        assert usage.prompt_tokens == len(row)
    assert {a[1] for a in answers} == {"stop", "length"}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_text_joined_is_the_text_not_streamed(server, params, chat):
    client = server.client()
    question = QUESTIONS[0]
    if chat:
        messages = [{"role": "user", "content": question}]
        whole = client.chat.completions.create(model=NAME, messages=messages, temperature=0)
        text, finish_reason = whole.choices[0].message.content, whole.choices[0].finish_reason
        stream = client.chat.completions.create(model=NAME, messages=messages, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        prompt_ids = TOKENIZER.encode(render_chat(TOKENIZER, messages), add_special_tokens=False)
        want = expected(params, prompt_ids, CONFIG.max_seq_len - len(prompt_ids))  # a chat's default max_tokens
    else:
        prompt = f"<|user|>{question}\n<|assistant|>"
        whole = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=60)
        text, finish_reason = whole.choices[0].text, whole.choices[0].finish_reason
        stream = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=60, stream=True,
                                           stream_options={"include_usage": True})
        want = expected(params, TOKENIZER.encode(prompt), 60)
    assert (text, finish_reason) == want == (DIALOGUES[0][1], "stop")
    assert streamed(stream) == (text, finish_reason, whole.usage)
    assert whole.usage.completion_tokens == len(TOKENIZER.encode(text, add_special_tokens=False)) + 1  # and EOS


def test_stop_strings_cut_the_text_also_across_tokens(server):
    client = server.client()
    prompt = f"<|user|>{QUESTIONS[0]}\n<|assistant|>"
    answer = DIALOGUES[0][1]
    stop = "weighted by"  # inside the answer, over several tokens
    assert len(TOKENIZER.encode(stop, add_special_tokens=False)) > 1
    whole = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=60,
                                      stop=["never written", stop])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (answer[:answer.index(stop)], "stop")
    stream = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=60, stop=stop,
                                       stream=True)
    assert streamed(stream)[:2] == (answer[:answer.index(stop)], "stop")


def test_a_seed_reproduces_a_sampled_completion(server):
    client = server.client()

    def sample(seed):
        return client.completions.create(model=NAME, prompt=COUNT_PROMPT, temperature=2.0, max_tokens=30,
                                         seed=seed).choices[0].text

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


def direct_logprobs(params, ids: list[int]) -> np.ndarray:
    """`[len(ids), vocab]`: log_softmax of the `Decoder`'s logits of the whole sequence at once."""
    logits, _ = Decoder(CONFIG).apply({"params": params}, jnp.asarray([ids]))
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def test_echo_with_max_tokens_0_scores_every_prompt_token_of_a_batch_of_prompts(server, params):
    """What lm-evaluation-harness sends for log-likelihoods: token-id prompts in a list, echo, logprobs 1."""
    prompts = [TOKENIZER.encode(p) for p in PROMPTS[:3]]
    body = {"model": NAME, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    answer = server.post("/v1/completions", json=body).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens")} == {
        "prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0}
    for ids, choice in zip(prompts, answer["choices"]):
        logprobs, want = choice["logprobs"], direct_logprobs(params, ids)
        assert choice["text"] == TOKENIZER.decode(ids) and choice["finish_reason"] == "length"
        assert logprobs["tokens"] == [TOKENIZER.decode([i], skip_special_tokens=False) for i in ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        np.testing.assert_allclose(logprobs["token_logprobs"][1:], want[np.arange(len(ids) - 1), ids[1:]],
                                   atol=2e-5, rtol=0)
        for row, top in zip(want, logprobs["top_logprobs"][1:]):
            best = int(np.argmax(row))
            assert top == {TOKENIZER.decode([best], skip_special_tokens=False): pytest.approx(row[best], abs=2e-5)}
        assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(len(ids))]


def test_generated_logprobs_streamed_and_not_and_a_chats_top_logprobs(server, params):
    client, prompt = server.client(), PROMPTS[0]
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                      echo=True)
    ids = TOKENIZER.encode(prompt)
    tokens, finish_reason = expected(params, ids, 12)
    made = _greedy_alone(params, tuple(ids))[:12]
    got = whole.choices[0].logprobs
    assert whole.choices[0].text == TOKENIZER.decode(ids) + tokens
    assert len(got.tokens) == len(ids) + whole.usage.completion_tokens - (finish_reason == "stop")
    want = direct_logprobs(params, ids + made)
    np.testing.assert_allclose(got.token_logprobs[1:], want[np.arange(len(got.tokens) - 1),
                                                            (ids + made)[1:len(got.tokens)]], atol=2e-5, rtol=0)
    assert all(len(top) <= 3 for top in got.top_logprobs[1:])
    pieces = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                            echo=True, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert sum((p.choices[0].logprobs.token_logprobs for p in pieces if p.choices[0].logprobs), []) \
        == got.token_logprobs
    assert sum((p.choices[0].logprobs.text_offset for p in pieces if p.choices[0].logprobs), []) == got.text_offset
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[1]}],
                                          max_completion_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)


def test_n_choices_are_the_seeded_single_requests_and_prompts_keep_their_order(server):
    client = server.client()

    def single(prompt, seed):
        return client.completions.create(model=NAME, prompt=prompt, temperature=1.5, max_tokens=10,
                                         seed=seed).choices[0].text

    many = client.completions.create(model=NAME, prompt=[COUNT_PROMPT, PROMPTS[1]], n=3, temperature=1.5,
                                     max_tokens=10, seed=40)
    assert [c.index for c in many.choices] == list(range(6))
    want = [single(prompt, 40 + i) for prompt in (COUNT_PROMPT, PROMPTS[1]) for i in range(3)]
    assert [c.text for c in many.choices] == want and len(set(want[:3])) > 1
    stream = client.completions.create(model=NAME, prompt=[COUNT_PROMPT, PROMPTS[1]], n=3, temperature=1.5,
                                       max_tokens=10, seed=40, stream=True, stream_options={"include_usage": True})
    texts, finished, usage = [""] * 6, [None] * 6, None
    for piece in stream:
        usage = piece.usage or usage
        for choice in piece.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == want and finished == [c.finish_reason for c in many.choices]
    assert usage.completion_tokens == many.usage.completion_tokens and usage.prompt_tokens == many.usage.prompt_tokens


def test_response_format_json_schema_through_the_server(server):
    pytest.importorskip("llguidance", reason="the json extra (llguidance) is not installed")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    answer = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0, max_completion_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    assert json.loads(answer.choices[0].message.content) in ({"ok": True}, {"ok": False})
    assert answer.choices[0].finish_reason == "stop"
    refused = server.post("/v1/completions", json={"model": NAME, "prompt": "Keys", "response_format": {"type": "xml"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("request_kwargs, status, message", [
    (dict(content=b"{not json"), 400, "the request body is not valid JSON"),
    (dict(json=[1, 2]), 400, "the request body must be a JSON object"),
    (dict(json={"model": NAME, "prompt": "Keys", "temperature": "hot"}), 400,
     "temperature must be a number in [0, 2] (got 'hot')"),
    (dict(json={"model": NAME, "prompt": "Keys", "max_tokens": 2.5}), 400, "max_tokens must be a positive integer"),
    (dict(json={"model": "gpt-4", "prompt": "Keys"}), 400, "model 'gpt-4' is not served here"),
    (dict(json={"model": NAME, "prompt": ""}), 400, "prompt is empty"),
    (dict(json={"model": NAME, "prompt": "Keys", "max_tokens": 94}), 400,
     "the prompt is 3 tokens: with max_tokens 94 that makes 97, past the server's max_seq_len 96"),
    (dict(json={"model": NAME, "prompt": "Keys", "n": 17}), 400, "n must be an integer in [1, 16] (got 17)"),
    (dict(json={"model": NAME, "prompt": ["Keys"] * 9, "n": 9}), 400,
     "9 prompts of n 9 choices make 81, more than the 80 this server takes in one request"),
    (dict(json={"model": NAME, "prompt": "Keys", "logprobs": 21}), 400,
     "logprobs must be an integer in [0, 20] (got 21)"),
    (dict(json={"model": NAME, "prompt": "Keys", "max_tokens": 0}), 400,
     "max_tokens must be a positive integer (0 only with echo: true) (got 0)"),
    (dict(json={"model": NAME, "prompt": "Keys", "stop": ["a", "b", "c", "d", "e"]}), 400, "stop must be"),
    (dict(json={"model": NAME, "prompt": ["Keys", 5]}), 400,
     "prompt must be a string, a list of token ids, or a list of those (got 5 at prompt[1])"),
    (dict(json={"model": NAME, "prompt": ["Keys", []]}), 400, "prompt[1] is empty"),
    (dict(json={"model": NAME, "prompt": [5, 9999]}), 400, "token id 9999, outside the model's vocabulary"),
    (dict(json={"model": NAME, "prompt": "Keys", "top_k": 9999}), 400,  # (the engine's check, answered as a 400)
     f"top_k must be None or an int in [1, vocab_size={CONFIG.vocab_size}] (got 9999)"),
    (dict(json={"model": NAME, "prompt": "Keys", "top_p": 0}), 400, "top_p must be None or in (0, 1] (got 0)"),
    (dict(json={"model": NAME, "prompt": "Keys"}, headers={"Authorization": "Bearer wrong"}), 401,
     "a valid API key is needed"),
    (dict(json={"model": NAME, "prompt": "Keys"}, headers={"Authorization": ""}), 401, "a valid API key is needed"),
    (dict(content=b"{" + b" " * (1 << 20) + b"}"), 413, "the request body is 1,048,578 bytes"),
])
def test_bad_requests_get_an_error_body_and_the_server_goes_on(server, params, request_kwargs, status, message):
    response = server.post("/v1/completions", **request_kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"]
    ok = server.client().completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0)
    assert (ok.choices[0].text, ok.choices[0].finish_reason) == expected(params, TOKENIZER.encode(PROMPTS[1]), 40)


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="max_seq_len 96"):
        server.client().chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                max_completion_tokens=200)
    with pytest.raises(openai.NotFoundError):
        server.client().post("/nowhere", cast_to=object)


def test_a_client_that_leaves_mid_stream_frees_its_row(server):
    """The client reads the first chunk and goes. On a loaded machine the engine may make all 80
    tokens before the server sees the disconnect (the row is freed as finished then), so the client
    leaves up to 5 times: every time the row is freed, and at least once it was cancelled."""
    body = {"model": NAME, "prompt": COUNT_PROMPT, "max_tokens": 80, "temperature": 0, "stream": True}
    for _ in range(5):
        before = server.health()["finished"]
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            next(response.iter_lines())  # the first chunk, then the client goes
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = server.health()
            if sum(health["finished"].values()) == sum(before.values()) + 1 and health["running"] == 0:
                break
            time.sleep(0.05)
        assert sum(health["finished"].values()) == sum(before.values()) + 1 and health["running"] == 0, health
        if health["finished"].get("cancelled", 0) == before.get("cancelled", 0) + 1:
            return
        # (else the engine was done before the server saw the client go)
        assert health["finished"].get("length", 0) == before.get("length", 0) + 1, health
    pytest.fail(f"5 clients left mid-stream and no request was cancelled: {health}")


def test_load_200_requests_from_32_clients_none_lost_none_mixed(server, params):
    """Bounded: 200 requests, 32 threads, each request within 60 s, the whole within 300 s."""
    prompts = PROMPTS + [COUNT_PROMPT]
    want = {(p, n): expected(params, TOKENIZER.encode(p), n) for p in prompts for n in (8, 24)}
    client = server.client()

    def ask(i: int):
        prompt, n = prompts[i % len(prompts)], (8, 24)[i % 2]
        if i % 3 == 0:  # streamed, the others whole
            text, finish_reason, _ = streamed(client.completions.create(
                model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True))
        else:
            choice = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0).choices[0]
            text, finish_reason = choice.text, choice.finish_reason
        return (text, finish_reason) == want[prompt, n]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:  # a warm-up round, then the memory is read
        assert all(pool.map(ask, range(32)))
    rss_before = server.rss_mb()
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(200), timeout=300))
    assert len(answers) == 200 and all(answers)  # none lost, each its own prompt's answer
    assert time.monotonic() - started < 300
    growth = server.rss_mb() - rss_before
    health = server.health()
    assert (health["running"], health["waiting"]) == (0, 0)
    assert growth < 10, f"the server's memory grew {growth:.1f} MB over 200 requests"


@pytest.fixture(scope="module")
def slow_folder(tmp_path_factory):
    return save_folder(init_params(SLOW), str(tmp_path_factory.mktemp("slow")), SLOW)


def test_a_full_queue_gets_429_and_sigterm_finishes_what_is_running(slow_folder, tmp_path):
    """One row and a queue of one: a third request is refused; SIGTERM then lets both finish."""
    server = Server(slow_folder, str(tmp_path / "server.log"), "--max-batch", "1", "--max-queue", "1",
                    "--prefill-chunk", "16", "--max-seq-len", "448")
    results = {}
    try:
        body = {"model": NAME, "prompt": "Keys", "max_tokens": 400, "temperature": 0, "stream": True}

        def run(name):
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {KEY}"}) as response:
                results[name] = [line for line in response.iter_lines() if line]

        threads = [threading.Thread(target=run, args=(name,)) for name in ("first", "second")]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while (server.health()["running"], server.health()["waiting"]) != (1, 1):
            assert time.monotonic() < deadline, server.health()
        refused = server.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert "the server is busy" in refused.json()["error"]["message"]
        assert server.health()["waiting"] == 1  # the second still waits: SIGTERM comes before it runs
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(120)
    finally:
        status = server.stop()
    assert status == 0, server.log()
    for name in ("first", "second"):
        assert results[name][-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in results[name][-2] or '"finish_reason": "stop"' in results[name][-2]
    assert "Traceback" not in server.log()


def test_a_mixture_of_experts_serves_concurrent_requests_what_each_gets_alone(tmp_path):
    """`jaxformer-serve` on the tiny Qwen3-MoE checkpoint (`save_random_checkpoint(experts=True)`: 2 of 4
    experts a token in each layer), 3 rows for 6 concurrent greedy completions of prompts of many lengths:
    rows that route their tokens to other experts share the steps, prompts' chunks ride with them; each
    request's text is what greedy `generate` gives its prompt alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "text"))
    from checkpoints import save_random_checkpoint

    from jaxformer.convert import load_hf
    from jaxformer.text import load_tokenizer

    folder = tmp_path / "moe"
    save_random_checkpoint(folder, experts=True)
    config, params = load_hf(str(folder))
    tokenizer = load_tokenizer(str(folder))
    prompts = ["Attention is all", "The cat sat on the mat, and the dog sat", "Keys", "今天天气很好，我们去公园",
               "机器学习模型需要数据", "Keys and values are cached, so each new token costs"]
    ids = [tokenizer.encode(p) for p in prompts]
    assert len({len(row) for row in ids}) >= 5 and max(map(len, ids)) > 8
    width = max(map(len, ids))
    padded = np.zeros((len(ids), width), np.int32)  # one ragged batch: generate decodes each row as alone
    for b, row in enumerate(ids):
        padded[b, :len(row)] = row
    alone = np.asarray(generate(Decoder(config), params, padded, prompt_lengths=[len(row) for row in ids],
                                max_new_tokens=16, eos_id=list(tokenizer.stop_ids)))[:, width:]
    server = Server(str(folder), str(tmp_path / "server.log"), "--max-batch", "3", "--prefill-chunk", "8",
                    "--log-level", "warning")
    try:
        client, start = server.client(), threading.Barrier(len(prompts))

        def ask(prompt):
            start.wait()
            answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
            return answer.choices[0].text, answer.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
    finally:
        status = server.stop()
    assert status == 0 and "Traceback" not in server.log(), server.log()
    for row, new, answer in zip(ids, alone.tolist(), answers):
        stops = [i for i, token in enumerate(new) if token in tokenizer.stop_ids]
        want = completion_text(tokenizer, row, new[:stops[0]] if stops else new), "stop" if stops else "length"
        assert answer == want
    assert len({text for text, _ in answers}) == len(prompts)
