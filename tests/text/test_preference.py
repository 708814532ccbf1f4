"""Preference pairs: text, chat and implicit-prompt records tokenized into a prompt and two
answers, their rows (only the answers scored), batches of chosen-then-rejected rows, the
held-out split, and the refusals. (Their tokenization against TRL's: tests/test_dpo.py.)"""

import json

import jax
import numpy as np
import pytest
from checkpoints import CHAT_TEMPLATE, bpe_tokenizer

from jaxformer.text import Tokenizer, render_chat
from jaxformer.text.dataset import IGNORE
from jaxformer.text.preference import Pair, PreferenceData, pair_of

PROMPT = [{"role": "user", "content": "Where do keys go?"}]
CHOSEN = [{"role": "assistant", "content": "Into the cache."}]
REJECTED = [{"role": "assistant", "content": "On the mat."}]


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
                     chat_template=CHAT_TEMPLATE)


def test_a_text_pair_is_the_prompt_framed_as_a_text_then_each_answer_and_eos():
    tokenizer = tiny_tokenizer()
    pair = pair_of(tokenizer, {"prompt": "The cat sat on the", "chosen": " mat.", "rejected": " log."})
    assert pair.prompt == tokenizer.encode("The cat sat on the")  # BOS first, as the tokenizer frames a text
    assert pair.prompt[0] == tokenizer.bos_id
    for answer, ids in ((" mat.", pair.chosen), (" log.", pair.rejected)):
        assert pair.prompt + ids == tokenizer.encode("The cat sat on the" + answer + "</s>")
        assert ids[-1] == tokenizer.eos_id and tokenizer.decode(ids) == answer
    # An answer that ends with the EOS text already gets no second one.
    again = pair_of(tokenizer, {"prompt": "The cat sat on the", "chosen": " mat.</s>", "rejected": " log."})
    assert again == pair


def test_an_answer_that_merges_with_the_prompt_starts_where_the_ids_part():
    tokenizer = tiny_tokenizer()
    # "T" + "he cat": alone the prompt is a piece of "The", which the full text tokenizes whole.
    prompt, alone = "T", tokenizer.encode("T")
    full = tokenizer.encode("The cat.</s>")
    assert full[:len(alone)] != alone  # (the case this test is for)
    pair = pair_of(tokenizer, {"prompt": prompt, "chosen": "he cat.", "rejected": "he cat."})
    shared = next(i for i, (a, b) in enumerate(zip(alone, full)) if a != b)
    assert pair.prompt == full[:shared] and pair.prompt + pair.chosen == full


def test_a_conversation_pair_is_rendered_by_the_chat_template_and_its_prompt_may_be_implicit():
    tokenizer = tiny_tokenizer()
    pair = pair_of(tokenizer, {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED})
    header = render_chat(tokenizer, PROMPT, add_generation_prompt=True)
    assert pair.prompt == tokenizer.encode(header, add_special_tokens=False)
    assert tokenizer.decode(pair.chosen, skip_special_tokens=False) == "Into the cache.</s>\n"
    assert tokenizer.decode(pair.rejected, skip_special_tokens=False) == "On the mat.</s>\n"
    implicit = pair_of(tokenizer, {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED})
    assert implicit == pair


