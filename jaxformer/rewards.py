"""Verifiable rewards for GRPO (`jaxformer.grpo`): a completion is scored by a program that checks
it, not by a learned reward model.

A reward is a function `reward(prompt: str, completion: str, **fields) -> float`, where `fields`
are the other keys of the prompt's data record (a math problem's `answer`, say). It returns a real
number, typically 1.0 for a right completion and 0.0 for a wrong one; GRPO uses only how the
rewards of one prompt's completions compare (`jaxformer.grpo.group_advantages`), so their scale
is free. Two are built in:

- `exact_match`: 1.0 when the completion, stripped of surrounding whitespace, is the record's
  `answer` (as a string, stripped likewise);
- `regex_reward(pattern)`: 1.0 when the whole stripped completion matches the regular
  expression `pattern` (`.` also matching newlines).

`load_reward` reads the command line's choice, `--reward exact`, `--reward regex
--reward-pattern PATTERN` or `--reward module:function`: any function of the signature above,
imported by module name. The module must be importable as it is, installed or in a folder on
PYTHONPATH: the current directory is not assumed to be on `sys.path` (`python -m` puts it there,
an installed command does not). `score` calls a reward and refuses, in one line naming the
function and the completion, anything but a finite number or an exception of the user's code.
"""

from __future__ import annotations

import importlib
import re
import reprlib
from typing import Callable, Mapping

import numpy as np

from jaxformer.validation import UserCodeFailed, finite_float

Reward = Callable[..., float]  # reward(prompt: str, completion: str, **fields) -> float
SPECS = "'exact', 'regex' or 'module:function'"  # what --reward takes
SHOWN = 60  # characters of a completion an error shows

__all__ = ["Reward", "exact_match", "load_reward", "regex_reward", "reward_name", "score"]


def exact_match(prompt: str, completion: str, *, answer, **_) -> float:
    """1.0 when `completion.strip() == str(answer).strip()`, else 0.0; `prompt` and the record's
    other fields are not read."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def regex_reward(pattern: str) -> Reward:
    """A reward giving 1.0 when `re.fullmatch(pattern, completion.strip(), re.DOTALL)`, else 0.0.

    Args:
      pattern: a regular expression (Python's `re`), compiled once, here.

    Returns:
      `reward(prompt, completion, **fields) -> float`.

    Raises:
      ValueError: `pattern` is not a string or not a regular expression (re's message, naming
        `--reward-pattern`).
    """
    if not isinstance(pattern, str):
        raise ValueError(f"--reward-pattern must be a regular expression string (got {pattern!r})")
    try:
        compiled = re.compile(pattern, re.DOTALL)  # DOTALL: `.` crosses the lines of a completion
    except re.error as e:
        raise ValueError(f"--reward-pattern {pattern!r} is not a regular expression: {e}") from None

    def reward(prompt: str, completion: str, **_) -> float:
        return 1.0 if compiled.fullmatch(completion.strip()) else 0.0

    return reward


def load_reward(spec: str, pattern: str | None = None) -> Reward:
    """The reward `--reward spec` (with `--reward-pattern pattern`) names.

    Args:
      spec: "exact" (`exact_match`), "regex" (`regex_reward(pattern)`), or "module:function": the
        function `function` of the module `module`, imported with `importlib` (so it must be
        importable: installed, or its folder on PYTHONPATH; the current directory is not assumed).
      pattern: the regular expression of "regex"; None with any other `spec`.

    Returns:
      The reward function.

    Raises:
      ValueError: in one line naming `--reward` or `--reward-pattern`: `spec` none of the three
        forms (no colon, an empty part), `pattern` missing for "regex" or given with another
        `spec`, a bad pattern, no such module, importing it raised (the exception's type and
        message), no such function in it, or not callable.
    """
    if spec == "regex":
        if pattern is None:
            raise ValueError("--reward regex needs --reward-pattern, the regular expression a whole completion "
                             "must match")
        return regex_reward(pattern)
    if pattern is not None:
        raise ValueError(f"--reward-pattern is read only with --reward regex (got --reward {spec!r})")
    if spec == "exact":
        return exact_match
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"--reward must be {SPECS} (got {spec!r})")
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise ValueError(f"--reward {spec!r}: 'module:function' needs both a module and a function name")
    module = _import(spec, module_name)
    if not hasattr(module, function):
        raise ValueError(f"--reward {spec!r}: module {module_name} has no attribute {function!r}")
    reward = getattr(module, function)
    if not callable(reward):
        raise ValueError(f"--reward {spec!r}: {module_name}.{function} is not callable "
                         f"(it is of type {type(reward).__name__})")
    return reward


def _import(spec: str, module_name: str):
    """The module `module_name`, imported; a one-line ValueError naming `--reward spec` if it is
    not found or its import raises."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Not found: the module itself or a package above it; any other name is a missing
        # import inside the module, an error of its own.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"--reward {spec!r}: no module named {e.name!r} (the module must be importable: "
                             f"installed, or its folder on PYTHONPATH)") from None
        raise ValueError(f"--reward {spec!r}: importing {module_name} raised {_one_line(e)}") from None
    except Exception as e:  # the module's own code failed (SyntaxError included)
        raise ValueError(f"--reward {spec!r}: importing {module_name} raised {_one_line(e)}") from None


