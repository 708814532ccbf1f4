"""Each family's tokenizer convention end to end, against transformers on the same folder:
Llama 3 (a post-processor's BOS, three stop ids), Gemma (a BOS always, `<end_of_turn>` a
stop), Qwen (no BOS, ChatML) and gpt-oss (no BOS, the harmony format, three stop ids), each
a tiny checkpoint of its family (tests/text/conventions.py).

jaxformer's prompt ids, chat prompts and decoded text are `AutoTokenizer`'s;
`jaxformer-generate` decodes greedily as transformers' `generate` does and
stops at each of the folder's stop ids, prompt lookup gives the same tokens in fewer passes,
and beam search is `jf.generate`'s.

Llama 3's and gpt-oss's templates write today's date (`strftime_now`): every test here renders
on one pinned day, in transformers and in jaxformer alike (`pinned_date`).
"""

import contextlib
import dataclasses
import datetime
import importlib
import io
import json
import re

import jax
import jax.numpy as jnp
import jinja2
import numpy as np
import pytest
from conftest import import_peer
from conventions import (
    CONVENTIONS,
    GEMMA3,
    GPT_OSS,
    GPT_OSS_TEMPLATE_WHOLE,
    LLAMA3,
    QWEN,
    QWEN3_TEMPLATE,
    greedy,
    save_checkpoint,
    save_tokenizer_files,
)

from jaxformer import Decoder, generate
from jaxformer.commands import generate as cli
from jaxformer.convert import load_hf
from jaxformer.text import chat as chat_module
from jaxformer.text import completion_text, load_tokenizer, render_chat
from jaxformer.text.chat import takes_tools

torch = import_peer("torch")
transformers = import_peer("transformers")

pytestmark = pytest.mark.peers

NEW = 16
PROMPTS = ["注意力", "The cat sat", "Keys and values"]  # (a Gemma or Qwen folder has two stop ids: the first two)
SYSTEM = "Be brief."
DAY = datetime.datetime(2025, 8, 5, 12, 0)  # the day the templates' `strftime_now` reads, in every test here


class _PinnedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return DAY.replace(tzinfo=tz)


