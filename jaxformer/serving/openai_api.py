"""The OpenAI API's side of the server, with no HTTP in it: a request body read into a `Job`
(each refusal an `ApiError` naming the field), the text a job's tokens make with its stop
strings cut out, and the response bodies and stream chunks clients parse.

A job's decoding is `DecodeOptions`, read from the body in the API's terms (its types, its
ranges, `seed` made a key); the decoding library's own rules (a top_k within the vocabulary,
a prompt's ids, ...) are checked once, by `Engine.submit`, which the app answers as a 400.

docs/serving.md lists the fields taken, their defaults, and what is refused.
"""

from __future__ import annotations

import collections
import dataclasses
import reprlib
import secrets
import time
import uuid
from typing import Callable

import jax

from jaxformer.decoding.request import DecodeOptions
from jaxformer.serving.constrained import Constraint, read_response_format
from jaxformer.serving.engine import MAX_LOGPROBS, TokenLogprob
from jaxformer.serving.tools import check_tools
from jaxformer.text.chat import render_chat, takes_tools
from jaxformer.text.streaming import TextStream
from jaxformer.text.tokenizer import Tokenizer
from jaxformer.validation import SEED_LIMIT

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
MAX_STOP_STRINGS = 4
MAX_N = 16  # choices a prompt may ask for
# Fields clients may send with their default values, but whose other values this server does not do.
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "functions": (None, [])}


