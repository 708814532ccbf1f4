"""Tool calls: tools rendered through a chat template that takes them (refused otherwise), the
calls read back in the families' documented forms; end to end, a tiny model that has learned
to call a function answers through the real server with `tool_calls`."""

import dataclasses
import json

import pytest
from conftest import memorised_params
from server import NAME, Server

from jaxformer import DecoderConfig
from jaxformer.convert import save_hf
from jaxformer.serving.openai_api import ApiError, read_job
from jaxformer.serving.tools import check_tools, parse_tool_calls
from jaxformer.text import render_chat, save_tokenizer, train_bpe
from jaxformer.text.chat import takes_tools

EOS = "<|endoftext|>"
# A Hermes-style template, as Qwen's: the functions in a system turn, each call in <tool_call> tags.
TEMPLATE = ("{% if tools %}<|system|>functions:{% for t in tools %}{{ t.function | tojson }}{% endfor %}\n{% endif %}"
            "{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
            "{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "today's weather", "parameters": CITY}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
PLAIN = dataclasses.replace(train_bpe(["Weather in Paris?" + CALL + EOS], 300),
                            chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")


def test_calls_are_read_in_the_qwen_and_llama_forms_and_other_text_is_content():
    content, calls = parse_tool_calls("Let me look.\n" + CALL + '\n<tool_call>{"name": "time", "arguments": {}}'
                                      "</tool_call>")
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "weather", {"city": "Paris"}), ("function", "time", {})]
    assert len({c["id"] for c in calls}) == 2
    content, calls = parse_tool_calls('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_tool_calls("It is sunny.") == ("It is sunny.", [])
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls('{"answer": 4}') == ('{"answer": 4}', [])  # JSON, but not a call


@pytest.mark.parametrize("tools, choice, message", [
    ([], None, "tools must be a non-empty list"),
    ([{"type": "function"}], None, "tools[0] must be {type: function"),
    ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, "tools[0] must be"),
    ([WEATHER], "required", "tool_choice must be auto or none"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("{", r"\{")):
        check_tools(tools, choice)
    assert check_tools([WEATHER], "none") is False and check_tools([WEATHER], None) is True


def test_tools_go_through_a_template_that_takes_them_and_are_refused_by_one_that_does_not():
    tokenizer = dataclasses.replace(PLAIN, chat_template=TEMPLATE)
    assert takes_tools(tokenizer) and not takes_tools(PLAIN)
    job = read_job({"model": "m", "messages": ASK, "tools": [WEATHER]}, chat=True, tokenizer=tokenizer,
                   model_name="m", max_seq_len=512)
    assert job.tools and '"name": "weather"' in tokenizer.decode(job.prompts[0])
    for body, chat, message in [({"messages": ASK, "tools": [WEATHER]}, True, "chat template does not render tools"),
                                ({"prompt": "Weather", "tools": [WEATHER]}, False, "tools are for /v1/chat")]:
        with pytest.raises(ApiError, match=message) as refused:
            read_job({"model": "m", **body}, chat=chat, tokenizer=PLAIN if chat else tokenizer, model_name="m",
                     max_seq_len=512)
        assert refused.value.param == "tools"


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """A server of a tiny model that has learned, by heart, to answer ASK with CALL."""
    text = render_chat(dataclasses.replace(PLAIN, chat_template=TEMPLATE), ASK, tools=[WEATHER]) + CALL + EOS
    tokenizer = dataclasses.replace(train_bpe([text], 320), chat_template=TEMPLATE)  # (its words: short prompts)
    ids = tokenizer.encode(text, add_special_tokens=False)
    config = DecoderConfig(vocab_size=tokenizer.vocab_size, n_layer=1, n_head=4, n_kv_head=2, d_model=64,
                           max_seq_len=160)
    params = memorised_params(config, ids * 8, steps=600, width=len(ids) + 1)  # (a window: the whole dialogue)
    folder = str(tmp_path_factory.mktemp("caller"))
    save_hf(config, params, folder, eos_id=tokenizer.eos_id)
    save_tokenizer(tokenizer, folder)
    server = Server(folder, str(tmp_path_factory.mktemp("log") / "server.log"), "--log-level", "warning")
    yield server
    assert server.stop() == 0, server.log()


def test_a_model_that_calls_a_tool_answers_with_tool_calls_streamed_and_not(caller):
    client = caller.client()
    answer = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("weather", {"city": "Paris"})]
    stream = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60,
                                            stream=True)
    pieces = list(stream)
    calls = [call for p in pieces for call in (p.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "weather", {"city": "Paris"})]
    assert pieces[-1].choices[0].finish_reason == "tool_calls"
    plain = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=60)
    assert plain.choices[0].message.content == CALL and plain.choices[0].finish_reason == "stop"