def score(reward: Reward, prompt: str, completion: str, fields: Mapping) -> float:
    """`reward(prompt, completion, **fields)` as a Python float.

    A bool counts as 0.0 or 1.0; an int, a float, a numpy scalar or a 0-d array as its value.

    Args:
      reward: a reward function (`load_reward`'s).
      prompt: the prompt's text.
      completion: the completion's text.
      fields: the prompt's record without its prompt: keyword arguments of the reward.

    Returns:
      The reward, a finite float.

    Raises:
      UserCodeFailed: (a ValueError) in one line naming the function (`module:qualname`) and
        showing the start of the completion: the function raised (the exception's type and
        message), or returned anything but a finite real number (NaN, inf, a string, None).
      ValueError: `fields` holding "prompt" or "completion", which are the reward's arguments.
    """
    clash = sorted({"prompt", "completion"} & set(fields))
    if clash:
        raise ValueError(f"score: fields must not hold {clash}: prompt and completion are the reward's "
                         f"own arguments (got keys {sorted(fields)})")
    try:
        value = reward(prompt, completion, **fields)
    except Exception as e:  # the user's code: reported in one line, without its traceback
        raise UserCodeFailed(f"reward {reward_name(reward)} raised {_one_line(e)} on the completion "
                         f"{_start(completion)}") from None
    result = float(value) if isinstance(value, (bool, np.bool_)) else finite_float(value)
    if result is None:
        raise UserCodeFailed(f"reward {reward_name(reward)} must return a finite number, got "
                         f"{' '.join(reprlib.repr(value).split())} ({type(value).__name__}) for the completion "
                         f"{_start(completion)}")
    return result


def reward_name(reward: Reward) -> str:
    """`module:qualname` of a function (or class); the (shortened) repr of any other callable."""
    qualname = getattr(reward, "__qualname__", None)
    if qualname is None:  # an instance with __call__, a functools.partial
        return reprlib.repr(reward)
    return f"{getattr(reward, '__module__', None)}:{qualname}"


def _start(completion: str) -> str:
    """The completion's first `SHOWN` characters as a one-line repr, `...` after them if it goes on."""
    return repr(completion[:SHOWN]) + ("..." if len(completion) > SHOWN else "")


def _one_line(e: BaseException) -> str:
    """`Type: message`, the message's lines joined by spaces."""
    message = " ".join(line.strip() for line in str(e).splitlines())
    return f"{type(e).__name__}: {message}" if message else type(e).__name__
