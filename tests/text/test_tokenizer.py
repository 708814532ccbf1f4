"""load_tokenizer reads a checkpoint folder's tokenizer as transformers does; the demos'
tokenizers survive save_tokenizer; chat templates render as apply_chat_template does."""

import json
import os

import pytest
from checkpoints import CHAT_TEMPLATE, CORPUS, bpe_tokenizer
from conftest import import_peer

from jaxformer.text import (
    Tokenizer,
    char_tokenizer,
    load_tokenizer,
    render_chat,
    save_tokenizer,
    train_bpe,
    word_tokenizer,
)

TEXT = "Attention is all you need. 注意力就是你所需要的一切。龍"


def _folder(tmp_path, tokenizer=None, **config_json) -> str:
    """A folder with a tokenizer and, optionally, config.json / generation_config.json."""
    save_tokenizer(tokenizer or Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>"}), str(tmp_path))
    for name, value in config_json.items():
        with open(tmp_path / f"{name}.json", "w") as f:
            json.dump(value, f)
    return str(tmp_path)


def test_stop_ids_come_from_generation_config_then_config_then_the_eos_token(tmp_path):
    tokenizer = Tokenizer(bpe_tokenizer(), {"bos_token": "<s>", "eos_token": "</s>"})
    assert tokenizer.stop_ids == (1,)
    assert load_tokenizer(_folder(tmp_path / "a")).stop_ids == (1,)
    assert load_tokenizer(_folder(tmp_path / "b", config={"eos_token_id": 2})).stop_ids == (2,)
    folder = _folder(tmp_path / "c", config={"eos_token_id": 2}, generation_config={"eos_token_id": [5, 7]})
    assert load_tokenizer(folder).stop_ids == (5, 7)
    folder = _folder(tmp_path / "d", config={"eos_token_id": 2}, generation_config={"eos_token_id": None})
    assert load_tokenizer(folder).stop_ids == (2,)


@pytest.mark.parametrize("make", [
    lambda: train_bpe([CORPUS], 300),
    lambda: char_tokenizer(sorted(set(TEXT))),
    lambda: word_tokenizer(["a", "b", "<bos>"], bos_token="<bos>"),
], ids=["bpe", "char", "word"])
def test_a_saved_tokenizer_reads_back_the_same(tmp_path, make):
    tokenizer = make()
    text = "a b a" if "<bos>" in tokenizer.backend.get_vocab() else TEXT
    loaded = load_tokenizer(_folder(tmp_path, tokenizer))
    assert loaded.encode(text) == tokenizer.encode(text) and loaded.decode(tokenizer.encode(text)) == text
    assert loaded.special_tokens == tokenizer.special_tokens and loaded.stop_ids == tokenizer.stop_ids


def test_bpe_training_is_deterministic_and_spells_everything():
    first, second = train_bpe([CORPUS], 300), train_bpe([CORPUS], 300)
    assert first.backend.to_str() == second.backend.to_str() and first.vocab_size == 300
    assert first.decode(first.encode("unseen: 龍 ñ \t")) == "unseen: 龍 ñ \t"
    assert (first.bos_id, first.eos_id, first.pad_id) == (0, 0, 0)


def test_a_character_tokenizer_refuses_a_character_it_lacks():
    with pytest.raises(ValueError, match="cannot tokenize 'abz'"):
        char_tokenizer(["a", "b"]).encode("abz")


@pytest.mark.parametrize("damage, message", [
    (lambda d: os.remove(os.path.join(d, "tokenizer.json")), "tokenizer.json: missing"),
    (lambda d: open(os.path.join(d, "tokenizer.json"), "w").write("{oops"), "tokenizer.json: not a readable tokenizer"),
    (lambda d: open(os.path.join(d, "tokenizer_config.json"), "w").write("[1]"),
     "tokenizer_config.json holds a list, not a JSON object"),
    (lambda d: json.dump({"eos_token": "<nope>"}, open(os.path.join(d, "tokenizer_config.json"), "w")),
     r"tokenizer_config.json: special token eos_token='<nope>' is not in the vocabulary"),
    (lambda d: json.dump({"eos_token_id": 400}, open(os.path.join(d, "generation_config.json"), "w")),
     r"generation_config.json: eos_token_id must be an int in \[0, the tokenizer's vocabulary size - 1=399\]"),
])
def test_a_bad_tokenizer_folder_is_one_error_naming_the_file(tmp_path, damage, message):
    folder = _folder(tmp_path)
    damage(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_tokenizer(folder)


def test_render_chat_refuses_without_a_template():
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(train_bpe([CORPUS], 300), [{"role": "user", "content": "hi"}])


# transformers as the peer: what AutoTokenizer makes of the same folder.

@pytest.fixture(scope="module")
def transformers():
    return import_peer("transformers")


def _edit_json(path, edit) -> None:
    with open(path) as f:
        value = json.load(f)
    edit(value)
    with open(path, "w") as f:
        json.dump(value, f)


@pytest.mark.peers
@pytest.mark.parametrize("post_processor, flags", [
    (True, {}), (True, {"add_bos_token": False}), (True, {"add_bos_token": True, "add_eos_token": True}),
    (False, {"add_bos_token": True})], ids=["post-processor", "bos-flag-false", "flags-true", "flag-alone"])
def test_the_post_processor_alone_frames_a_text_as_in_autotokenizer(tmp_path, transformers, post_processor, flags):
    """tokenizer.json's post-processor puts the <s> in front; transformers 5 drops
    tokenizer_config.json's add_bos_token and add_eos_token when there is a tokenizer.json,
    and so does load_tokenizer."""
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer(), bos_token="<s>",
                                         eos_token="</s>").save_pretrained(tmp_path)
    if not post_processor:
        _edit_json(tmp_path / "tokenizer.json", lambda t: t.update(post_processor=None))
    _edit_json(tmp_path / "tokenizer_config.json", lambda c: c.update(flags))
    ours = load_tokenizer(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = hf(TEXT)["input_ids"]
    assert ours.encode(TEXT) == ids and (ids[0] == ours.bos_id) == post_processor and ids[-1] != ours.eos_id
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.peers
def test_chat_template_renders_as_apply_chat_template(tmp_path, transformers):
    template = ("{{ bos_token }}{% for m in messages %}"
                "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                "<|{{ m['role'] }}|>{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}{{ {'k': '注意'} | tojson }}")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe_tokenizer(), bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    hf.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_tokenizer(str(tmp_path))
    messages = [{"role": "user", "content": " 今天天气很好 "}, {"role": "assistant", "content": "Yes."},
                {"role": "user", "content": "And tomorrow?"}]
    text = render_chat(ours, messages)
    assert text == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ids
    with pytest.raises(ValueError, match="roles must alternate"):
        render_chat(ours, messages[1:])


@pytest.mark.peers
def test_a_template_in_tokenizer_config_is_read_too(tmp_path, transformers):
    folder = _folder(tmp_path)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = [{"name": "default", "template": CHAT_TEMPLATE}, {"name": "tool_use", "template": "x"}]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    messages = [{"role": "user", "content": "hi"}]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert render_chat(load_tokenizer(folder), messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
