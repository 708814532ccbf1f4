"""The HTTP layer: a Starlette app over one `Engine`, speaking the OpenAI API (`openai_api`).

Each request is read and checked, submitted, and answered from the engine's events, which
its thread hands to the event loop (`call_soon_threadsafe`). A client that goes away
cancels its request, which frees its row at the engine's next turn. Every refusal is an
OpenAI error body; a client's error is answered, never logged with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import weakref

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from jaxformer.serving.engine import Engine, EngineClosed, Event, QueueFull
from jaxformer.serving.metrics import CountRequests, ServerMetrics
from jaxformer.serving.openai_api import (
    ApiError,
    Choice,
    Job,
    StopText,
    chat_logprobs,
    chunk,
    completion_id,
    completion_logprobs,
    error_body,
    read_detokenize,
    read_job,
    read_tokenize,
    response,
    shown,
    usage_chunk,
)
from jaxformer.serving.tools import parse_tool_calls
from jaxformer.text.tokenizer import Tokenizer

LOG = logging.getLogger("jaxformer.serve")
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
DISCONNECT_POLL_S = 0.5  # how often a request that does not stream checks that its client is still there
BODY_TIMEOUT_S = 30.0  # how long a request's body may take to arrive


# The paths /metrics counts requests of by name (any other, "other").
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def create_app(engine: Engine, tokenizer: Tokenizer, model_name: str, *, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, body_timeout_s: float = BODY_TIMEOUT_S, on_shutdown=()) -> Starlette:
    """The OpenAI-compatible app serving `engine` as the model `model_name`.

    Args:
      api_key: if given, every /v1 request needs `Authorization: Bearer <api_key>`.
      max_body_bytes: the largest request body read; a longer one is refused (413).
      body_timeout_s: how long a request's body may take to arrive (408 past it).
      on_shutdown: callables run when the server stops (the CLI closes the engine there).

    The app's `state.abort(reason)` ends every request being answered now, each with a
    final error event (a stream) or a 503 (the others): what a second Ctrl-C does.
    """
    created = int(time.time())
    runs: weakref.WeakSet[Run] = weakref.WeakSet()  # the requests being answered (one never started is dropped)
    metrics = ServerMetrics(ROUTES)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": model_name, **engine.load()})

    async def models(request: Request) -> JSONResponse:
        authorize(request, api_key)
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "jaxformer"}]})

    async def model(request: Request) -> JSONResponse:
        authorize(request, api_key)
        name = request.path_params["name"]
        if name != model_name:
            raise ApiError(404, f"the model {shown(name)} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return JSONResponse({"id": model_name, "object": "model", "created": created, "owned_by": "jaxformer"})

    async def metrics_page(request: Request) -> PlainTextResponse:
        return PlainTextResponse(metrics.text(engine.load()), media_type="text/plain; version=0.0.4")

    async def tokenize(request: Request) -> JSONResponse:
        authorize(request, api_key)
        body = await read_body(request, max_body_bytes, body_timeout_s)
        return JSONResponse(await asyncio.to_thread(read_tokenize, body, tokenizer, engine.capacity))

    async def detokenize(request: Request) -> JSONResponse:
        authorize(request, api_key)
        body = await read_body(request, max_body_bytes, body_timeout_s)
        return JSONResponse(await asyncio.to_thread(read_detokenize, body, tokenizer))

    async def completions(request: Request):
        return await answer(request, chat=False)

    async def chat_completions(request: Request):
        return await answer(request, chat=True)

    async def answer(request: Request, chat: bool):
        authorize(request, api_key)
        body = await read_body(request, max_body_bytes, body_timeout_s)
        # Off the event loop: a long prompt's template and tokenizer would hold up every other request.
        job = await asyncio.to_thread(read_job, body, chat=chat, tokenizer=tokenizer, model_name=model_name,
                                      max_seq_len=engine.capacity, max_choices=engine.max_queue + engine.max_batch)
        started: list[Run] = []
        try:
            for choice in range(job.choices):  # (each choice a request of the engine's, `index` in order)
                started.append(Run(engine, tokenizer, job, choice, runs, metrics))
        except ApiError:
            for run in started:  # (the request is refused whole)
                run.cancel()
            raise
        rid = completion_id(chat)
        if job.stream:
            return StreamingResponse(sse(job, started, rid, model_name), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        choices = await asyncio.gather(*(run.answer(request) for run in started))
        for run in started:
            if run.aborted:
                raise ApiError(503, run.error, kind="server_error")
            if run.error is not None:
                raise ApiError(500, run.error, kind="server_error")
        return JSONResponse(response(job, rid, model_name, choices, counted(job, started)))

    def abort(reason: str) -> int:
        """Ends every request being answered with `reason`; returns how many there were."""
        running = list(runs)
        for run in running:
            run.abort(reason)
        return len(running)

    routes = [Route("/health", health), Route("/v1/models", models), Route("/v1/models/{name:path}", model),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
              Route("/metrics", metrics_page),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    handlers = {ApiError: api_error, HTTPException: http_error}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        for stop in on_shutdown:  # (after the server has answered every open request)
            await asyncio.to_thread(stop)

    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[Middleware(CountRequests, metrics=metrics)])
    app.state.abort = abort
    return app


def authorize(request: Request, api_key: str | None) -> None:
    """A 401 unless the request carries the key (compared in constant time), where one is set."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key")


