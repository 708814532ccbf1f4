"""The API's text side: stop strings cut out however the tokens split them."""

import jax
import numpy as np
import pytest
from tiny import TOKENIZER

from jaxformer.serving.openai_api import ApiError, StopText, read_job
from jaxformer.text import completion_text

TEXT = "Attention mixes the values, weighted by how well each key fits the query."
IDS = TOKENIZER.encode(TEXT, add_special_tokens=False)


def pieces(stops, ids=IDS) -> tuple[list[str], bool]:
    """The pieces a `StopText` hands out, a token at a time, and whether it stopped."""
    text = StopText(TOKENIZER, [], tuple(stops))
    out = [text.push([i]) for i in ids]
    return out + [text.finish()], text.stopped


@pytest.mark.parametrize("stops, want", [
    ((), TEXT),
    (("weighted by",), "Attention mixes the values, "),
    (("nowhere", "values"), "Attention mixes the "),
    (("the", "mixes"), "Attention "),  # the earliest in the text, whichever is listed first
    (("query.",), "Attention mixes the values, weighted by how well each key fits the "),
])
def test_the_text_ends_before_the_first_stop_string(stops, want):
    out, stopped = pieces(stops)
    assert "".join(out) == want
    assert stopped == bool(stops)
    assert completion_text(TOKENIZER, [], IDS) == TEXT


def test_text_that_may_begin_a_stop_string_waits_for_the_next_tokens():
    out, stopped = pieces(["weighted byX"])  # begins like text that is there, but is not
    assert "".join(out) == TEXT and not stopped
    sent = ["".join(out[:n + 1]) for n in range(len(IDS))]  # what was sent after each token
    made = [completion_text(TOKENIZER, [], IDS[:n + 1]) for n in range(len(IDS))]  # what the tokens spell
    # While the text ends in "weighted by", that part is held back; the next token releases it.
    held = [n for n, text in enumerate(made) if text.endswith("weighted by")]
    assert held and all(sent[n] == "Attention mixes the values, " for n in held)
    assert sent[held[-1] + 1].startswith("Attention mixes the values, weighted by")


def first_stop(text: str, stops) -> str:
    """The direct rule: the text before the stop string whose occurrence ends first (at the
    same end, the longest), or all of it."""
    ends = [(text.find(stop) + len(stop), -len(stop)) for stop in stops if stop in text]
    if not ends:
        return text
    end, minus_length = min(ends)
    return text[:end + minus_length]


def test_any_stop_strings_cut_the_text_where_the_direct_rule_does_however_the_ids_arrive():
    rng = np.random.default_rng(0)
    for _ in range(300):
        stops = []
        for _ in range(rng.integers(1, 5)):
            begin = int(rng.integers(0, len(TEXT) - 1))
            stops.append(TEXT[begin:begin + int(rng.integers(1, 12))] + ("" if rng.random() < 0.7 else "~"))
        text = StopText(TOKENIZER, [], tuple(stops))
        out, ids = [], list(IDS)
        while ids and not text.stopped:
            n = int(rng.integers(1, 4))  # one to three ids an event, as a speculative step may bring
            out.append(text.push(ids[:n]))
            ids = ids[n:]
        out.append(text.finish())
        assert "".join(out) == first_stop(TEXT, stops), stops
        assert text.stopped == (first_stop(TEXT, stops) != TEXT)


class CountedStr(str):
    """A string that counts the characters read from it by index."""

    reads = 0

    def __getitem__(self, index):
        CountedStr.reads += 1
        return str.__getitem__(self, index)


def test_a_stop_string_of_250000_characters_costs_the_characters_of_the_text_not_its_own():
    """The worst case: a stop string that is the text and then 250,000 more characters, so
    the whole text is a possible start of it to the last token. The matcher reads the stop
    string a bounded number of times per character of text, never all of it."""
    CountedStr.reads = 0
    stop = CountedStr(TEXT + "~" * 250_000)
    out, stopped = pieces([stop])
    assert "".join(out) == TEXT and not stopped
    assert out[:-1] == [""] * len(IDS)  # all held back, as a possible start of the stop string
    assert 0 < CountedStr.reads < 8 * len(TEXT)


