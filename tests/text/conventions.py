"""Tiny checkpoint folders in the four tokenizer conventions of the shipped families, made
the way the hub serves them: a `tokenizer.json` built as each family builds its own, the
`tokenizer_config.json` and `generation_config.json` fields each ships, and a transformers
model of the matching `model_type` whose config is `shipped.tiny(...)` with the tokenizer's
vocabulary size and special ids.

- Llama 3 (Llama-3.2-1B-Instruct): byte-level BPE (Llama 3's split pattern, ignore_merges),
  `<|begin_of_text|>` put in front by a TemplateProcessing post-processor (no
  add_bos_token in tokenizer_config.json), 11 special tokens after the vocabulary, three
  stop ids in generation_config.json.
- Gemma (gemma-3-1b-it): BPE over text whose spaces are `▁`, with byte fallback; `<bos>`
  in front by the post-processor (tokenizer_config.json's `add_bos_token: true`, which
  transformers 5 does not read, agrees); stop ids `<eos>` and `<end_of_turn>`; Gemma 3's
  chat template.
- Qwen (Qwen2.5-0.5B-Instruct): byte-level BPE (NFC, Qwen's split pattern), no BOS at all
  (`bos_token: null`, `add_bos_token: false`), ChatML, stop ids `<|im_end|>` and
  `<|endoftext|>`.
- gpt-oss (gpt-oss-20b): the o200k_harmony byte-level BPE (the o200k split pattern,
  ignore_merges), nothing put around a text, though tokenizer_config.json names
  `<|startoftext|>` its BOS; its 21 special tokens after the vocabulary in their shipped
  order (`<|startoftext|>` 199998 ... `<|return|>` 200002, `<|channel|>` 200005,
  `<|start|>` 200006, `<|end|>` 200007, `<|message|>` 200008, `<|call|>` 200012,
  `<|endofprompt|>` 200018, the reserved ones between); the harmony chat template in
  chat_template.jinja, as the hub ships it; stop ids `<|return|>`, `<|endoftext|>`,
  `<|call|>`. Its experts as bfloat16 weights, not MXFP4 (no quantization_config).

The chat templates are the checkpoints' own, less their branches for tools (which a
conversation without tools never runs); gpt-oss's is here whole too, for a test with tools. The hub was not reachable from where this was
written: the fields and templates follow the published files as far as they could be
checked against copies of them, the Gemma 3 template and the Qwen2.5 sampling settings
among them; tests/families/shipped.py holds the config.json side, checked verbatim.
"""

from __future__ import annotations

import dataclasses
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.families.shipped import scaled_up, tiny

CORPUS = [
    "The cat sat on the mat, and the dog sat on the log.",
    "Keys and values are cached, so each new token costs one step.",
    "Attention is all you need. The Transformer reads a whole sentence at once.",
    "The user asks and the assistant answers; the model says what it thinks.",
    "You are a helpful assistant. Tell me a story about the sea!",
    "注意力就是你所需要的一切。今天天气很好。",
] * 8

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tiktoken's o200k pattern, which o200k_harmony (gpt-oss) keeps.
O200K_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama-3.2-1B-Instruct's template, less the tool branches.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# gemma-3-1b-it's template (it has no tool branches).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Qwen2.5-0.5B-Instruct's template, less the tool branches.
QWEN25_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3-0.6B's template, less the tool branches: earlier turns lose their reasoning, the last
# assistant turn after the last user query keeps it in <think> tags.
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


