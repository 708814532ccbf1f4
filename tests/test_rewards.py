"""The built-in rewards, `--reward`'s three forms (a user's module written here, put on sys.path),
and each refusal's one-line message."""

import re
import sys
import textwrap

import numpy as np
import pytest

from jaxformer.rewards import exact_match, load_reward, regex_reward, reward_name, score


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes `name.py` with `source` into a folder put on sys.path; the module is forgotten afterwards."""
    names = []

    def write(name, source):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        names.append(name)
        return name

    monkeypatch.syspath_prepend(tmp_path)
    yield write
    for name in names:
        sys.modules.pop(name, None)


def test_exact_match_compares_stripped_text():
    assert exact_match("2 + 40?", " 42\n", answer=42) == 1.0
    assert exact_match("q", "42", answer=" 42 ", level="easy") == 1.0  # other fields are ignored
    assert exact_match("q", "42.", answer="42") == 0.0
    assert exact_match("q", "The answer is 42", answer="42") == 0.0


def test_regex_reward_matches_the_whole_stripped_completion_across_lines():
    digits = regex_reward(r"-?\d+")
    assert digits("q", "  -17\n", answer="x") == 1.0
    assert digits("q", "17 apples") == 0.0  # fullmatch: a match at the start is not enough
    reasoned = regex_reward(r"<think>.*</think>\s*\d+")
    assert reasoned("q", "<think>first\nthen</think>\n7") == 1.0  # `.` crosses lines
    assert reasoned("q", "7") == 0.0


def test_regex_reward_refuses_a_bad_pattern_with_res_message():
    with pytest.raises(ValueError, match=re.escape(
            "--reward-pattern '(a' is not a regular expression: missing ), unterminated subpattern at position 0")):
        regex_reward("(a")
    with pytest.raises(ValueError, match=re.escape("--reward-pattern must be a regular expression string (got 3)")):
        regex_reward(3)


def test_load_reward_builtins():
    assert load_reward("exact") is exact_match
    reward = load_reward("regex", r"\d+")
    assert reward("q", " 12 ") == 1.0 and reward("q", "x12") == 0.0


def test_load_reward_imports_a_users_function(user_module):
    name = user_module("my_rewards_ok", """
        def length_penalty(prompt, completion, *, answer, **fields):
            return (completion.strip() == answer) - 0.01 * len(completion)
    """)
    reward = load_reward(f"{name}:length_penalty")
    assert reward_name(reward) == f"{name}:length_penalty"
    assert score(reward, "q", "yes", {"answer": "yes"}) == pytest.approx(0.97)
    assert score(reward, "q", "no", {"answer": "yes"}) == pytest.approx(-0.02)


@pytest.mark.parametrize("spec, pattern, message", [
    ("regex", None, "--reward regex needs --reward-pattern, the regular expression a whole completion must match"),
    ("exact", "x", "--reward-pattern is read only with --reward regex (got --reward 'exact')"),
    ("m:f", r"\d", "--reward-pattern is read only with --reward regex (got --reward 'm:f')"),
    ("exactly", None, "--reward must be 'exact', 'regex' or 'module:function' (got 'exactly')"),
    (None, None, "--reward must be 'exact', 'regex' or 'module:function' (got None)"),
    (":f", None, "--reward ':f': 'module:function' needs both a module and a function name"),
    ("m:", None, "--reward 'm:': 'module:function' needs both a module and a function name"),
    ("no_such_reward_module:f", None, "--reward 'no_such_reward_module:f': no module named 'no_such_reward_module' "
                                      "(the module must be importable: installed, or its folder on PYTHONPATH)"),
    ("no_such_reward_package.sub:f", None, "--reward 'no_such_reward_package.sub:f': no module named "
                                           "'no_such_reward_package' (the module must be importable"),
])
def test_load_reward_refuses_bad_specs(spec, pattern, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        load_reward(spec, pattern)


@pytest.mark.parametrize("name, source, message", [
    ("my_rewards_missing_dependency", "import no_such_dependency_of_a_reward\n",
     "importing {name} raised ModuleNotFoundError: No module named 'no_such_dependency_of_a_reward'"),
    ("my_rewards_raising", "RATE = 1 / 0\n", "importing {name} raised ZeroDivisionError: division by zero"),
    ("my_rewards_bad_syntax", "def f(:\n", "importing {name} raised SyntaxError: "),
    ("my_rewards_without_f", "def g(prompt, completion, **fields):\n    return 1.0\n",
     "module {name} has no attribute 'f'"),
    ("my_rewards_constant_f", "f = 3\n", "{name}.f is not callable (it is of type int)"),
])
def test_load_reward_refuses_a_module_in_one_line(user_module, name, source, message):
    user_module(name, source)
    with pytest.raises(ValueError) as caught:
        load_reward(f"{name}:f")
    text = str(caught.value)
    assert text.startswith(f"--reward '{name}:f': " + message.format(name=name)), text
    assert "\n" not in text and "Traceback" not in text


@pytest.mark.parametrize("value, want", [
    (1.0, 1.0), (0, 0.0), (3, 3.0), (True, 1.0), (False, 0.0),
    (np.float32(0.5), 0.5), (np.int64(2), 2.0), (np.bool_(True), 1.0), (np.array(-1.5), -1.5),
])
def test_score_takes_real_finite_numbers(value, want):
    got = score(lambda prompt, completion, **fields: value, "q", "c", {})
    assert type(got) is float and got == want


def _returns(value):
    def reward(prompt, completion, **fields):
        return value
    return reward


@pytest.mark.parametrize("value, shown", [
    (float("nan"), "nan (float)"), (float("inf"), "inf (float)"),
    (np.float32("-inf"), f"{np.float32('-inf')!r} (float32)"),  # numpy's own repr, np.float32(-inf) from numpy 2
    ("1.0", "'1.0' (str)"), (None, "None (NoneType)"), ([1.0], "[1.0] (list)"), (1j, "1j (complex)"),
])
def test_score_refuses_a_value_that_is_not_a_finite_number(value, shown):
    long_completion = "The answer\nis " + "x" * 100
    with pytest.raises(ValueError) as caught:
        score(_returns(value), "q", long_completion, {})
    text = str(caught.value)
    want = (f"reward {__name__}:_returns.<locals>.reward must return a finite number, got {shown} "
            f"for the completion {long_completion[:60]!r}...")
    assert text == want, text
    assert "\n" not in text


def test_score_reports_the_users_exception_in_one_line():
    def picky(prompt, completion, *, answer, **fields):
        raise ValueError(f"cannot parse\n{completion!r} against {answer}")

    with pytest.raises(ValueError) as caught:
        score(picky, "q", "short", {"answer": 4})
    text = str(caught.value)
    assert text == (f"reward {__name__}:test_score_reports_the_users_exception_in_one_line.<locals>.picky raised "
                    f"ValueError: cannot parse 'short' against 4 on the completion 'short'"), text
    # A reward missing its field: the TypeError says which.
    with pytest.raises(ValueError, match=re.escape(
            "reward jaxformer.rewards:exact_match raised TypeError: exact_match() missing 1 required keyword-only "
            "argument: 'answer' on the completion '42'")):
        score(exact_match, "q", "42", {})


def test_score_names_a_callable_object_by_its_repr():
    class Judge:
        def __call__(self, prompt, completion, **fields):
            return None

        def __repr__(self):
            return "Judge(strict)"

    with pytest.raises(ValueError, match=re.escape("reward Judge(strict) must return a finite number, got None")):
        score(Judge(), "q", "c", {})


def test_score_refuses_fields_holding_its_arguments():
    with pytest.raises(ValueError, match=re.escape(
            "score: fields must not hold ['prompt']: prompt and completion are the reward's own arguments "
            "(got keys ['answer', 'prompt'])")):
        score(exact_match, "q", "c", {"prompt": "q", "answer": "c"})