def test_a_job_reads_the_defaults_and_its_choices():
    job = read_job({"model": "m", "prompt": "Keys"}, chat=False, tokenizer=TOKENIZER, model_name="m", max_seq_len=96)
    o = job.options
    assert (o.max_new_tokens, o.temperature, o.top_p, o.top_k, job.stop, job.stream) == (16, 1.0, 1.0, None, (), False)
    chat = read_job({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                    chat=True, tokenizer=TOKENIZER, model_name="m", max_seq_len=96)
    assert chat.options.max_new_tokens == 96 - len(chat.prompts[0])  # a chat runs to the end of the context
    job = read_job({"model": "m", "prompt": ["Keys", [5, 6]], "n": 3, "seed": 7}, chat=False, tokenizer=TOKENIZER,
                   model_name="m", max_seq_len=96)
    assert job.choices == 6 and [job.prompt_of(c) for c in (0, 2, 3)] == [TOKENIZER.encode("Keys")] * 2 + [[5, 6]]
    keys = [jax.random.key_data(job.choice_options(c).key) for c in range(6)]
    for c, key in enumerate(keys):  # choice i of each prompt: seed + i
        np.testing.assert_array_equal(key, jax.random.key_data(jax.random.key(7 + c % 3)))
    with pytest.raises(ApiError, match=r"echo is for /v1/completions"):
        read_job({"model": "m", "messages": [{"role": "user", "content": "hi"}], "echo": True}, chat=True,
                 tokenizer=TOKENIZER, model_name="m", max_seq_len=96)
    with pytest.raises(ApiError, match=r"top_logprobs goes with logprobs: true"):
        read_job({"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, chat=True,
                 tokenizer=TOKENIZER, model_name="m", max_seq_len=96)


def test_a_seed_becomes_the_key_and_the_sampling_settings_pass_as_sent():
    """The body's settings become `DecodeOptions` unchanged (their ranges are the engine's check)."""
    body = {"model": "m", "prompt": "Keys", "seed": 5, "temperature": 0.5, "top_k": 7, "top_p": 0.9, "max_tokens": 3}
    o = read_job(body, chat=False, tokenizer=TOKENIZER, model_name="m", max_seq_len=96).options
    assert (o.max_new_tokens, o.temperature, o.top_k, o.top_p) == (3, 0.5, 7, 0.9)
    np.testing.assert_array_equal(jax.random.key_data(o.key), jax.random.key_data(jax.random.key(5)))
    with pytest.raises(ApiError, match=r"top_k must be an integer \(got 'many'\)"):
        read_job({**body, "top_k": "many"}, chat=False, tokenizer=TOKENIZER, model_name="m", max_seq_len=96)


def test_tokenize_gives_a_completions_prompt_ids_and_detokenize_their_text():
    from jaxformer.serving.openai_api import read_detokenize, read_tokenize

    framed = read_tokenize({"prompt": TEXT}, TOKENIZER, 64)
    assert framed == {"tokens": TOKENIZER.encode(TEXT), "count": len(TOKENIZER.encode(TEXT)), "max_model_len": 64}
    assert read_tokenize({"prompt": TEXT, "add_special_tokens": False}, TOKENIZER, 64)["tokens"] == IDS
    assert read_detokenize({"tokens": IDS}, TOKENIZER) == {"prompt": TOKENIZER.decode(IDS, skip_special_tokens=False)}
    assert TOKENIZER.decode(IDS) == TEXT  # what the ids spell


@pytest.mark.parametrize("body, param, message", [
    ({}, "prompt", "give prompt (a string) or messages, one of them"),
    ({"prompt": "a", "messages": []}, "prompt", "give prompt (a string) or messages, one of them"),
    ({"prompt": [1, 2]}, "prompt", "prompt must be a string (got [1, 2])"),
    ({"prompt": "a", "add_special_tokens": 1}, "add_special_tokens", "add_special_tokens must be true or false"),
    ({"messages": "hi"}, "messages", "messages must be a non-empty list"),
])
def test_tokenize_refuses_a_bad_body_naming_the_field(body, param, message):
    from jaxformer.serving.openai_api import read_tokenize

    with pytest.raises(ApiError) as caught:
        read_tokenize(body, TOKENIZER, 64)
    assert caught.value.message.startswith(message)
    assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize("tokens, message", [
    (None, "tokens must be a list of token ids in [0, "),
    ([1, "2"], "tokens must be a list of token ids in [0, "),
    ([1, True], "tokens must be a list of token ids in [0, "),
    ([1, -1, 10**6], "(got [-1, 1000000] among them)"),
])
def test_detokenize_refuses_ids_outside_the_vocabulary(tokens, message):
    from jaxformer.serving.openai_api import read_detokenize

    with pytest.raises(ApiError) as caught:
        read_detokenize({"tokens": tokens}, TOKENIZER)
    assert message in caught.value.message and caught.value.param == "tokens" and caught.value.status == 400
