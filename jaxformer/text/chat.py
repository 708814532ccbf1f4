"""Chat templates: a conversation rendered into the prompt text a chat model was tuned on.

A chat checkpoint ships a Jinja template (in `chat_template.jinja` or
`tokenizer_config.json`) that turns `[{"role": "user", "content": ...}, ...]` into its
own markup (`<|start_header_id|>user<|end_header_id|>...` for Llama 3). transformers'
`apply_chat_template` renders it in a sandboxed Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` that keeps non-ASCII text, and
the helpers `raise_exception` and `strftime_now`; the special tokens (`bos_token`, ...)
are variables. `render_chat` does the same, so the text (and its ids) are transformers'.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxformer.text.tokenizer import Tokenizer


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(tokenizer: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation, by the tokenizer's chat template.

    Encode it with `tokenizer.encode(text, add_special_tokens=False)`: the template
    writes the special tokens it wants (a BOS among them) itself.

    Args:
      tokenizer: a `Tokenizer` with a `chat_template`.
      messages: `[{"role": "system" | "user" | "assistant", "content": str}, ...]`.
      add_generation_prompt: end with the header of the assistant's turn, so that the
        model answers rather than continues the user's message.

    Raises:
      ValueError: the tokenizer has no chat template, or the template refuses the
        conversation (many accept only alternating user/assistant turns).
    """
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template (no chat_template.jinja, and no chat_template "
                         "in tokenizer_config.json)")
    try:
        return _compile(tokenizer.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                        **tokenizer.special_tokens)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template refuses this conversation: {e}") from None