async def read_body(request: Request, limit: int, timeout_s: float):
    """The body as JSON, read up to `limit` bytes within `timeout_s` seconds: 413 past the
    size, 408 past the time, 400 if it is not JSON (or nests deeper than Python's parser goes),
    or if the client closed the connection before the body it announced had come."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared):,} bytes, more than the {limit:,} this server reads")

    async def read() -> bytearray:
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise ApiError(413, f"the request body is more than the {limit:,} bytes this server reads")
        return data

    try:
        data = await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    except ClientDisconnect:  # (the answer reaches no one; it only keeps the log quiet)
        raise ApiError(400, "the client closed the connection before its request body ended") from None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON here: it nests deeper than this server parses") \
            from None


def counted(job: Job, runs: list["Run"]) -> tuple[int, int, int]:
    """A request's usage, `(prompt, completion, cached)` tokens: each prompt counted once however
    many its choices, its cached tokens those of its first choice (the others copy its prefill)."""
    first = runs[::job.n]
    return (sum(len(ids) for ids in job.prompts), sum(run.completion_tokens for run in runs),
            sum(run.handle.cached for run in first))


class Run:
    """One choice of a job on the engine, its events turned into text pieces (`pieces`);
    afterwards `finish_reason`, `completion_tokens` and `error` (a failure of this choice alone,
    or with `aborted` the server's stop). It is in `runs` while its answer is under way."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, job: Job, choice: int, runs: weakref.WeakSet,
                 metrics: ServerMetrics):
        self.job, self.choice, self._tokenizer, self._metrics = job, choice, tokenizer, metrics
        self.finish_reason, self.completion_tokens, self.error, self.aborted = None, 0, None, False
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._runs, self._abort = runs, None
        self.prompt = job.prompt_of(choice)
        loop = asyncio.get_running_loop()
        constraint = None if job.constraint is None else job.constraint(engine.vocab_size)  # (a row's own)
        try:
            self.handle = engine.submit(self.prompt, job.choice_options(choice),
                                        listener=lambda event: loop.call_soon_threadsafe(self._events.put_nowait,
                                                                                         event),
                                        logprobs=job.logprobs, prompt_logprobs=job.echo and job.logprobs is not None,
                                        constraint=constraint)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", kind="rate_limit_error", code="queue_full") from None
        except EngineClosed as e:
            raise ApiError(503, str(e), kind="server_error") from None
        except ValueError as e:  # (read_job read the body in the API's terms; this is the library's check)
            raise ApiError(400, str(e)) from None
        self.text = StopText(tokenizer, self.prompt, job.stop)  # (its decoder reads only ids the engine took)
        metrics.tokens(prompt=len(self.prompt))
        self._last_token_at, self._submitted_at = None, time.monotonic()
        runs.add(self)

    def cancel(self) -> None:
        """Withdraws a choice whose answer will not be given (its request was refused whole)."""
        self.handle.cancel()
        self._runs.discard(self)

    def abort(self, reason: str) -> None:
        """Ends the answer now with `reason` as its error (unless it has ended already): the
        engine's row is freed, and the client gets a last event (or a 503) instead of the
        rest of the text."""
        self.handle.cancel()
        self._abort = Event(finish_reason="error", error=reason)
        self._events.put_nowait(self._abort)

    def logprobs(self, scored: list, offset: int = 0) -> dict | None:
        """The API's `logprobs` of `scored`, `(token, TokenLogprob)` pairs; None if not asked for."""
        if self.job.logprobs is None:
            return None
        if self.job.chat:
            return chat_logprobs(self._tokenizer, [record for _, record in scored])
        return completion_logprobs(self._tokenizer, scored, offset)

    async def answer(self, watch: Request) -> Choice:
        """The whole answer, as the choice of a response that does not stream."""
        texts, scored = [], []
        async for text, pairs in self.pieces(watch):
            texts.append(text)
            scored += pairs
        if self.job.tools:
            return self.called("".join(texts), self.logprobs(scored))
        return Choice("".join(texts), self.finish_reason, self.logprobs(scored))

    def called(self, text: str, logprobs: dict | None = None) -> Choice:
        """The answer `text` with the tool calls read from it (finish_reason "tool_calls" if any)."""
        content, calls = parse_tool_calls(text)
        return Choice(content, "tool_calls" if calls else self.finish_reason, logprobs, tuple(calls))

    async def pieces(self, watch: Request | None = None):
        """`(text, scored)` as they come, until the job ends: the text added and the `(token,
        TokenLogprob)` of the tokens that brought it (with echo, first the prompt's, its first
        token's None); `watch`: a request to poll for a disconnect (a streamed response is
        cancelled by the server instead)."""
        echo_scores = self.job.echo and self.job.logprobs is not None  # (else the prompt's text comes at once)
        if self.job.echo and not echo_scores:
            yield self._tokenizer.decode(self.prompt), []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self._events.get(), DISCONNECT_POLL_S if watch else None)
                except asyncio.TimeoutError:
                    if await watch.is_disconnected():
                        return
                    continue
                if event.prompt_logprobs is not None:
                    yield self._tokenizer.decode(self.prompt), list(zip(self.prompt, event.prompt_logprobs))
                self.completion_tokens += len(event.tokens)
                if event.tokens:
                    self._timed(len(event.tokens))
                scored = list(zip(event.tokens, event.logprobs)) if echo_scores or event.logprobs else []
                piece = self.text.push(event.tokens) if event.tokens else ""
                if event.finish_reason is None and not self.text.stopped:
                    if piece or scored:
                        yield piece, scored
                    continue
                if self.text.stopped:  # a stop string: the rest is not wanted
                    self.finish_reason = "stop"
                    yield piece, scored
                    return
                if event.finish_reason == "stop" and not event.tokens:
                    self.completion_tokens += 1  # the stop id: made, not shown (a grammar's end brings a token)
                self.finish_reason, self.error, self.aborted = event.finish_reason, event.error, event is self._abort
                piece += self.text.finish()
                if self.text.stopped:  # a stop string in the text's last characters
                    self.finish_reason = "stop"
                yield piece, scored
                return
        finally:
            self.handle.cancel()  # (done already, or a stop string, or the client left: the row is freed)
            self._runs.discard(self)
            self._metrics.tokens(completion=self.completion_tokens)

    def _timed(self, count: int) -> None:
        """Notes when `count` new tokens came: the first, from the submission; later ones, from the last."""
        now = time.monotonic()
        if self._last_token_at is None:
            self._metrics.first_token(now - self._submitted_at)
        else:
            self._metrics.per_token(now - self._last_token_at, count)
        self._last_token_at = now


