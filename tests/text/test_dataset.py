"""Fine-tuning data: which tokens carry loss (chat templates as shipped, prompt/completion
records), rows and their shifted targets, held-out batches, and the refusals."""

import json

import jax
import numpy as np
import pytest
from checkpoints import CHAT_TEMPLATE, bpe_tokenizer
from conventions import GEMMA3, LLAMA3, QWEN, save_tokenizer_files

from jaxformer.text import Tokenizer, load_tokenizer, render_chat
from jaxformer.text.dataset import IGNORE, FinetuneData, chat_example, completion_example, rows

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Where do keys go?"},
            {"role": "assistant", "content": "Into the cache."},
            {"role": "user", "content": "And values?"},
            {"role": "assistant", "content": "There too."}]
# What each template writes for an assistant turn past its header: the content and the end of the turn.
TURN_ENDS = {"llama3": "<|eot_id|>", "gemma3": "<end_of_turn>\n", "qwen2.5": "<|im_end|>\n"}


def scored_text(tokenizer, example) -> list[str]:
    """The scored tokens' text, one string for each run of consecutive scored tokens."""
    runs, current = [], []
    for token, scored in zip(example.ids, example.scored):
        if scored:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


@pytest.mark.parametrize("convention", [LLAMA3, GEMMA3, QWEN], ids=lambda c: c.name)
def test_only_the_assistant_turns_carry_loss_in_a_shipped_template(convention, tmp_path):
    save_tokenizer_files(convention, str(tmp_path))
    tokenizer = load_tokenizer(str(tmp_path))
    example = chat_example(tokenizer, MESSAGES)  # (Gemma's template folds the system text into the user's turn)
    # The ids are the rendered conversation's, as the model reads it.
    assert example.ids == tokenizer.encode(render_chat(tokenizer, MESSAGES, add_generation_prompt=False),
                                           add_special_tokens=False)
    end = TURN_ENDS[convention.name]
    assert scored_text(tokenizer, example) == ["Into the cache." + end, "There too." + end]


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>"},
                          chat_template="{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="does not render turn 1 as a continuation"):
        chat_example(tokenizer, MESSAGES[1:3])
    with pytest.raises(ValueError, match="at least one assistant turn"):
        chat_example(tokenizer, MESSAGES[:2])


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
                     chat_template=CHAT_TEMPLATE)


def test_a_completion_and_its_eos_carry_the_loss_not_the_prompt_nor_bos():
    tokenizer = tiny_tokenizer()
    example = completion_example(tokenizer, "The cat sat", " on the mat.")
    assert example.ids[0] == tokenizer.bos_id and example.ids[-1] == tokenizer.eos_id
    assert scored_text(tokenizer, example) == [" on the mat.</s>"]
    assert not any(example.scored[:len(tokenizer.encode("The cat sat"))])


def test_rows_shift_the_targets_and_pad_without_loss():
    tokenizer = tiny_tokenizer()
    example = completion_example(tokenizer, "The cat", " sat.")
    batch = rows([example], seq_len=len(example.ids) + 3)
    n = len(example.ids) - 1
    np.testing.assert_array_equal(batch["tokens"][0, :n], example.ids[:-1])
    want = [i if s else IGNORE for i, s in zip(example.ids[1:], example.scored[1:])]
    np.testing.assert_array_equal(batch["targets"][0], want + [IGNORE] * 4)
    cut = rows([example], seq_len=2)  # a row longer than the window is cut to it
    np.testing.assert_array_equal(cut["tokens"][0], example.ids[:2])


def test_records_and_text_make_batches_and_a_held_out_split(tmp_path):
    tokenizer = tiny_tokenizer()
    path = tmp_path / "chat.jsonl"
    records = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": "The cat."}]}
               for i in range(9)] + [{"prompt": "Keys", "completion": " and values."}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    data = FinetuneData(str(path), tokenizer, seq_len=64)
    assert data.kind == "records" and len(data.train["tokens"]) == 9 and len(data.val["tokens"]) == 1
    assert data.cut == 0
    batch = data.batch(jax.random.key(0), 4)
    assert batch["tokens"].shape == batch["targets"].shape == (4, 64)
    (held_out,) = data.validation_batches(4)  # the one held-out record, and three rows that score nothing
    np.testing.assert_array_equal(held_out["tokens"][0], data.val["tokens"][0])
    assert np.all(held_out["targets"][1:] == IGNORE)

    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat. " * 40)
    data = FinetuneData(str(text), tokenizer, seq_len=8)
    ids = np.asarray(tokenizer.encode(text.read_text()[:int(0.9 * len(text.read_text()))], add_special_tokens=False))
    np.testing.assert_array_equal(data.train, ids)
    batch = data.batch(jax.random.key(1), 3)
    np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])  # the next ids
    val = np.concatenate([b["tokens"] for b in data.validation_batches(2)])
    n = (len(data.val) - 1) // 8
    np.testing.assert_array_equal(val[:n].ravel(), data.val[:n * 8])  # consecutive windows of the held-out text


@pytest.mark.parametrize("content, message", [
    ("{not json\n{}\n", "bad.jsonl:1: not JSON"),
    ('{"text": "x"}\n{"text": "y"}\n', "bad.jsonl:1: a record is"),
    ('{"prompt": "a", "completion": "b"}\n', "holds 1 record\\(s\\): at least 2"),
])
def test_bad_records_are_refused_naming_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        FinetuneData(str(path), tiny_tokenizer(), seq_len=8)


def test_too_short_or_unreadable_text_is_refused(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("The cat.")
    with pytest.raises(ValueError, match="each needs --seq-len \\+ 2 = 66"):
        FinetuneData(str(path), tiny_tokenizer(), seq_len=64)
    with pytest.raises(ValueError, match="cannot read --data"):
        FinetuneData(str(tmp_path / "missing.txt"), tiny_tokenizer(), seq_len=8)