@contextlib.contextmanager
def pinned_date():
    """`strftime_now` on `DAY`, transformers' and jaxformer's: each calls `datetime.now()` of its
    own module (`from datetime import datetime`) as it renders, so swapping that one name
    pins it (what third-party renderers compared with transformers do; transformers' own
    test only checks the date's form)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.import_module("transformers.utils.chat_template_utils"), "datetime", _PinnedDatetime)
        patch.setattr(chat_module, "datetime", _PinnedDatetime)
        yield


@pytest.fixture(autouse=True)
def pinned_day():
    """A test that ran past midnight would otherwise compare two days' prompts."""
    with pinned_date():
        yield


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers' tiny models on one thread: on 2 busy cores, torch's default of one thread
    a core spends most of a tiny step waiting for the other (30x slower, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _chat(prompt: str) -> list[dict]:
    """The conversation `--chat --system SYSTEM --prompt PROMPT` renders."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


@pytest.fixture(scope="module", params=CONVENTIONS, ids=[c.name for c in CONVENTIONS])
def checkpoint(request, tmp_path_factory):
    """(convention, folder, prompts, transformers' tokenizer and model of the folder). Greedy
    decoding of prompt i stops at the convention's i-th stop id."""
    convention = request.param
    path = str(tmp_path_factory.mktemp(convention.name))
    prompts = PROMPTS[:len(convention.stops)]
    save_checkpoint(convention, path, prompts, NEW)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return convention, path, prompts, tokenizer, model


def run(argv):
    """The CLI in this process, --json: `(rows, stderr lines)`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main([*argv, "--max-new-tokens", str(NEW), "--json"], stdin=io.StringIO(), stdout=out) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()], err.getvalue().splitlines()


def _flags(prompts):
    return [flag for prompt in prompts for flag in ("--prompt", prompt)]


def _until_stop(ids: list[int], stops) -> list[int]:
    """The tokens up to and with the first stop id (transformers pads after it)."""
    cut = [i for i, token in enumerate(ids) if token in stops]
    return ids[:cut[0] + 1] if cut else ids


def test_prompt_ids_chat_prompts_and_text_are_autotokenizers(checkpoint):
    """Special ids, stop ids, each text's ids (the BOS, or none) and their text back, a chat's
    rendering and its ids: load_tokenizer and render_chat against AutoTokenizer."""
    convention, path, _, hf, _ = checkpoint
    ours = load_tokenizer(path)
    bos = None if convention.bos is None else ours.backend.token_to_id(convention.bos)  # (the one put in front)
    assert ours.bos_id == hf.bos_token_id and ours.stop_ids == tuple(ours.backend.token_to_id(t)
                                                                     for t in convention.stops)
    texts = ["The cat sat", "注意力 龍 ñ", "two  spaces\n\nand lines 12345", " leading space",
             f"a stop {convention.stops[-1]} as text"]
    for text in texts:
        ids = hf(text)["input_ids"]
        assert ours.encode(text) == ids
        assert ids[0] == bos if bos is not None else ids[0] not in hf.all_special_ids
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    # The template writes the BOS itself: encoded without the post-processor's, as transformers does.
    chat = _chat(PROMPTS[0]) + [{"role": "assistant", "content": "Once."}, {"role": "user", "content": "More!"}]
    text = render_chat(ours, chat)
    assert text == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ids
    assert ids.count(bos) == (bos is not None)


def test_qwen3s_template_drops_earlier_reasoning_as_apply_chat_template(tmp_path):
    """Qwen3's template (namespaces, a reversed loop, string methods) on Qwen's tokenizer: the
    reasoning of an answered turn is dropped, that of the turn after the last question kept."""
    save_tokenizer_files(QWEN, str(tmp_path))
    with open(tmp_path / "tokenizer_config.json") as f:
        config = json.load(f)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({**config, "chat_template": QWEN3_TEMPLATE}, f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "qwen3"}, f)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_tokenizer(str(tmp_path))
    chat = _chat("Tell me a story") + [{"role": "assistant", "content": "<think>\nA sea?\n</think>\n\nOnce."},
                                       {"role": "user", "content": "More!"},
                                       {"role": "assistant", "content": "<think>\nGo on.\n</think>\n\nThen."}]
    for messages, prompt in ((chat[:-1], True), (chat, False)):
        text = render_chat(ours, messages, add_generation_prompt=prompt)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        ids = hf.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=True)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == ids
    assert "A sea?" not in text and "<think>\nGo on.\n</think>\n\nThen.<|im_end|>" in text


def test_greedy_text_is_transformers_and_stops_at_each_stop_id(checkpoint):
    """One ragged batch of prompts as the tokenizer frames them (a BOS in front but for Qwen's);
    row i ends at the i-th id of generation_config.json's eos_token_id, its text transformers'
    decode of the tokens before it."""
    convention, path, prompts, hf, model = checkpoint
    stops = model.generation_config.eos_token_id
    assert stops == [hf.convert_tokens_to_ids(t) for t in convention.stops]
    rows, err = run(["--checkpoint", path, *_flags(prompts)])
    for prompt, row, stop in zip(prompts, rows, stops):
        ids = hf(prompt)["input_ids"]
        want = _until_stop(greedy(model, ids, NEW), stops)
        assert row["prompt_tokens"] == len(ids)
        assert row["token_ids"] == want and want[-1] == stop and row["finish_reason"] == "stop"
        assert row["completion"] == hf.decode(want[:-1], skip_special_tokens=True)
    assert [line.split()[0] for line in err] == ["loaded", "compile:", "prefill:", "decode:"]


def test_a_chat_with_prompt_lookup_is_transformers_greedy(checkpoint):
    """--chat --system: the prompt is apply_chat_template's (one BOS, the template's), and
    prompt lookup's rounds, which scored proposals (and accepted some where the text repeats
    itself, as Gemma's tiny model's does), keep greedy decoding's tokens."""
    convention, path, _, hf, model = checkpoint
    [row], err = run(["--checkpoint", path, "--chat", "--system", SYSTEM, "--prompt", PROMPTS[1],
                      "--prompt-lookup", "3"])
    ids = hf.apply_chat_template(_chat(PROMPTS[1]), add_generation_prompt=True, return_dict=True)["input_ids"]
    stops = model.generation_config.eos_token_id
    want = _until_stop(greedy(model, ids, NEW), stops)
    stopped = want[-1] in stops
    assert row["prompt_tokens"] == len(ids)
    assert row["token_ids"] == want and row["finish_reason"] == ("stop" if stopped else "length")
    assert row["completion"] == hf.decode(want[:-1] if stopped else want, skip_special_tokens=True)
    figures = re.fullmatch(r"prompt lookup \(k=3, n=3\): (\d+) of (\d+) proposed tokens accepted .*", err[-1])
    assert figures and int(figures[2]) > 0, err[-1]
    if convention is GEMMA3:
        assert int(figures[1]) > 0, err[-1]


@pytest.mark.parametrize("checkpoint", [LLAMA3], ids=[LLAMA3.name], indirect=True)
def test_beam_search_is_generates_with_every_stop_id(checkpoint):
    """Beam search on the prompts, with all of the folder's stop ids (a beam ends at a later
    one), as `jf.generate` decodes them. Llama 3's folder alone: beam search reads nothing of
    a convention but the prompt ids and the stop ids, which the tests above cover for each."""
    _, path, prompts, hf, _ = checkpoint
    rows, err = run(["--checkpoint", path, *_flags(prompts), "--num-beams", "3"])
    tokenizer = load_tokenizer(path)
    ids = [hf(p)["input_ids"] for p in prompts]
    batch = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for row, prompt_ids in zip(batch, ids):
        row[:len(prompt_ids)] = prompt_ids
    config, params = load_hf(path)
    stops = list(tokenizer.stop_ids)
    # (The command's key too, though beam search draws nothing: the same arguments reuse its program.)
    want = np.asarray(generate(Decoder(config), params, jnp.asarray(batch), max_new_tokens=NEW, num_beams=3,
                               eos_id=stops, pad_id=tokenizer.pad_id, prompt_lengths=[len(i) for i in ids],
                               key=jax.random.key(0)))
    for row, prompt_ids, new in zip(rows, ids, want[:, batch.shape[1]:].tolist()):
        new = _until_stop(new, stops)
        stopped = new[-1] in stops
        assert row["prompt_tokens"] == len(prompt_ids)
        assert row["token_ids"] == new and row["finish_reason"] == ("stop" if stopped else "length")
        assert row["completion"] == completion_text(tokenizer, prompt_ids, new[:-1] if stopped else new)
    assert any(row["token_ids"][-1] in stops[1:] for row in rows)
    assert err[2].startswith("beam search (3 beams)")


def _harmony_folder(path, convention=GPT_OSS):
    """gpt-oss's tokenizer files (chat_template.jinja among them) and transformers' tokenizer of them."""
    save_tokenizer_files(convention, str(path))
    with open(path / "config.json", "w") as f:
        json.dump({"model_type": "gpt_oss"}, f)
    return load_tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(path)


HARMONY_CHATS = [
    # system, then the turns: the system message becomes the developer message's instructions.
    (_chat("注意力") + [{"role": "assistant", "content": "Once."}, {"role": "user", "content": "More!"}], True),
    # a developer message; an answered turn's reasoning is dropped.
    ([{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Salut.", "thinking": "A greeting."}, {"role": "user", "content": "Why?"}],
     True),
    # no system message; a last assistant turn (training): its reasoning on the analysis channel, then <|return|>.
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut.", "thinking": "A greeting."}],
     False),
    # the reasoning under another name (transformers copies it to `thinking`), a key set to None (dropped).
    ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Salut.", "reasoning_content": "Short.", "tool_calls": None}], False),
]


def test_harmony_chats_are_apply_chat_templates_token_for_token(tmp_path):
    """gpt-oss's template (a macro, a namespace, `strftime_now`, `raise_exception`) on system,
    developer, user and assistant turns, with and without the generation prompt: the text and
    its ids are apply_chat_template's, in the harmony frame: the system message with the
    pinned date, `<|start|>{role}<|message|>...<|end|>` turns, the assistant's on a channel,
    and the prompt ending `<|start|>assistant`."""
    ours, hf = _harmony_folder(tmp_path)
    token = ours.backend.token_to_id
    for messages, prompt in HARMONY_CHATS:
        text = render_chat(ours, messages, add_generation_prompt=prompt)
        assert text == hf.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
        ids = hf.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=True)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
                               "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-08-05\n\nReasoning: medium\n\n"
                               "# Valid channels: analysis, commentary, final.")
        # Each message <|start|>...<|message|>...<|end|>, but the open prompt (no <|message|>) and the
        # last turn of a training text (<|return|>).
        starts = ids.count(token("<|start|>"))
        assert ids[0] == token("<|start|>") and ids.count(token("<|message|>")) == starts - prompt
        assert ids.count(token("<|end|>")) == starts - 1
        if prompt:
            header = [token("<|start|>"), *ours.encode("assistant")]
            assert ids[-len(header):] == header
        else:
            assert ids[-1] == token("<|return|>") and "<|channel|>analysis<|message|>" in text
    assert "<|start|>developer<|message|># Instructions\n\nAnswer in French.\n\n<|end|>" in render_chat(
        ours, HARMONY_CHATS[1][0])
    assert "A greeting." not in render_chat(ours, HARMONY_CHATS[1][0])
    # A channel written into a turn's content: the template refuses it, in both.
    bad = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<|channel|>final<|message|>Hi"}]
    with pytest.raises(ValueError, match="refuses this conversation: You have passed a message containing "
                                         "<|channel|> tags in the content field"):
        render_chat(ours, bad)
    with pytest.raises(jinja2.TemplateError):
        hf.apply_chat_template(bad, tokenize=False)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "array", "items": {"type": "object", "properties": {"day": {"type": "integer"}}}},
        "when": {"oneOf": [{"type": "string"}, {"type": "number"}], "description": "A date or an offset."}}}}}