# gpt-oss-20b's chat_template.jinja (the harmony format), verbatim: the hub's file at its
# commit cbf31f62664d4b1360b3a78427f7b3c3ed8f0fa8 ("Update chat_template.jinja (#94)",
# 2025-08-08), read from the GitHub mirror EchoCog/gpt-oss-20b, which carries the hub
# repository's history; a dump of the hub's files in another public repository holds the
# same text.
GPT_OSS_TEMPLATE_WHOLE = """{#-
  In addition to the normal inputs of `messages` and `tools`, this template also accepts the
  following kwargs:
  - "builtin_tools": A list, can contain "browser" and/or "python".
  - "model_identity": A string that optionally describes the model identity.
  - "reasoning_effort": A string that describes the reasoning effort, defaults to "medium".
 #}

{#- Tool Definition Rendering ============================================== #}
{%- macro render_typescript_type(param_spec, required_params, is_nullable=false) -%}
    {%- if param_spec.type == "array" -%}
        {%- if param_spec['items'] -%}
            {%- if param_spec['items']['type'] == "string" -%}
                {{- "string[]" }}
            {%- elif param_spec['items']['type'] == "number" -%}
                {{- "number[]" }}
            {%- elif param_spec['items']['type'] == "integer" -%}
                {{- "number[]" }}
            {%- elif param_spec['items']['type'] == "boolean" -%}
                {{- "boolean[]" }}
            {%- else -%}
                {%- set inner_type = render_typescript_type(param_spec['items'], required_params) -%}
                {%- if inner_type == "object | object" or inner_type|length > 50 -%}
                    {{- "any[]" }}
                {%- else -%}
                    {{- inner_type + "[]" }}
                {%- endif -%}
            {%- endif -%}
            {%- if param_spec.nullable -%}
                {{- " | null" }}
            {%- endif -%}
        {%- else -%}
            {{- "any[]" }}
            {%- if param_spec.nullable -%}
                {{- " | null" }}
            {%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type is defined and param_spec.type is iterable and param_spec.type is not string and param_spec.type is not mapping and param_spec.type[0] is defined -%}
        {#- Handle array of types like ["object", "object"] from Union[dict, list] #}
        {%- if param_spec.type | length > 1 -%}
            {{- param_spec.type | join(" | ") }}
        {%- else -%}
            {{- param_spec.type[0] }}
        {%- endif -%}
    {%- elif param_spec.oneOf -%}
        {#- Handle oneOf schemas - check for complex unions and fallback to any #}
        {%- set has_object_variants = false -%}
        {%- for variant in param_spec.oneOf -%}
            {%- if variant.type == "object" -%}
                {%- set has_object_variants = true -%}
            {%- endif -%}
        {%- endfor -%}
        {%- if has_object_variants and param_spec.oneOf|length > 1 -%}
            {{- "any" }}
        {%- else -%}
            {%- for variant in param_spec.oneOf -%}
                {{- render_typescript_type(variant, required_params) -}}
                {%- if variant.description %}
                    {{- "// " + variant.description }}
                {%- endif -%}
                {%- if variant.default is defined %}
                    {{ "// default: " + variant.default|tojson }}
                {%- endif -%}
                {%- if not loop.last %}
                    {{- " | " }}
                {% endif -%}
            {%- endfor -%}
        {%- endif -%}
    {%- elif param_spec.type == "string" -%}
        {%- if param_spec.enum -%}
            {{- '"' + param_spec.enum|join('" | "') + '"' -}}
        {%- else -%}
            {{- "string" }}
            {%- if param_spec.nullable %}
                {{- " | null" }}
            {%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type == "number" -%}
        {{- "number" }}
    {%- elif param_spec.type == "integer" -%}
        {{- "number" }}
    {%- elif param_spec.type == "boolean" -%}
        {{- "boolean" }}

    {%- elif param_spec.type == "object" -%}
        {%- if param_spec.properties -%}
            {{- "{\\n" }}
            {%- for prop_name, prop_spec in param_spec.properties.items() -%}
                {{- prop_name -}}
                {%- if prop_name not in (param_spec.required or []) -%}
                    {{- "?" }}
                {%- endif -%}
                {{- ": " }}
                {{ render_typescript_type(prop_spec, param_spec.required or []) }}
                {%- if not loop.last -%}
                    {{-", " }}
                {%- endif -%}
            {%- endfor -%}
            {{- "}" }}
        {%- else -%}
            {{- "object" }}
        {%- endif -%}
    {%- else -%}
        {{- "any" }}
    {%- endif -%}
{%- endmacro -%}

{%- macro render_tool_namespace(namespace_name, tools) -%}
    {{- "## " + namespace_name + "\\n\\n" }}
    {{- "namespace " + namespace_name + " {\\n\\n" }}
    {%- for tool in tools %}
        {%- set tool = tool.function %}
        {{- "// " + tool.description + "\\n" }}
        {{- "type "+ tool.name + " = " }}
        {%- if tool.parameters and tool.parameters.properties %}
            {{- "(_: {\\n" }}
            {%- for param_name, param_spec in tool.parameters.properties.items() %}
                {%- if param_spec.description %}
                    {{- "// " + param_spec.description + "\\n" }}
                {%- endif %}
                {{- param_name }}
                {%- if param_name not in (tool.parameters.required or []) -%}
                    {{- "?" }}
                {%- endif -%}
                {{- ": " }}
                {{- render_typescript_type(param_spec, tool.parameters.required or []) }}
                {%- if param_spec.default is defined -%}
                    {%- if param_spec.enum %}
                        {{- ", // default: " + param_spec.default }}
                    {%- elif param_spec.oneOf %}
                        {{- "// default: " + param_spec.default }}
                    {%- else %}
                        {{- ", // default: " + param_spec.default|tojson }}
                    {%- endif -%}
                {%- endif -%}
                {%- if not loop.last %}
                    {{- ",\\n" }}
                {%- else %}
                    {{- ",\\n" }}
                {%- endif -%}
            {%- endfor %}
            {{- "}) => any;\\n\\n" }}
        {%- else -%}
            {{- "() => any;\\n\\n" }}
        {%- endif -%}
    {%- endfor %}
    {{- "} // namespace " + namespace_name }}
{%- endmacro -%}

{%- macro render_builtin_tools(browser_tool, python_tool) -%}
    {%- if browser_tool %}
        {{- "## browser\\n\\n" }}
        {{- "// Tool for browsing.\\n" }}
        {{- "// The `cursor` appears in brackets before each browsing display: `[{cursor}]`.\\n" }}
        {{- "// Cite information from the tool using the following format:\\n" }}
        {{- "// `【{cursor}†L{line_start}(-L{line_end})?】`, for example: `【6†L9-L11】` or `【8†L3】`.\\n" }}
        {{- "// Do not quote more than 10 words directly from the tool output.\\n" }}
        {{- "// sources=web (default: web)\\n" }}
        {{- "namespace browser {\\n\\n" }}
        {{- "// Searches for information related to `query` and displays `topn` results.\\n" }}
        {{- "type search = (_: {\\n" }}
        {{- "query: string,\\n" }}
        {{- "topn?: number, // default: 10\\n" }}
        {{- "source?: string,\\n" }}
        {{- "}) => any;\\n\\n" }}
        {{- "// Opens the link `id` from the page indicated by `cursor` starting at line number `loc`, showing `num_lines` lines.\\n" }}
        {{- "// Valid link ids are displayed with the formatting: `【{id}†.*】`.\\n" }}
        {{- "// If `cursor` is not provided, the most recent page is implied.\\n" }}
        {{- "// If `id` is a string, it is treated as a fully qualified URL associated with `source`.\\n" }}
        {{- "// If `loc` is not provided, the viewport will be positioned at the beginning of the document or centered on the most relevant passage, if available.\\n" }}
        {{- "// Use this function without `id` to scroll to a new location of an opened page.\\n" }}
        {{- "type open = (_: {\\n" }}
        {{- "id?: number | string, // default: -1\\n" }}
        {{- "cursor?: number, // default: -1\\n" }}
        {{- "loc?: number, // default: -1\\n" }}
        {{- "num_lines?: number, // default: -1\\n" }}
        {{- "view_source?: boolean, // default: false\\n" }}
        {{- "source?: string,\\n" }}
        {{- "}) => any;\\n\\n" }}
        {{- "// Finds exact matches of `pattern` in the current page, or the page given by `cursor`.\\n" }}
        {{- "type find = (_: {\\n" }}
        {{- "pattern: string,\\n" }}
        {{- "cursor?: number, // default: -1\\n" }}
        {{- "}) => any;\\n\\n" }}
        {{- "} // namespace browser\\n\\n" }}
    {%- endif -%}

    {%- if python_tool %}
        {{- "## python\\n\\n" }}
        {{- "Use this tool to execute Python code in your chain of thought. The code will not be shown to the user. This tool should be used for internal reasoning, but not for code that is intended to be visible to the user (e.g. when creating plots, tables, or files).\\n\\n" }}
        {{- "When you send a message containing Python code to python, it will be executed in a stateful Jupyter notebook environment. python will respond with the output of the execution or time out after 120.0 seconds. The drive at '/mnt/data' can be used to save and persist user files. Internet access for this session is UNKNOWN. Depends on the cluster.\\n\\n" }}
    {%- endif -%}
{%- endmacro -%}

{#- System Message Construction ============================================ #}
{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\\n" }}
    {{- "Knowledge cutoff: 2024-06\\n" }}
    {{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
    {%- if builtin_tools %}
        {{- "# Tools\\n\\n" }}
        {%- set available_builtin_tools = namespace(browser=false, python=false) %}
        {%- for tool in builtin_tools %}
            {%- if tool == "browser" %}
                {%- set available_builtin_tools.browser = true %}
            {%- elif tool == "python" %}
                {%- set available_builtin_tools.python = true %}
            {%- endif %}
        {%- endfor %}
        {{- render_builtin_tools(available_builtin_tools.browser, available_builtin_tools.python) }}
    {%- endif -%}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
    {%- if tools -%}
        {{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}
    {%- endif -%}
{%- endmacro -%}

{#- Main Template Logic ================================================= #}
{#- Set defaults #}

{#- Render system message #}
{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}

{#- Extract developer message #}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}

{#- Render developer message #}
{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}
        {{- "# Instructions\\n\\n" }}
        {{- developer_message }}
        {{- "\\n\\n" }}
    {%- endif %}
    {%- if tools -%}
        {{- "# Tools\\n\\n" }}
        {{- render_tool_namespace("functions", tools) }}
    {%- endif -%}
    {{- "<|end|>" }}
{%- endif %}

{#- Render messages #}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {#- At this point only assistant/user/tool messages should remain #}
    {%- if message.role == 'assistant' -%}
        {#- Checks to ensure the messages are being passed in the format we expect #}
        {%- if "content" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field. Instead of doing this, you should pass analysis messages (the string between '<|message|>' and '<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and '<|end|>') in the 'content' field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "thinking" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.thinking or "<|channel|>final<|message|>" in message.thinking %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the thinking field. Instead of doing this, you should pass analysis messages (the string between '<|message|>' and '<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and '<|end|>') in the 'content' field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {#- We need very careful handling here - we want to drop the tool call analysis message if the model #}
            {#- has output a later <|final|> message, but otherwise we want to retain it. This is the only case #}
            {#- when we render CoT/analysis messages in inference. #}
            {%- set future_final_message = namespace(found=false) %}
            {%- for future_message in loop_messages[loop.index:] %}
                {%- if future_message.role == 'assistant' and "tool_calls" not in future_message %}
                    {%- set future_final_message.found = true %}
                {%- endif %}
            {%- endfor %}
            {#- We assume max 1 tool call per message, and so we infer the tool call name #}
            {#- in "tool" messages from the most recent assistant tool call name #}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls! Put the analysis message in one or the other, but not both.") }}
            {%- elif message.content and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- elif message.thinking and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {#- Only render the CoT if the final turn is an assistant turn and add_generation_prompt is false #}
            {#- This is a situation that should only occur in training, never in inference. #}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {#- <|return|> indicates the end of generation, but <|end|> does not #}
            {#- <|return|> should never be an input to the model, but we include it as the final token #}
            {#- when training, so the model learns to emit it. #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {#- CoT is dropped during all previous turns, so we never render it for inference #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}

{#- Generation prompt #}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""

# The same less the tool branches: its macros for functions and built-in tools, their lines
# in the system and developer messages, and the assistant's tool calls and the tools'
# answers; the branch for a final assistant turn, which followed the tool calls' as an
# `elif`, is an `if`. Verbatim otherwise.
GPT_OSS_TEMPLATE = """{#-
  In addition to the normal inputs of `messages` and `tools`, this template also accepts the
  following kwargs:
  - "model_identity": A string that optionally describes the model identity.
  - "reasoning_effort": A string that describes the reasoning effort, defaults to "medium".
 #}

{#- System Message Construction ============================================ #}
{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\\n" }}
    {{- "Knowledge cutoff: 2024-06\\n" }}
    {{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- endmacro -%}

{#- Main Template Logic ================================================= #}
{#- Set defaults #}

{#- Render system message #}
{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}

{#- Extract developer message #}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}

{#- Render developer message #}
{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}
        {{- "# Instructions\\n\\n" }}
        {{- developer_message }}
        {{- "\\n\\n" }}
    {%- endif %}
    {{- "<|end|>" }}
{%- endif %}

{#- Render messages #}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {#- At this point only assistant/user/tool messages should remain #}
    {%- if message.role == 'assistant' -%}
        {#- Checks to ensure the messages are being passed in the format we expect #}
        {%- if "content" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field. Instead of doing this, you should pass analysis messages (the string between '<|message|>' and '<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and '<|end|>') in the 'content' field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "thinking" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.thinking or "<|channel|>final<|message|>" in message.thinking %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the thinking field. Instead of doing this, you should pass analysis messages (the string between '<|message|>' and '<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and '<|end|>') in the 'content' field.") }}
            {%- endif %}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt %}
            {#- Only render the CoT if the final turn is an assistant turn and add_generation_prompt is false #}
            {#- This is a situation that should only occur in training, never in inference. #}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {#- <|return|> indicates the end of generation, but <|end|> does not #}
            {#- <|return|> should never be an input to the model, but we include it as the final token #}
            {#- when training, so the model learns to emit it. #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {#- CoT is dropped during all previous turns, so we never render it for inference #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}

{#- Generation prompt #}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""


@dataclasses.dataclass(frozen=True)
class Convention:
    """One family's tokenizer convention and the shipped checkpoint it is modelled on.

    Attributes:
      name: the test id.
      shipped: the `shipped.SHIPPED` config the model's is shrunk from.
      stops: the stop tokens of generation_config.json, in its order.
      bos: the token in front of every encoded text, or None.
      tokenizer_config: tokenizer_config.json's fields, less added_tokens_decoder.
      generation_config: generation_config.json's fields, the token ids given as token texts.
      config: config.json's token ids (as token texts) where they differ from the shipped config's.
      jinja: the chat template where the checkpoint ships it in chat_template.jinja (gpt-oss's),
        not in tokenizer_config.json.
      model: config.json's other fields that the tiny copy changes.
    """

    name: str
    shipped: str
    stops: tuple[str, ...]
    bos: str | None
    tokenizer_config: dict
    generation_config: dict
    config: dict
    jinja: str | None = None
    model: dict = dataclasses.field(default_factory=dict)


LLAMA3 = Convention(
    "llama3", "Llama-3.2-1B", ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), "<|begin_of_text|>",
    {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_TEMPLATE, "clean_up_tokenization_spaces": True,
     "eos_token": "<|eot_id|>", "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
     "tokenizer_class": "PreTrainedTokenizerFast"},
    {"bos_token_id": "<|begin_of_text|>", "do_sample": True,
     "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "temperature": 0.6, "top_p": 0.9},
    # The -Instruct config.json names the three stop ids too.
    {"bos_token_id": "<|begin_of_text|>", "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]})
GEMMA3 = Convention(
    "gemma3", "gemma-3-1b-it", ("<eos>", "<end_of_turn>"), "<bos>",
    {"add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "chat_template": GEMMA3_TEMPLATE,
     "clean_up_tokenization_spaces": False, "eos_token": "<eos>", "model_max_length": 1000000000000000019884624838656,
     "pad_token": "<pad>", "padding_side": "left", "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
     "tokenizer_class": "GemmaTokenizer", "unk_token": "<unk>", "use_default_system_prompt": False},
    {"bos_token_id": "<bos>", "cache_implementation": "hybrid", "do_sample": True,
     "eos_token_id": ["<eos>", "<end_of_turn>"], "pad_token_id": "<pad>", "top_k": 64, "top_p": 0.95},
    {"bos_token_id": "<bos>", "eos_token_id": ["<eos>", "<end_of_turn>"], "pad_token_id": "<pad>"})
QWEN = Convention(
    "qwen2.5", "Qwen2.5-0.5B", ("<|im_end|>", "<|endoftext|>"), None,
    {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "chat_template": QWEN25_TEMPLATE,
     "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
     "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
     "tokenizer_class": "Qwen2Tokenizer", "unk_token": None},
    {"bos_token_id": "<|endoftext|>", "pad_token_id": "<|endoftext|>", "do_sample": True,
     "eos_token_id": ["<|im_end|>", "<|endoftext|>"], "repetition_penalty": 1.1, "temperature": 0.7,
     "top_p": 0.8, "top_k": 20},
    # The -Instruct config.json: BOS <|endoftext|>, EOS <|im_end|>.
    {"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>"})
GPT_OSS = Convention(
    "gpt-oss", "gpt-oss-20b", ("<|return|>", "<|endoftext|>", "<|call|>"), None,
    {"bos_token": "<|startoftext|>", "clean_up_tokenization_spaces": False, "eos_token": "<|return|>",
     "extra_special_tokens": {}, "model_input_names": ["input_ids", "attention_mask"],
     "model_max_length": 1000000000000000019884624838656, "pad_token": "<|endoftext|>",
     "tokenizer_class": "PreTrainedTokenizerFast"},
    # (The first upload's generation_config.json named two stop ids; the hub's names <|call|> too.)
    {"bos_token_id": "<|startoftext|>", "do_sample": True, "eos_token_id": ["<|return|>", "<|endoftext|>", "<|call|>"],
     "pad_token_id": "<|endoftext|>"},
    {"eos_token_id": "<|return|>", "pad_token_id": "<|endoftext|>"},
    jinja=GPT_OSS_TEMPLATE,
    # MXFP4 experts are what the hub ships; their bfloat16 form is what jaxformer (and this copy) loads.
    model={"quantization_config": None})
CONVENTIONS = (LLAMA3, GEMMA3, QWEN, GPT_OSS)

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# Gemma 3's first five ids, then its turn markers (105 and 106 there).
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_PLAIN_ADDED = ["<tool_call>", "</tool_call>"]  # added tokens that are not special (decode keeps them)
# o200k_harmony's 21 special tokens, 199998 to 200018 there: the harmony markers and the reserved ids between.
GPT_OSS_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
                   "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
                   "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>",
                   *(f"<|reserved_{i}|>" for i in range(200013, 200018)), "<|endofprompt|>"]


def _byte_level(split: str, ignore_merges: bool, vocab_size: int, nfc: bool) -> Tokenizer:
    """A byte-level BPE learned from CORPUS, split first by the family's pattern."""
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=not nfc, use_regex=False)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def llama3_tokenizer() -> Tokenizer:
    """Llama 3's: specials after the vocabulary, `<|begin_of_text|>` put in front by the post-processor."""
    tok = _byte_level(LLAMA3_SPLIT, ignore_merges=True, vocab_size=320, nfc=False)
    tok.add_special_tokens(LLAMA3_SPECIAL)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                      special_tokens=[(bos, tok.token_to_id(bos))])])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    return tok


def qwen_tokenizer() -> Tokenizer:
    """Qwen2's: specials after the vocabulary, nothing put around a text."""
    tok = _byte_level(QWEN_SPLIT, ignore_merges=False, vocab_size=300, nfc=True)
    tok.add_special_tokens(QWEN_SPECIAL)
    tok.add_tokens(QWEN_PLAIN_ADDED)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def gemma_tokenizer() -> Tokenizer:
    """Gemma's: specials first, the 256 byte tokens, then pieces of `▁`-joined words; a character
    outside the vocabulary (here the Chinese ones) falls back to its UTF-8 bytes."""
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "▁")
    learner.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    english = [line for line in CORPUS if line.isascii()]
    learner.train_from_iterator(english, trainers.BpeTrainer(vocab_size=260, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {token: i for i, token in enumerate(GEMMA_SPECIAL + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    # As transformers' GemmaTokenizer builds it: after the normalizer, no space is left to split at.
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(GEMMA_SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos>:1 $B:1",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return tok


def gpt_oss_tokenizer() -> Tokenizer:
    """gpt-oss's (transformers' conversion of a tiktoken vocabulary): the o200k split, specials
    after the vocabulary, nothing put around a text."""
    tok = _byte_level(O200K_SPLIT, ignore_merges=True, vocab_size=320, nfc=False)
    tok.add_special_tokens(GPT_OSS_SPECIAL)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    return tok


BUILDERS = {"llama3": llama3_tokenizer, "gemma3": gemma_tokenizer, "qwen2.5": qwen_tokenizer,
            "gpt-oss": gpt_oss_tokenizer}


def _ids(tok: Tokenizer, value):
    """A token text (or a list of them) as its id(s); anything else as it is."""
    if isinstance(value, list):
        return [_ids(tok, v) for v in value]
    return tok.token_to_id(value) if isinstance(value, str) and value.startswith("<") else value


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)


def save_tokenizer_files(convention: Convention, path: str) -> Tokenizer:
    """tokenizer.json and tokenizer_config.json (with its added_tokens_decoder, as shipped), and
    chat_template.jinja where the checkpoint ships one."""
    os.makedirs(path, exist_ok=True)
    tok = BUILDERS[convention.name]()
    tok.save(os.path.join(path, "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    _write_json(os.path.join(path, "tokenizer_config.json"),
                {"added_tokens_decoder": added, **convention.tokenizer_config})
    if convention.jinja is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(convention.jinja)
    return tok


def tiny_config(convention: Convention, tok: Tokenizer) -> dict:
    """`shipped.tiny` of the convention's checkpoint, with the tokenizer's vocabulary and ids, and
    two layers (Gemma 3's shrunk config has six, a whole period of its sliding-window pattern,
    which tests/families checks; here they would only add compile time)."""
    return tiny(convention.shipped, vocab_size=tok.get_vocab_size(), num_hidden_layers=2, **convention.model,
                **{key: _ids(tok, value) for key, value in convention.config.items()})


def write_generation_config(convention: Convention, tok: Tokenizer, path: str) -> None:
    _write_json(os.path.join(path, "generation_config.json"),
                {key: _ids(tok, value) for key, value in convention.generation_config.items()})


def greedy(model, ids: list[int], new: int, **kwargs) -> list[int]:
    """transformers' greedy continuation of one prompt (the folder's sampling settings off)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, repetition_penalty=1.0, **kwargs)
    return out[0, len(ids):].tolist()


def _relabel_to_stop(model, rows: list[list[int]], stops: list[int], avoid: set[int], new: int) -> None:
    """Swaps token ids in the embedding and output matrices so that greedy decoding of prompt i
    ends at `stops[i]` a few tokens in: where the model's free continuation first shows a token x
    that no prompt and no other chosen position holds, x and the stop trade places. A
    relabelling changes nothing else: every other row still follows the same path."""
    import torch

    free = [greedy(model, row, new, eos_token_id=None, pad_token_id=0) for row in rows]
    banned = avoid | {t for row in rows for t in row}
    chosen: list[tuple[int, int]] = []  # (row, position) of each stop, in order
    for i, row in enumerate(free):
        taken = {free[j][p] for j, p in chosen}
        for s in range(3, new - 2):
            x = row[s]
            earlier = set(row[:s])
            if x in banned or x in earlier or taken & (earlier | {x}) or any(x in free[j][:p] for j, p in chosen):
                continue
            chosen.append((i, s))
            break
        else:
            raise RuntimeError(f"no token to turn into stop {stops[i]} in row {i}: {row}")
    tables = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    if tables[0].data_ptr() == tables[1].data_ptr():  # tied: one table
        tables = tables[:1]
    with torch.no_grad():
        for (i, s), stop in zip(chosen, stops):
            x = free[i][s]
            for table in tables:
                table[[x, stop]] = table[[stop, x]]


def save_checkpoint(convention: Convention, path: str, prompts: list[str], new: int, seed: int = 0,
                    stops: tuple[str, ...] | None = None) -> None:
    """The whole folder: tokenizer files, a transformers model of the convention's family saved
    by `save_pretrained` (bfloat16, the dtype of the shipped config and so of `from_config`),
    and the shipped generation_config.json. Greedy decoding of `prompts[i]`, encoded as the
    tokenizer frames a text, stops at `stops[i]` (by default the i-th stop id) within `new`
    tokens, in float32 arithmetic on those bfloat16 values, as the tests read the folder: in
    bfloat16 arithmetic a continuation can go elsewhere (gpt-oss's did)."""
    import torch
    import transformers

    tok = save_tokenizer_files(convention, path)
    config = transformers.AutoConfig.for_model(**tiny_config(convention, tok))
    model = scaled_up(transformers.AutoModelForCausalLM.from_config(config), seed).to(torch.float32).eval()
    stops = [tok.token_to_id(t) for t in (convention.stops if stops is None else stops)]
    _relabel_to_stop(model, [tok.encode(p).ids for p in prompts], stops[:len(prompts)],
                     set(tok.get_added_tokens_decoder()), new)
    model.to(torch.bfloat16).save_pretrained(path)  # (the values were bfloat16's all along: nothing rounds)
    write_generation_config(convention, tok, path)
