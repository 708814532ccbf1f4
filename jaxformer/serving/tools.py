"""Tool calls: the `tools` of a chat request, checked, and the calls read back from the text.

The functions reach the model through its chat template (`text.chat.takes_tools`: a template
that reads `tools`); a model whose template does not is refused. The model answers a call in
its family's documented format, read here:

- Qwen2.5 / Qwen3 (and Hermes-style templates): each call a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, any text
  around them the message's content;
- Llama 3.1 / 3.2 / 3.3 (JSON tool calling): the whole answer one JSON object
  `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` if the model wrote it.

Text in neither form is the message's content, with no call.
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


def check_tools(tools, tool_choice) -> bool:
    """Checks a chat request's `tools` (OpenAI's `[{"type": "function", "function": {"name",
    "description"?, "parameters"?}}]`) and `tool_choice`; returns whether calls are read back
    from the answer ("auto", the default with tools; not "none").

    Raises:
      ValueError: `(message, field)` naming what is wrong.
    """
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {type: function, function: {name, parameters}}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str) or not function["name"]
                or not isinstance(function.get("parameters", {}), dict)):
            raise ValueError(f"tools[{i}] must be {{type: function, function: {{name: a string, parameters: "
                             f"an object}}}}", "tools")
    if tool_choice not in (None, "auto", "none"):
        raise ValueError("tool_choice must be auto or none: the model chooses whether to call (a forced call "
                         "is not supported)", "tool_choice")
    return tool_choice != "none"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """`(content, tool_calls)` of an answer: the calls in OpenAI's shape (`id`, `type`,
    `function.name`, `function.arguments` as a JSON string), the rest of the text as content
    (None where nothing else was said)."""
    blocks = [(match, _call(match.group(1), "arguments")) for match in TOOL_CALL.finditer(text)]
    calls = [call for _, call in blocks if call is not None]
    if calls:
        rest = text
        for match, call in reversed(blocks):
            if call is not None:
                rest = rest[:match.start()] + rest[match.end():]
        return rest.strip() or None, calls
    whole = text.strip().removeprefix(PYTHON_TAG).strip()
    call = _call(whole, "parameters") if whole.startswith("{") else None
    return (None, [call]) if call is not None else (text, [])


def _call(payload: str, arguments: str) -> dict | None:
    """A call of OpenAI's shape from a JSON `{"name": ..., arguments: {...}}` (or "arguments"),
    None if `payload` is not one."""
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments, value.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(args, ensure_ascii=False)}}