async def sse(job: Job, runs: list[Run], rid: str, model: str):
    """A job's answer as server-sent events, its choices' chunks as they come, ending `data:
    [DONE]` (an error in any choice: an error event, and the others are stopped)."""
    def event(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    pieces: asyncio.Queue = asyncio.Queue()  # (choice, text, scored), then (choice, None, None) at its end

    async def feed(index: int, run: Run):
        try:
            async for text, scored in run.pieces():
                await pieces.put((index, text, scored))
        finally:
            await pieces.put((index, None, None))

    tasks = [asyncio.create_task(feed(index, run)) for index, run in enumerate(runs)]
    try:
        if job.chat:
            for index in range(len(runs)):
                yield event(chunk(job, rid, model, index, None, first=True))
        offsets, open_choices = [0] * len(runs), len(runs)  # (a completion's logprobs count characters of its text)
        held = [""] * len(runs)  # with tools, a choice's text until its end: its calls are read from the whole
        while open_choices:
            index, text, scored = await pieces.get()
            run = runs[index]
            if text is None:
                open_choices -= 1
                if run.error is not None:
                    yield event(error_body(run.error, "server_error"))
                    return
                finish_reason = run.finish_reason
                if job.tools:
                    answer = run.called(held[index])
                    if answer.text:
                        yield event(chunk(job, rid, model, index, answer.text))
                    if answer.tool_calls:
                        yield event(chunk(job, rid, model, index, None, tool_calls=answer.tool_calls))
                    finish_reason = answer.finish_reason
                yield event(chunk(job, rid, model, index, None if job.chat else "", finish_reason))
                continue
            if job.tools:
                held[index] += text
                text = ""
            if text or scored:
                yield event(chunk(job, rid, model, index, text, logprobs=run.logprobs(scored, offsets[index])))
            offsets[index] += len(text)
        if job.include_usage:
            yield event(usage_chunk(job, rid, model, counted(job, runs)))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, a method not allowed) in the OpenAI shape."""
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", kind), status_code=e.status_code,
                        headers=e.headers)