class ApiError(Exception):
    """A refusal: the HTTP status and the OpenAI error body's fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {...}}`, as the OpenAI API answers a refusal."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class Job:
    """One request, checked: what the engine decodes and how the answer is shaped.

    Attributes:
      chat: a /v1/chat/completions request (else /v1/completions).
      prompts: each prompt's ids (for chat: one, the messages through the chat template).
      n: choices per prompt; choice `c` (`index`) continues prompt `c // n`.
      options: what the engine decodes: `max_new_tokens` (the body's max_tokens), the sampling
        settings and `key` (`jax.random.key(seed)`: the first choice's; `choice_options`).
      seed: the body's seed (drawn when absent); choice i of a prompt samples with seed + i.
      stop: strings that end the text, left out of it.
      stream: answer with server-sent events; include_usage: a last chunk with `usage`.
      logprobs: None, or each token's logprob with this many likeliest alternatives.
      echo: the text begins with the prompt (a completion's), and its logprobs with the prompt's.
      constraint: `response_format`'s, a `Constraint` for a model of `vocab_size` ids a choice; None.
      tools: the answer's tool calls are read back from its text (`tools.parse_tool_calls`).
    """

    chat: bool
    prompts: tuple[list[int], ...]
    n: int
    options: DecodeOptions
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None
    echo: bool = False
    constraint: Callable[[int], Constraint] | None = None
    tools: bool = False

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]

    def choice_options(self, choice: int) -> DecodeOptions:
        """Choice `choice`'s options: its prompt's i-th choice draws with `seed + i`, so it is the
        one choice a request with that seed would get."""
        seed = (self.seed + choice % self.n) % SEED_LIMIT
        return dataclasses.replace(self.options, key=jax.random.key(seed))


_SHOWN = reprlib.Repr()  # how much of a client's value a message quotes
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 60, 60, 60


def shown(value) -> str:
    """`repr(value)` cut short, as a message quotes what a client sent: a few items of a
    long list, the start and end of a long string, three levels of nesting."""
    return _SHOWN.repr(value)


def _field(body: dict, name: str, kinds: tuple[type, ...], rule: str, default=None):
    """`body[name]` if it is one of `kinds` (None: `default`), else an `ApiError` naming it."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise invalid(f"{name} must be {rule} (got {shown(value)})", name)
    return value


def _number(body: dict, name: str, default, *, low: float, high: float, integer: bool = False):
    kinds = (int,) if integer else (int, float)
    rule = f"{'an integer' if integer else 'a number'} in [{low}, {high}]"
    value = _field(body, name, kinds, rule, default)
    if value is not None and not low <= value <= high:
        raise invalid(f"{name} must be {rule} (got {shown(value)})", name)
    return value


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of `{"type": "text", "text": ...}` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"{where}.content must be a string or a list of text parts (this model reads text only)", where)


def _token_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _prompts(body: dict, tokenizer: Tokenizer) -> list[list[int]]:
    """A completion's prompts: a string or a list of token ids (the engine checks them against
    the vocabulary), or a list of those, each non-empty."""
    prompt = body.get("prompt")
    rule = "a string, a list of token ids, or a list of those"
    if isinstance(prompt, str) or _token_ids(prompt) and prompt:
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt is empty" if prompt == [] else f"prompt must be {rule}", "prompt")
    out = []
    for i, one in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        if not (isinstance(one, str) or _token_ids(one)):
            raise invalid(f"prompt must be {rule} (got {shown(one)} at {where})", "prompt")
        if not one:
            raise invalid(f"{where} is empty", "prompt")
        out.append(tokenizer.encode(one) if isinstance(one, str) else one)
    return out


def _chat_ids(body: dict, tokenizer: Tokenizer) -> list[int]:
    """A chat's prompt: its messages (and `tools`, checked by `_read_tools`) through the template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    rendered = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise invalid(f"{where} must be an object with a string role", where)
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise invalid(f"{where}.tool_calls must be a list of calls", where)
        # An assistant's turn that only called tools has no content; a tool's answer names its call.
        content = "" if calls and message.get("content") is None else _text_content(message.get("content"), where)
        extra = {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if message.get(key) is not None}
        rendered.append({"role": message["role"], "content": content, **extra})
    try:
        text = render_chat(tokenizer, rendered, tools=body.get("tools"))
    except ValueError as e:
        raise invalid(f"messages: {e}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)  # (the template writes its own BOS)


def _read_tools(body: dict, chat: bool, tokenizer: Tokenizer) -> bool:
    """Whether the answer's tool calls are read back (`tools.check_tools`); refuses tools the
    request or the model cannot take."""
    if body.get("tools") is None:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return False
    if not chat:
        raise invalid("tools are for /v1/chat/completions", "tools")
    try:
        calls = check_tools(body["tools"], body.get("tool_choice"))
    except ValueError as e:
        raise invalid(*e.args) from None
    if not takes_tools(tokenizer):
        raise invalid("tools: this model's chat template does not render tools, so it cannot be told of them",
                      "tools")
    return calls


def read_job(body, *, chat: bool, tokenizer: Tokenizer, model_name: str, max_seq_len: int,
             max_choices: int | None = None) -> Job:
    """The request `body` (parsed JSON) as a `Job`, or an `ApiError` (400) naming what is wrong;
    `max_choices`: the most choices (prompts times n) one request may ask for."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise invalid("model must be a string: the name GET /v1/models lists", "model")
    if model != model_name:
        raise invalid(f"model {shown(model)} is not served here; this server serves {model_name!r}", "model",
                      "model_not_found")
    for name, defaults in UNSUPPORTED.items():
        if name in body and not any(body[name] == d and type(body[name]) is type(d) for d in defaults):
            raise invalid(f"{name} is not supported by this server", name)
    n = _number(body, "n", 1, low=1, high=MAX_N, integer=True)
    tools = _read_tools(body, chat, tokenizer)
    logprobs, echo = _logprobs(body, chat), _field(body, "echo", (bool,), "true or false", False)
    if echo and chat:  # (a chat has no prompt text to give back; read silently, it would be ignored)
        raise invalid("echo is for /v1/completions", "echo")
    try:
        prompts = [_chat_ids(body, tokenizer)] if chat else _prompts(body, tokenizer)
    except ValueError as e:  # the tokenizer could not spell the text
        raise invalid(str(e), "messages" if chat else "prompt") from None
    if not all(prompts):
        raise invalid("the prompt encodes to no token", "messages" if chat else "prompt")
    if max_choices is not None and len(prompts) * n > max_choices:
        raise invalid(f"{len(prompts)} prompts of n {n} choices make {len(prompts) * n}, more than the "
                      f"{max_choices} this server takes in one request", "n" if n > 1 else "prompt")
    # max_completion_tokens is the newer name of max_tokens; a chat runs to the end of the context by default.
    # 0 only scores the prompt: a completion's with echo (as lm-evaluation-harness asks for log-likelihoods).
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, param, (int,), "a positive integer")
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise invalid(f"{param} must be a positive integer (0 only with echo: true) (got {max_tokens})", param)
    longest = max(len(ids) for ids in prompts)
    if max_tokens is None:
        max_tokens = max(max_seq_len - longest, 1) if chat else COMPLETION_DEFAULT_MAX_TOKENS
    if longest + max_tokens > max_seq_len:
        raise invalid(f"the prompt is {longest} tokens: with {param} {max_tokens} that makes "
                      f"{longest + max_tokens}, past the server's max_seq_len {max_seq_len}", param,
                      "context_length_exceeded")
    # The sampling settings in the API's terms (a temperature up to 2, a seed an int32 makes a key of);
    # the library's ranges for them are the engine's check.
    temperature = _number(body, "temperature", 1.0, low=0, high=2)
    top_p = _field(body, "top_p", (int, float), "a number", 1.0)
    top_k = _field(body, "top_k", (int,), "an integer")
    seed = _number(body, "seed", None, low=0, high=SEED_LIMIT - 1, integer=True)
    seed = secrets.randbelow(SEED_LIMIT) if seed is None else seed
    stream = _field(body, "stream", (bool,), "true or false", False)
    options = _field(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise invalid("stream_options goes with stream: true", "stream_options")
    include_usage = _field(options, "include_usage", (bool,), "true or false", False)
    options = DecodeOptions(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            key=jax.random.key(seed))
    try:
        constraint = read_response_format(body.get("response_format"), tokenizer)
    except ValueError as e:
        raise invalid(str(e), "response_format") from None
    return Job(chat=chat, prompts=tuple(prompts), n=n, options=options, seed=seed, stop=_stops(body), stream=stream,
               include_usage=include_usage, logprobs=logprobs, echo=echo, constraint=constraint, tools=tools)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprob comes with, None for no logprobs: a completion's
    `logprobs` (an integer), a chat's `top_logprobs` where `logprobs` is true."""
    if not chat:
        return _number(body, "logprobs", None, low=0, high=MAX_LOGPROBS, integer=True)
    top = _number(body, "top_logprobs", None, low=0, high=MAX_LOGPROBS, integer=True)
    if not _field(body, "logprobs", (bool,), "true or false", False):
        if top:
            raise invalid("top_logprobs goes with logprobs: true", "top_logprobs")
        return None
    return top or 0


def read_tokenize(body, tokenizer: Tokenizer, max_seq_len: int) -> dict:
    """`POST /tokenize`'s answer to `body`: the ids of its `prompt` (a string; framed as a
    completion's, unless `add_special_tokens` is false) or of its `messages` (through the
    chat template, as a chat request's prompt), as `{"tokens", "count", "max_model_len"}`.

    Raises:
      ApiError: 400 naming the field.
    """
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    if ("prompt" in body) == ("messages" in body):
        raise invalid("give prompt (a string) or messages, one of them", "prompt")
    if "messages" in body:
        ids = _chat_ids(body, tokenizer)
    else:
        prompt = _field(body, "prompt", (str,), "a string")
        if prompt is None:
            raise invalid("prompt must be a string", "prompt")
        framed = _field(body, "add_special_tokens", (bool,), "true or false", True)
        try:
            ids = tokenizer.encode(prompt, add_special_tokens=framed)
        except ValueError as e:
            raise invalid(str(e), "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": max_seq_len}


def read_detokenize(body, tokenizer: Tokenizer) -> dict:
    """`POST /detokenize`'s answer to `body`: the text of its `tokens` (ids of the
    vocabulary, special tokens spelled out), as `{"prompt": text}`.

    Raises:
      ApiError: 400 naming `tokens`.
    """
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    ids = body.get("tokens")
    rule = f"a list of token ids in [0, {tokenizer.vocab_size})"
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise invalid(f"tokens must be {rule} (got {shown(ids)})", "tokens")
    outside = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if outside:
        raise invalid(f"tokens must be {rule} (got {shown(outside)} among them)", "tokens")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise invalid(f"stop must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them", "stop")
    return tuple(stops)


class StopText:
    """A job's text as its tokens arrive, cut before the first of its stop strings to appear.

    Text that could be the start of a stop string is held back until the next tokens show
    whether it is one, so no piece of a stop string is ever sent, even one that spans tokens.
    The stop strings are matched a character at a time (`_Matcher`), so each token costs
    its own characters, however long the stop strings and the text: a stop string of a
    million characters costs no more than one of ten. The text ends before the stop string
    that is completed first (at the same character: the longest); which tokens carry the
    characters does not change where it ends.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: tuple[str, ...]):
        self._stream = TextStream(tokenizer, prompt_ids)
        self._matchers = [_Matcher(stop) for stop in stops]
        self._pending: collections.deque[str] = collections.deque()  # text seen but not yet released
        self._seen = self._released = 0  # characters fed to the matchers, and handed out
        self.stopped = False  # a stop string was found: the text is complete

    def push(self, ids) -> str:
        """The text the new ids release ('' while it might begin a stop string)."""
        return self._release(self._stream.push(ids), final=False)

    def finish(self) -> str:
        """The rest of the text once the tokens end."""
        return self._release(self._stream.finish(), final=True)

    def _release(self, piece: str, final: bool) -> str:
        if not self._matchers:
            return piece  # (no stop string: nothing is ever held back, nor any character looked at)
        if self.stopped:
            return ""
        self._pending.append(piece)
        for char in piece:
            self._seen += 1
            done = [m.stop for m in self._matchers if m.feed(char)]
            if done:  # a stop string ends here: the text ends where the longest of them begins
                self.stopped = True
                return self._take(self._seen - max(len(stop) for stop in done) - self._released)
        # Hold back the longest end of the text that a stop string begins with.
        held = 0 if final else max((m.matched for m in self._matchers), default=0)
        return self._take(self._seen - held - self._released)

    def _take(self, n: int) -> str:
        """The next `n` characters of the pending text, handed out."""
        out = []
        self._released += n
        while n > 0:
            head = self._pending.popleft()
            if len(head) > n:
                self._pending.appendleft(head[n:])
                head = head[:n]
            out.append(head)
            n -= len(head)
        return "".join(out)


class _Matcher:
    """Knuth-Morris-Pratt over a stream of characters: `matched` is the length of the longest
    prefix of `stop` that the text fed so far ends with. Its failure table (`_border[k]`: the
    longest proper prefix of `stop[:k + 1]` that is also its suffix) is extended only as far
    as `matched` reaches, so the work is linear in the characters fed, whatever `len(stop)`."""

    def __init__(self, stop: str):
        self.stop, self.matched = stop, 0
        self._border: list[int] = [0]

    def _fallback(self, k: int) -> int:
        """`_border[k - 1]`, the table computed up to it first."""
        while len(self._border) < k:
            i, j = len(self._border), self._border[-1]
            while j and self.stop[i] != self.stop[j]:
                j = self._border[j - 1]
            self._border.append(j + (self.stop[i] == self.stop[j]))
        return self._border[k - 1]

    def feed(self, char: str) -> bool:
        """Takes the next character; True when it completes `stop`."""
        while self.matched and self.stop[self.matched] != char:
            self.matched = self._fallback(self.matched)
        if self.stop[self.matched] == char:
            self.matched += 1
        if self.matched == len(self.stop):
            self.matched = self._fallback(self.matched)
            return True
        return False


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """A token's own text, as a logprob names it (special tokens spelled out)."""
    return tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, scored: list[tuple[int, TokenLogprob | None]], offset: int = 0
                        ) -> dict:
    """A completion's `logprobs` of `scored`, `(token, its TokenLogprob)` in order (None: a prompt's
    first token, which nothing predicts): the tokens' texts, their logprobs, the alternatives as
    `{text: logprob}`, and where each token's text begins, counted from `offset`."""
    texts = [token_text(tokenizer, token) for token, _ in scored]
    offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [None if r is None else r.logprob for _, r in scored],
            "top_logprobs": [None if r is None else {token_text(tokenizer, t): v for t, v in r.top} for _, r in scored],
            "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, scored: list[TokenLogprob]) -> dict:
    """A chat's `logprobs`: each token's text, logprob and UTF-8 bytes, with its `top_logprobs`."""
    def entry(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, v) for t, v in r.top]}
                        for r in scored]}


