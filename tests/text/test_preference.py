"""Preference pairs: text, chat and implicit-prompt records tokenized into a prompt and two
answers, their rows (only the answers scored), batches of chosen-then-rejected rows, the
held-out split, and the refusals; each record's ids against those TRL's DPOTrainer makes (the
peers extra), for text, chat and implicit-prompt records, on shipped chat templates too."""

import json

import jax
import numpy as np
import pytest
from checkpoints import CHAT_TEMPLATE, bpe_tokenizer, save_random_checkpoint
from conftest import import_peer, torch_peer, trl_dpo_trainer
from conventions import GEMMA3, LLAMA3, QWEN, save_tokenizer_files

from jaxformer.text import Tokenizer, load_tokenizer, render_chat
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


def test_a_text_pairs_implicit_prompt_is_the_text_both_begin_with_the_space_the_answers():
    tokenizer = tiny_tokenizer()
    implicit = pair_of(tokenizer, {"chosen": "The cat sat on the mat.", "rejected": "The cat sat on the log."})
    assert implicit == pair_of(tokenizer, {"prompt": "The cat sat on the", "chosen": " mat.", "rejected": " log."})
    with pytest.raises(ValueError, match="share no first character"):
        pair_of(tokenizer, {"chosen": "Yes.", "rejected": "No."})


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


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def _assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


# A prompt whose last token the answers merge with (" m" + "at." is " mat." in the test tokenizer),
# a prompt ending in a space (the space merges into the answer's first word), an answer that ends
# with the EOS token's text already (none added), Chinese.
TEXT = [{"prompt": "The cat sat on the m", "chosen": "at.", "rejected": "og, and the dog sat on the log."},
        {"prompt": "Keys and values ", "chosen": "are cached.</s>", "rejected": "are not."},
        {"prompt": "今天天气很好，", "chosen": "我们去公园散步吧。", "rejected": "明天也许会下雨。"}]
WHERE = _user("Where did the cat sit?")
# The prompt as messages: one turn, and a system message before a conversation.
CHAT = [{"prompt": [WHERE], "chosen": [_assistant("On the mat.")], "rejected": [_assistant("On the log.")]},
        {"prompt": [{"role": "system", "content": "Answer briefly."}, _user("Hi"), _assistant("Hello."),
                    _user("Weather?")],
         "chosen": [_assistant("今天天气很好。")], "rejected": [_assistant("明天也许会下雨。")]}]
# The prompt implicit: the turns both conversations begin with (one, then three).
IMPLICIT = [{"chosen": [WHERE, _assistant("On the mat.")], "rejected": [WHERE, _assistant("On the log.")]},
            {"chosen": [WHERE, _assistant("On the mat."), _user("And the dog?"), _assistant("On the log.")],
             "rejected": [WHERE, _assistant("On the mat."), _user("And the dog?"), _assistant("It ran away.")]}]

# Text without its prompt: the text both begin with, the space before where they part the answers'.
IMPLICIT_TEXT = [{"chosen": "The cat sat on the mat.", "rejected": "The cat sat on the log."},
                 {"chosen": "Keys and values are cached.", "rejected": "Keys and values are not."}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random checkpoint folder with the test tokenizer and `CHAT_TEMPLATE`."""
    path = tmp_path_factory.mktemp("preference") / "checkpoint"
    save_random_checkpoint(path)
    return path


@pytest.mark.peers
@pytest.mark.parametrize("convention", [None, LLAMA3, GEMMA3, QWEN],
                         ids=lambda c: "checkpoint" if c is None else c.name)
def test_pairs_are_tokenized_as_trls_dpo_trainer_tokenizes_them(checkpoint, convention, tmp_path):
    """TRL's DPOTrainer prepares `TEXT` (its EOS added, the prompt and prompt + answer tokenized),
    `CHAT` (rendered by the template, the prompt with the assistant's header) and `IMPLICIT` (the
    shared turns taken as the prompt) with the transformers tokenizer of a folder; `pair_of` with
    jaxformer's tokenizer of the same folder gives the same prompt, chosen and rejected ids, the
    answers starting where the tokenized prompt and full sequences part."""
    torch = torch_peer()
    transformers = import_peer("transformers")
    folder = checkpoint
    if convention is not None:  # a shipped tokenizer and template (the model is the checkpoint's: never run here)
        folder = tmp_path / "tokenizer"
        save_tokenizer_files(convention, str(folder))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    trainer = trl_dpo_trainer(tmp_path / "trl", model, tokenizer, TEXT,
                              eval_sets={"chat": CHAT, "implicit": IMPLICIT, "implicit_text": IMPLICIT_TEXT})
    ours = load_tokenizer(str(folder))
    for records, prepared in ((TEXT, trainer.train_dataset), (CHAT, trainer.eval_dataset["chat"]),
                              (IMPLICIT, trainer.eval_dataset["implicit"]),
                              (IMPLICIT_TEXT, trainer.eval_dataset["implicit_text"])):
        assert len(prepared) == len(records)
        for record, row in zip(records, prepared):
            pair = pair_of(ours, record)
            assert (pair.prompt, pair.chosen, pair.rejected) == (row["prompt_ids"], row["chosen_ids"],
                                                                 row["rejected_ids"]), record
    if convention is None:  # the merge across the boundary happened: the prompt's last tokens are the answers'
        whole, cut = tokenizer(TEXT[0]["prompt"])["input_ids"], trainer.train_dataset[0]["prompt_ids"]
        assert len(cut) < len(whole) and whole[:len(cut)] == cut