def test_gpt_oss_whole_template_with_tools_is_apply_chat_templates(tmp_path):
    """The shipped template whole, tool branches too: the functions rendered as a TypeScript
    namespace by its recursive macros, an assistant's call to one (`<|call|>`) and the tool's
    answer, through `render_chat(..., tools=)` as through apply_chat_template."""
    ours, hf = _harmony_folder(tmp_path, dataclasses.replace(GPT_OSS, jinja=GPT_OSS_TEMPLATE_WHOLE))
    assert takes_tools(ours)
    chat = _chat("Weather in Paris?") + [
        {"role": "assistant", "thinking": "Ask the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"celsius": 20}'}, {"role": "assistant", "content": "20 C."},
        {"role": "user", "content": "Thanks!"}]
    for messages, prompt in ((chat, True), (chat[:3], False), (_chat("Hi"), True)):
        text = render_chat(ours, messages, add_generation_prompt=prompt, tools=[WEATHER])
        assert text == hf.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=prompt, tokenize=False)
        ids = hf.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=prompt,
                                     return_dict=True)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == ids
        assert ("# Tools\n\n## functions\n\nnamespace functions {\n\n// The weather in a city.\n"
                "type get_weather = (_: {\n// The city.\ncity: string,") in text
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>') in render_chat(
        ours, chat, tools=[WEATHER])
    # Without tools the whole template renders as the one less its tool branches.
    trimmed, _ = _harmony_folder(tmp_path / "trimmed")
    for messages, prompt in HARMONY_CHATS:
        assert render_chat(ours, messages, add_generation_prompt=prompt) == render_chat(
            trimmed, messages, add_generation_prompt=prompt)