def completion_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """The `usage` object; `cached_tokens`: prompt tokens copied from the prefix cache, not prefilled."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclasses.dataclass(frozen=True)
class Choice:
    """One choice's whole answer: its text, why it ended, its `logprobs` body (None if not asked),
    and the tool calls read from it (its text then what is left: `tools.parse_tool_calls`)."""

    text: str | None
    finish_reason: str
    logprobs: dict | None = None
    tool_calls: tuple[dict, ...] = ()


def response(job: Job, rid: str, model: str, choices: list[Choice], tokens: tuple[int, int, int]) -> dict:
    """The whole answer of a request that did not stream."""
    def body(index: int, choice: Choice) -> dict:
        calls = {"tool_calls": list(choice.tool_calls)} if choice.tool_calls else {}
        message = {"role": "assistant", "content": choice.text, **calls}
        said = {"message": message} if job.chat else {"text": choice.text}
        return {"index": index, **said, "logprobs": choice.logprobs, "finish_reason": choice.finish_reason}

    return {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [body(i, choice) for i, choice in enumerate(choices)], "usage": usage(*tokens)}


def chunk(job: Job, rid: str, model: str, index: int, text: str | None, finish_reason: str | None = None, *,
          first: bool = False, logprobs: dict | None = None, tool_calls: tuple[dict, ...] = ()) -> dict:
    """One streamed piece of choice `index`: `text` added (a chat's first chunk also names the role;
    `tool_calls`, a chat's calls, each with its `index`)."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    body = {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [{**choice, "logprobs": logprobs, "finish_reason": finish_reason}]}
    return {**body, "usage": None} if job.include_usage else body


def usage_chunk(job: Job, rid: str, model: str, tokens: tuple[int, int, int]) -> dict:
    """The last chunk `stream_options.include_usage` asks for: no choices, the usage (`tokens`:
    `usage`'s arguments)."""
    return {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(*tokens)}
