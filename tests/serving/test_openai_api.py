"""The API's text side: stop strings cut out however the tokens split them."""

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


def test_a_job_reads_the_defaults_and_refuses_a_second_choice():
    job = read_job({"model": "m", "prompt": "Keys"}, chat=False, tokenizer=TOKENIZER, model_name="m",
                   vocab_size=TOKENIZER.vocab_size, max_seq_len=96)
    assert (job.max_tokens, job.temperature, job.top_p, job.top_k, job.stop, job.stream) == (16, 1.0, 1.0, None, (),
                                                                                              False)
    chat = read_job({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
                    chat=True, tokenizer=TOKENIZER, model_name="m", vocab_size=TOKENIZER.vocab_size, max_seq_len=96)
    assert chat.max_tokens == 96 - len(chat.prompt_ids)  # a chat runs to the end of the context
    with pytest.raises(ApiError, match="n must be 1"):
        read_job({"model": "m", "prompt": "Keys", "n": 3}, chat=False, tokenizer=TOKENIZER, model_name="m",
                 vocab_size=TOKENIZER.vocab_size, max_seq_len=96)