@pytest.fixture(scope="module")
def harmony_checkpoint(tmp_path_factory):
    """A gpt-oss folder whose greedy decoding of two `--chat --system` prompts stops at
    `<|return|>` (the end of an answer) and at `<|call|>` (a tool call)."""
    path = tmp_path_factory.mktemp("harmony")
    prompts = PROMPTS[1:]
    ours, _ = _harmony_folder(path)
    with pinned_date():
        texts = [render_chat(ours, _chat(p)) for p in prompts]
    save_checkpoint(GPT_OSS, str(path), texts, NEW, stops=("<|return|>", "<|call|>"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), prompts, tokenizer, model


def test_a_harmony_chat_stops_at_return_and_at_call(harmony_checkpoint):
    """jaxformer-generate --chat on gpt-oss's folder: each prompt is apply_chat_template's, and
    greedy decoding is transformers', ending at `<|return|>` in one row and at `<|call|>` in
    the other (both stop ids of generation_config.json, with `<|endoftext|>`)."""
    path, prompts, hf, model = harmony_checkpoint
    stops = model.generation_config.eos_token_id
    assert stops == [hf.convert_tokens_to_ids(t) for t in GPT_OSS.stops]
    rows, _ = run(["--checkpoint", path, "--chat", "--system", SYSTEM, *_flags(prompts)])
    for prompt, row, stop in zip(prompts, rows, ("<|return|>", "<|call|>")):
        ids = hf.apply_chat_template(_chat(prompt), add_generation_prompt=True, return_dict=True)["input_ids"]
        want = _until_stop(greedy(model, ids, NEW), stops)
        assert row["prompt_tokens"] == len(ids)
        assert row["token_ids"] == want and want[-1] == hf.convert_tokens_to_ids(stop)
        assert row["finish_reason"] == "stop" and row["completion"] == hf.decode(want[:-1], skip_special_tokens=True)
