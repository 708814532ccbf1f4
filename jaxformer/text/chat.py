"""Chat templates: a conversation rendered into the prompt text a chat model was tuned on.

`render_chat` sets up Jinja as transformers' `apply_chat_template` does, so the text (and
its ids) are transformers'; the template runs within the bounds of `jaxformer.text.sandbox`
(docs/text.md, "Chat templates").
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols

from jaxformer.text.sandbox import MAX_TEMPLATE_CHARS, RENDER_SECONDS, BoundedEnvironment, TemplateLimitError, bounds
from jaxformer.text.tokenizer import Tokenizer

ERROR_CHARS = 300  # the most of a template's own error message that a refusal repeats
# The names a turn's reasoning goes by: transformers fills the first, which most templates
# read, and `thinking`, which gpt-oss's reads, from whichever a message sets.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols],
                             filters={"tojson": _tojson})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers 5's `apply_chat_template` hands them to a template: new
    dicts, without the keys whose value is None (an API's `"content": null`, which templates
    test with `in`), and with a turn's reasoning under `thinking` and `reasoning_content`
    both, whichever of `REASONING_FIELDS` the message set first."""
    out = []
    for message in messages:
        if isinstance(message, dict):
            message = {key: value for key, value in message.items() if value is not None}
            reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def takes_tools(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's chat template reads `tools` (renders function definitions), as
    the templates of tool-calling checkpoints do."""
    if tokenizer.chat_template is None or len(tokenizer.chat_template) > MAX_TEMPLATE_CHARS:
        return False
    try:
        parsed = jinja2.Environment(extensions=[loopcontrols]).parse(tokenizer.chat_template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def render_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True, *,
                time_limit: float = RENDER_SECONDS, tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation, by the tokenizer's chat template.

    Encode it with `add_special_tokens=False`: the template writes its own BOS.

    Args:
      tokenizer: a `Tokenizer` with a `chat_template`.
      messages: `[{"role": "system" | "user" | "assistant", "content": str}, ...]`, as
        `template_messages` passes them on (a turn's reasoning under `thinking` too, for
        gpt-oss's template, which puts that of a last assistant turn on its analysis channel).
      add_generation_prompt: end with the header of the assistant's turn, so that the
        model answers rather than continues the user's message.
      time_limit: seconds of wall time the rendering may take.
      tools: function definitions for the template to render (`takes_tools`), or None.

    Raises:
      ValueError: one line: no chat template, or the template refuses the conversation,
        does not parse, fails, or passes a bound of `jaxformer.text.sandbox`.
    """
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template (no chat_template.jinja, and no chat_template "
                         "in tokenizer_config.json)")
    template = tokenizer.chat_template
    if len(template) > MAX_TEMPLATE_CHARS:  # its compile time grows with its length
        raise ValueError(f"the chat template is {len(template):,} characters long, past the limit of "
                         f"{MAX_TEMPLATE_CHARS:,}")
    try:
        compiled = _compile(template)
        with bounds(time_limit):
            return compiled.render(messages=template_messages(messages), add_generation_prompt=add_generation_prompt,
                                   **({} if tools is None else {"tools": tools}), **tokenizer.special_tokens)
    except TemplateLimitError as e:
        raise ValueError(f"the chat template {e}") from None
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: line {e.lineno}: {_one_line(e.message)}") from None
    except Exception as e:  # the template's own code: any error it raises is about the template
        if type(e) is jinja2.TemplateError:  # raise_exception(message)
            raise ValueError(f"the chat template refuses this conversation: {_one_line(str(e))}") from None
        raise ValueError(f"the chat template fails: {type(e).__name__}: {_one_line(str(e))}") from None


def _one_line(message: str | None) -> str:
    """A template's message on one line, cut to `ERROR_CHARS` characters (a template chooses its messages)."""
    line = " ".join(str(message).split())
    return line if len(line) <= ERROR_CHARS else line[:ERROR_CHARS] + "..."
