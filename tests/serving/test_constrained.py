"""`response_format` constraints: random walks through the allowed ids always give JSON that
parses (and that the schema accepts), compact, ended by a stop id or the grammar's end; bad
`response_format`s are refused naming the field, before any decoding."""

import dataclasses
import gc
import json
import sys

import numpy as np
import pytest

from jaxformer.serving import constrained
from jaxformer.serving.constrained import NEEDS_EXTRA, read_response_format
from jaxformer.text.tokenizer import char_tokenizer, train_bpe, word_tokenizer

# A small vocabulary (no whitespace but " ", no "\\", "-", "." or "e"), so random JSON ends
# soon and has one compact spelling: 200 walks all ended within 184 ids.
CHARS = list('{}[]":,0123456789ab ') + ["<eos>", "<eot>"]
CHAR = dataclasses.replace(char_tokenizer(CHARS), special_tokens={"eos_token": "<eos>"})
EOS = CHAR.eos_id
# Byte-level BPE (llguidance reads its bytes from tokenizer.json), its merges spanning JSON's
# punctuation, strings and numbers; <|endoftext|> is its EOS.
BPE = train_bpe(['{"name":"Ada","age":36}', '{"name":"Grace","age":85}', '{"name":"Zoë","age":7}',
                 '[1,2,3]', '"résumé"'] * 10, 300)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
JSON_OBJECT = {"type": "json_object"}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.fixture
def llguidance():
    return pytest.importorskip("llguidance", reason="the json extra (llguidance) is not installed")


def ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def allowed_text(constraint) -> str:
    return "".join(CHARS[i] for i in np.flatnonzero(constraint.allowed()))


