"""Preference pairs: each record's prompt, chosen and rejected ids are those TRL's DPOTrainer
tokenizes (the peers extra), for text, chat and implicit-prompt records, on the test
checkpoint's tokenizer and on shipped chat templates."""

import pytest
from checkpoints import save_random_checkpoint
from conftest import import_peer, torch_peer, trl_dpo_trainer
from conventions import GEMMA3, LLAMA3, QWEN, save_tokenizer_files

from jaxformer.text import load_tokenizer
from jaxformer.text.preference import pair_of


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
    trainer = trl_dpo_trainer(tmp_path / "trl", model, tokenizer, TEXT, eval_sets={"chat": CHAT, "implicit": IMPLICIT})
    ours = load_tokenizer(str(folder))
    for records, prepared in ((TEXT, trainer.train_dataset), (CHAT, trainer.eval_dataset["chat"]),
                              (IMPLICIT, trainer.eval_dataset["implicit"])):
        assert len(prepared) == len(records)
        for record, row in zip(records, prepared):
            pair = pair_of(ours, record)
            assert (pair.prompt, pair.chosen, pair.rejected) == (row["prompt_ids"], row["chosen_ids"],
                                                                 row["rejected_ids"]), record
    if convention is None:  # the merge across the boundary happened: the prompt's last tokens are the answers'
        whole, cut = tokenizer(TEXT[0]["prompt"])["input_ids"], trainer.train_dataset[0]["prompt_ids"]
        assert len(cut) < len(whole) and whole[:len(cut)] == cut