def test_rows_score_the_answers_alone_and_batches_put_the_chosen_rows_first(tmp_path):
    tokenizer = tiny_tokenizer()
    records = [{"prompt": f"The {w} sat on the", "chosen": " mat.", "rejected": f" {w}."}
               for w in ("cat", "dog", "sun", "sky", "log", "mat", "cat", "dog", "sun", "sky")]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = PreferenceData(str(path), tokenizer, seq_len=16)
    assert data.train["tokens"].shape == (9, 2, 16) and data.val["tokens"].shape == (1, 2, 16)
    for i, record in enumerate(records[:9]):
        pair = pair_of(tokenizer, record)
        for side, answer in enumerate((pair.chosen, pair.rejected)):
            ids = pair.prompt + answer
            tokens, targets = data.train["tokens"][i, side], data.train["targets"][i, side]
            np.testing.assert_array_equal(tokens[:len(ids) - 1], ids[:-1])
            # The target at t is the id at t + 1, scored from the answer's first id on.
            expected = [ids[t + 1] if t + 1 >= len(pair.prompt) else IGNORE for t in range(len(ids) - 1)]
            np.testing.assert_array_equal(targets[:len(ids) - 1], expected)
            assert (targets[len(ids) - 1:] == IGNORE).all() and (tokens[len(ids) - 1:] == 0).all()
    batch = jax.device_get(data.batch(jax.random.key(0), batch_size=3))
    assert batch["tokens"].shape == (6, 16) and batch["pair"].shape == (3,)
    for b, i in enumerate(batch["pair"]):
        for side in (0, 1):
            np.testing.assert_array_equal(batch["tokens"][side * 3 + b], data.train["tokens"][i, side])
            np.testing.assert_array_equal(batch["targets"][side * 3 + b], data.train["targets"][i, side])
    [held_out] = data.validation_batches(batch_size=2)  # one pair, and one that fills the batch
    np.testing.assert_array_equal(held_out["pair"], [0, -1])
    np.testing.assert_array_equal(held_out["tokens"][[0, 2]], data.val["tokens"][0])
    assert (held_out["targets"][[1, 3]] == IGNORE).all()
    in_order = data.training_batches(batch_size=4)
    assert [list(b["pair"]) for b in in_order] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, -1, -1, -1]]


def test_a_pair_whose_prompt_fills_the_window_is_left_out_and_counted(tmp_path):
    tokenizer = tiny_tokenizer()
    long = "The cat sat on the mat, and the dog sat on the log. " * 3
    records = [{"prompt": long, "chosen": " Yes.", "rejected": " No."}] + \
              [{"prompt": "The cat sat on the", "chosen": " mat.", "rejected": " log."}] * 3
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = PreferenceData(str(path), tokenizer, seq_len=16)
    assert data.dropped == 1 and len(data.train["tokens"]) + len(data.val["tokens"]) == 3
    assert len(pair_of(tokenizer, records[0]).prompt) >= 17 > len(pair_of(tokenizer, records[1]).prompt)


@pytest.mark.parametrize("records, message", [
    (["[1, 2]"], r"pairs.jsonl:1: a preference record is .* \(got a list of 2\)"),
    (['{"prompt": "a", "chosen": "b"}'], r":1: .*it has no 'rejected'"),
    (['{"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}'],
     r":1: .*all strings or all messages \(prompt: the string 'a', chosen: the string 'b', rejected: a list of 1\)"),
    (['{"prompt": [{"role": "user"}], "chosen": [], "rejected": []}'], r":1: prompt\[0\]\.content must be a string"),
    (['{"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}'],
     r":1: chosen and rejected share no first turn"),
    (['{"prompt": [{"role": "user", "content": "a"}], "chosen": [], "rejected": '
      '[{"role": "assistant", "content": "b"}]}'], r":1: the chosen conversation adds no turn"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}'], r"1 pair\(s\) to use: at least 2 are needed"),
])
def test_bad_records_are_refused_in_one_line_naming_the_line(tmp_path, records, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(records) + "\n")
    with pytest.raises(ValueError, match=message):
        PreferenceData(str(path), tiny_tokenizer(), seq_len=16)


def test_a_file_that_is_not_jsonl_or_cannot_be_read_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"--data .*pairs.txt: preference pairs are a .jsonl file"):
        PreferenceData(str(tmp_path / "pairs.txt"), tiny_tokenizer(), seq_len=16)
    with pytest.raises(ValueError, match=r"cannot read --data .*missing.jsonl"):
        PreferenceData(str(tmp_path / "missing.jsonl"), tiny_tokenizer(), seq_len=16)


def test_pairs_are_two_examples_scored_on_their_answers():
    chosen, rejected = Pair(prompt=[1, 2], chosen=[3, 4], rejected=[5]).examples()
    assert (chosen.ids, chosen.scored) == ([1, 2, 3, 4], [False, False, True, True])
    assert (rejected.ids, rejected.scored) == ([1, 2, 5], [False, False, True])