def walk(constraint, tokenizer, seed: int, limit: int = 300) -> tuple[str, bool]:
    """Ids picked uniformly among the allowed ones (None: among all), as an engine would
    sample them, until a stop id or the grammar's end: the text, and whether it ended within
    `limit` ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(limit):
        if constraint is not None and constraint.is_finished():
            return tokenizer.decode(out), True
        choices = np.arange(tokenizer.vocab_size) if constraint is None else np.flatnonzero(constraint.allowed())
        token = int(rng.choice(choices))
        if token in tokenizer.stop_ids:
            return tokenizer.decode(out), True
        if constraint is not None:
            constraint.advance(token)
        out.append(token)
    return tokenizer.decode(out), False


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_no_constraint_for_none_or_text():
    assert read_response_format(None, CHAR) is None
    assert read_response_format({"type": "text"}, CHAR) is None


@pytest.mark.parametrize("value, field", [
    ("json", "response_format must be an object"),
    ({}, "response_format.type"),
    ({"type": "json"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a person", "schema": PERSON}},
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "description": 3}},
     "response_format.json_schema.description"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": [PERSON]}}, "response_format.json_schema.schema"),
])
def test_bad_response_formats_are_refused_naming_the_field(value, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        read_response_format(value, CHAR)


@pytest.mark.parametrize("schema, why", [
    ({"type": "foo"}, "Invalid type: foo"),
    ({"type": "string", "minLength": "x"}, "minLength"),
    ({"$ref": "#/$defs/missing"}, "does not exist"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "Unsatisfiable"),
])
def test_schemas_llguidance_refuses_are_refused_naming_the_schema(llguidance, schema, why):
    with pytest.raises(ValueError, match=f"^response_format.json_schema.schema: .*{why}"):
        read_response_format(json_schema(schema), CHAR)


def test_without_the_extra_a_response_format_is_refused_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    with pytest.raises(ValueError, match="pip install 'jaxformer\\[json\\]'"):
        read_response_format(JSON_OBJECT, CHAR)
    assert read_response_format({"type": "text"}, CHAR) is None
    assert NEEDS_EXTRA.startswith("response_format")


def test_json_object_walks_are_compact_json_objects(llguidance):
    factory = read_response_format(JSON_OBJECT, CHAR)
    texts = []
    for seed in range(20):
        text, ended = walk(factory(CHAR.vocab_size), CHAR, seed)
        assert ended, f"seed {seed}: no end within 300 ids: {text!r}"
        value = json.loads(text)
        assert isinstance(value, dict)
        assert json.dumps(value, separators=(",", ":")) == text  # no whitespace between JSON tokens
        texts.append(text)
    assert max(len(t) for t in texts) > 20, texts  # not only "{}"
    # The masks are what makes them JSON: the same walks on all ids are not objects.
    assert not any(is_object(walk(None, CHAR, seed)[0]) for seed in range(20))


def test_json_schema_walks_keep_to_the_schema_with_a_byte_level_bpe(llguidance):
    factory = read_response_format(json_schema(PERSON), BPE)
    names = set()
    for seed in range(20):
        text, ended = walk(factory(BPE.vocab_size), BPE, seed)
        assert ended, f"seed {seed}: no end within 300 ids: {text!r}"
        value = json.loads(text)
        assert list(value) == ["name", "age"]
        assert isinstance(value["name"], str) and len(value["name"]) <= 8
        assert isinstance(value["age"], int) and not isinstance(value["age"], bool)
        names.add(value["name"])
    assert len(names) > 10  # random names, not one forced text


def test_at_the_end_only_the_stop_ids_are_allowed(llguidance):
    both = dataclasses.replace(CHAR, eos_ids=(EOS, CHARS.index("<eot>")))
    for tokenizer, stops in ((CHAR, "<eos>"), (both, "<eos><eot>")):
        constraint = read_response_format(JSON_OBJECT, tokenizer)(tokenizer.vocab_size)
        assert allowed_text(constraint) == "{"
        for token in ids('{"a":1'):
            constraint.advance(token)
        assert allowed_text(constraint) == "},0123456789"
        assert not constraint.is_finished()
        constraint.advance(CHARS.index("}"))
        assert allowed_text(constraint) == stops
        assert constraint.is_finished()
        constraint.advance(EOS)
        assert constraint.is_finished()


def test_with_no_stop_id_nothing_is_allowed_at_the_end_and_it_is_finished(llguidance):
    plain = char_tokenizer(CHARS[:-2])  # no <eos>, no stop id
    assert plain.stop_ids == ()
    constraint = read_response_format(JSON_OBJECT, plain)(plain.vocab_size + 5)  # (llguidance's own EOS: id 20)
    for token in ids('{"a":[]'):
        assert not constraint.is_finished()
        constraint.advance(token)
    constraint.advance(CHARS.index("}"))
    assert constraint.is_finished()
    assert not constraint.allowed().any()


def test_ids_past_the_tokenizer_are_never_allowed(llguidance):
    constraint = read_response_format(json_schema({"type": "string"}), CHAR)(CHAR.vocab_size + 10)
    constraint.advance(CHARS.index('"'))
    allowed = constraint.allowed()
    assert allowed.shape == (CHAR.vocab_size + 10,) and allowed.dtype == bool
    assert not allowed[CHAR.vocab_size:].any()
    assert allowed_text(constraint) == '{}[]":,0123456789ab <eot>'  # any text but the stop id's
    with pytest.raises(ValueError, match="read-only"):
        allowed[0] = False  # callers share it


def test_advancing_a_disallowed_token_raises_and_changes_nothing(llguidance):
    factory = read_response_format(JSON_OBJECT, CHAR)
    constraint, other = factory(CHAR.vocab_size + 4), factory(CHAR.vocab_size + 4)
    for token in (CHARS.index("}"), EOS, CHAR.vocab_size + 1, -1):
        with pytest.raises(ValueError, match=f"token {token} is not allowed here by response_format"):
            constraint.advance(token)
    assert allowed_text(constraint) == "{"
    constraint.advance(CHARS.index("{"))
    assert allowed_text(constraint) == '}"'
    assert allowed_text(other) == "{"  # each constraint from a factory has its own place


def test_a_tokenizer_that_spaces_its_words_is_refused(llguidance):
    words = word_tokenizer(["{", "}", '"a"', ":", "1", "<eos>"], eos_token="<eos>")  # decodes to "{ }"
    with pytest.raises(ValueError, match="^response_format is not supported with this tokenizer"):
        read_response_format(JSON_OBJECT, words)


def test_the_tokenizer_setup_is_made_once_and_goes_with_the_tokenizer(llguidance):
    made = constrained._ll_tokenizer(BPE)
    assert constrained._ll_tokenizer(dataclasses.replace(BPE, chat_template="{{ messages }}")) is made
    assert constrained._ll_tokenizer(dataclasses.replace(BPE, eos_ids=(1,))) is not made  # other stop ids
    gc.collect()
    before = len(constrained._LL_TOKENIZERS)
    tokenizer = char_tokenizer(list("{}"))
    read_response_format(JSON_OBJECT, tokenizer)
    assert len(constrained._LL_TOKENIZERS) == before + 1
    del tokenizer
    gc.collect()
    assert len(constrained._LL_TOKENIZERS) == before  # gone with its tokenizer


def test_json_object_through_the_engine_parses_for_20_seeded_samples(llguidance):
    """The mask inside the engine's jitted step: a tiny random model, sampling at temperature 1,
    writes JSON objects that `json.loads` reads, every one ended by the grammar (a stop id or
    its end), none cut by max_tokens (500: the longest here is 259); the same requests without the
    mask do not."""
    import jax
    from conftest import init_params

    from jaxformer import Decoder, DecoderConfig
    from jaxformer.decoding import DecodeOptions
    from jaxformer.serving import Engine

    config = DecoderConfig(vocab_size=CHAR.vocab_size, n_layer=1, n_head=2, n_kv_head=1, d_model=32, max_seq_len=512)
    engine = Engine(Decoder(config), init_params(config), max_batch=4, prefill_chunk=8, stop_ids=CHAR.stop_ids)
    factory = read_response_format(JSON_OBJECT, CHAR)

    def sample(seed: int, constrained: bool):
        options = DecodeOptions(max_new_tokens=500, temperature=1.0, key=jax.random.key(seed))
        return engine.submit(ids("ab"), options, constraint=factory(config.vocab_size) if constrained else None)

    try:
        masked = [h.result() for h in [sample(seed, True) for seed in range(20)]]
        free = [h.result() for h in [sample(seed, False) for seed in range(20)]]
    finally:
        engine.close()
    for tokens, finish_reason, error in masked:
        assert error is None and finish_reason == "stop"
        assert is_object(CHAR.decode(tokens)), CHAR.decode(tokens)
    assert not any(is_object(CHAR.decode(tokens)) for tokens, _, _ in free)
