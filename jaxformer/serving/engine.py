"""Continuous batching: one engine owns the model, requests join and leave a running batch.

The batch is a `KVCache` of `max_batch` rows, each a slot a request holds while it decodes.
Every turn of the engine's loop (docs/serving.md, "The engine's turn"):

  1. cancelled requests leave; waiting ones take the free slots;
  2. the prompts of new requests are prefilled, each alone in a one-row cache, at most
     `prefill_chunk` tokens this turn (a long prompt takes several turns, so the streams
     already running wait for one chunk, not for the whole prompt); a prompt done
     samples its first token and its row is copied into the batch (`KVCache.insert`);
     a whole chunk of the first prompt waiting, while rows are running, rides with step 3:
     one call of the model for both (the `Decoder`'s groups of rows), so the chunk's matrix
     products carry the step's and the weights are read once;
  3. one jitted step decodes a token for each of the first rows, as few (1, 2, 4, ..., max_batch)
     as hold the running requests (a free row's token among them is thrown away; the slot each
     row wrote is copied back into the batch, `KVCache.with_steps_of`), its attention reading
     the cache's first slots only, the span that holds the longest of them (`cache.spans`: 256,
     512, ..., capacity), so a step costs what the rows hold.

Shapes stay static: the step sees one of those row counts and spans, and a prefill piece is a power of
two up to `prefill_chunk` tokens (a prompt of 100 with chunks of 64 goes in as 64 and 36
padded to 64: each call reads every weight once, so fewer calls are cheaper than no
padding), so `warmup` compiles every program the engine will run: `Engine._calls` lists each
program at each shape serving calls it at, and `warmup` runs that list. The programs take named
inputs (`Rows`, `Picking`, `Piece`, the caches by name) and return named outputs. The rows'
sampling settings are one `Sampling` and their keys one array: a new request changes values,
not shapes. Row r's token i is drawn with `fold_in(key, i)`, its request's key
(`steps.pick_rows`), so a request's draws do not depend on who shares its batch. The model's
calls and the token's pick are the decoding library's (`steps.prefill_piece`, `steps.step_fn`,
`steps.pick_rows`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import itertools
import queue
import threading
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxformer.cache import span_for, spans
from jaxformer.decodable import Decodable
from jaxformer.decoding.request import DecodeOptions
from jaxformer.decoding.sampling import Sampling, log_probabilities
from jaxformer.decoding.steps import NO_TOKEN, NonFiniteLogitsError, pick_rows, prefill_piece, step_fn
from jaxformer.serving.prefixes import PrefixCache, restored, shared_start
from jaxformer.validation import as_int, python_int

# `DecodeOptions` the engine does not take: its stop ids are the engine's, and a request is one
# prompt decoded a token per step. A value other than the default is refused.
NOT_SERVED = ("eos_id", "pad_id", "bos_id", "prompt_lengths", "num_beams", "length_penalty")
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (the OpenAI API's limit)


class QueueFull(RuntimeError):
    """More requests are waiting than the engine's queue holds; try again later."""


class EngineClosed(RuntimeError):
    """The engine is shutting down and takes no new requests."""


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability (`sampling.log_probabilities`: after the request's temperature)
    and the `top` likeliest tokens at its position as `(id, logprob)`, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request hears from the engine, in order: its prompt's logprobs if it asked
    (`prompt_logprobs`, one per prompt token, None for the first, which nothing predicts),
    tokens as they are made (with `logprobs`, one each, if it asked), then one last event with
    `finish_reason` "stop" (a stop id, which `tokens` leaves out), "length" (`max_tokens`),
    "cancelled" or "error" (with `error`: what went wrong, for this request alone)."""

    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    stop_id: int | None = None  # with finish_reason "stop" by a stop id: that id


class Handle:
    """A submitted request: its events (`events()`, or the `listener` given to `submit`) and
    `cancel()`, which frees its slot at the engine's next turn."""

    def __init__(self, prompt: list[int], max_tokens: int, sampling: Sampling, key: np.ndarray, listener,
                 logprobs: int | None = None, prompt_logprobs: bool = False, constraint=None):
        self.prompt, self.max_tokens, self.constraint = prompt, max_tokens, constraint
        self.sampling, self.key = sampling, key  # its row's: a one-row `Sampling`, its key's data
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs
        self.scored: list[TokenLogprob | None] = [None]  # the prompt's logprobs so far (`prompt_logprobs`)
        self.cached = 0  # prompt tokens copied from the prefix cache rather than prefilled
        self.made = 0  # tokens made so far, the stopping one included
        self.cancelled = threading.Event()
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._listener = listener or self._queue.put

    @property
    def wanted(self) -> int:
        """What the engine's programs score for it: 0 nothing, 1 its tokens' logprobs, 2 with the top ones."""
        return 0 if self.logprobs is None else 1 if self.logprobs == 0 else 2

    def logprob(self, token: int, logprob, top_ids, top_logprobs) -> TokenLogprob:
        """A `TokenLogprob` of what a program scored, its top cut to the `logprobs` asked for."""
        top = tuple((int(i), float(v)) for i, v in zip(top_ids[:self.logprobs], top_logprobs[:self.logprobs]))
        return TokenLogprob(token, float(logprob), top)

    def cancel(self) -> None:
        self.cancelled.set()

    def events(self) -> Iterator[Event]:
        """The events as they come (blocking), the last one with a `finish_reason`."""
        while True:
            event = self._queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def result(self) -> tuple[list[int], str, str | None]:
        """`(tokens, finish_reason, error)` once the request is done."""
        tokens, last = [], None
        for last in self.events():
            tokens += last.tokens
        return tokens, last.finish_reason, last.error

    def _send(self, event: Event) -> None:
        self._listener(event)


@dataclasses.dataclass
class _Slot:
    """A request in a row of the batch: still prefilling (`prefilled < len(prompt)`) or decoding."""

    handle: Handle
    order: int  # when it was admitted: prompts are prefilled first come, first served
    cache: object = None  # the one-row cache its prompt is prefilled into
    prefilled: int = 0
    token: int = 0  # its last token, the next step's input


# The programs' inputs, by name. A cache is not among them: each program takes its caches as
# arguments of their own, `cache` (the batch's) and `row` (a prompt's one-row cache), donated
# and given back under those names; what these structures hold is only read.


@struct.dataclass
class Picking:
    """What picks and scores the next token of each of `rows` rows (`steps.pick_rows`): the same
    for the step's rows and for a prompt's first token. A new request changes its values, not
    its shapes."""

    sampling: Sampling  # the rows' settings, a row each (a free row greedy)
    keys: jax.Array  # [rows, ...] uint32: each row's request key's data (a free row's unused)
    made: jax.Array  # [rows] int32: tokens each row has made, the index of the one drawn now
    allowed: jax.Array  # [rows, vocab] bool: the ids each row's constraint allows (all, without one)
    wanted: jax.Array  # [] int32: what is scored (`Handle.wanted`, the most of the rows'): 0 nothing


@struct.dataclass
class Rows:
    """The decode step's inputs: the first `rows` rows of the batch, as few as hold every
    running request (a count of `Engine._row_counts`), a free row among them decoding too."""

    tokens: jax.Array  # [rows] int32: each row's last token, the one the step reads
    active: jax.Array  # [rows] bool: whether a request runs in the row
    picking: Picking  # how each row's next token is picked
    # Slots attention reads, 0 .. span - 1 (one of `cache.spans`): static, as its shapes
    # follow it, so each span is a program of its own.
    span: int = struct.field(pytree_node=False)


@struct.dataclass
class Piece:
    """A piece of a prompt (`pieces`), run into its row's cache: `n` tokens, a power of two,
    the first `real` of them the prompt's and the rest padding."""

    tokens: jax.Array  # [1, n] int32: the prompt's next `real` ids, then padding
    real: jax.Array  # [] int32: how many of `tokens` are the prompt's (1 .. n)
    targets: jax.Array  # [1, n] int32: the prompt's id after each position, which its logits score
    temperature: jax.Array  # [1] float32: the request's, which its logprobs are taken after
    wanted: jax.Array  # [] int32: what is scored (`Handle.wanted` if it asked for the prompt's; else 0)


def pieces(n_tokens: int, chunk: int, room: int) -> list[tuple[int, int]]:
    """The prefill's pieces for `n_tokens` as `(size, real)`: chunks of `chunk` (a power of two),
    then the rest as one piece padded up to a power of two, `real` of its tokens the prompt's
    (`pieces(100, 64, 256)` is `[(64, 64), (64, 36)]`). Where the padding would pass `room`, the
    positions the cache has left, the rest goes in as its binary digits instead, unpadded."""
    whole, rest = divmod(n_tokens, chunk)
    out = [(chunk, chunk)] * whole
    if rest and whole * chunk + (padded := 1 << (rest - 1).bit_length()) <= room:
        return out + [(padded, rest)]
    return out + [(1 << bit, 1 << bit) for bit in reversed(range(rest.bit_length())) if rest >> bit & 1]


def check_served(options: DecodeOptions) -> None:
    """Raises `ValueError` naming the first field of `NOT_SERVED` that `options` sets."""
    defaults = DecodeOptions(max_new_tokens=options.max_new_tokens)
    for name in NOT_SERVED:
        value, default = getattr(options, name), getattr(defaults, name)
        if value is not None if default is None else np.any(np.asarray(value) != default):
            raise ValueError(f"the engine does not take {name}: leave it at {default!r} (got {value!r})")


class Engine:
    """Decodes many requests at once on one device, taking them in and letting them out at every step.

    Args:
      model: a `Decodable` that continues its prompt (`DecodingSpec.supports_speculative`: a `Decoder`).
      params: its parameters.
      max_batch: rows decoded together (requests running at once).
      capacity: positions a request may fill, prompt and completion together; default and at
        most the model's `max_seq_len`.
      prefill_chunk: the most prompt tokens prefilled in one turn of the loop, a power of two.
      max_queue: requests that may wait for a slot; one more raises `QueueFull`.
      stop_ids: ids that end a request (the tokenizer's EOS ids).
      prefix_cache_bytes: memory for prompts' prefilled caches (`prefixes.PrefixCache`), which
        later prompts that begin the same way copy; 0: no prefix cache.
    """

    def __init__(self, model: Decodable, params, *, max_batch: int = 8, capacity: int | None = None,
                 prefill_chunk: int = 64, max_queue: int = 64, stop_ids: Sequence[int] = (),
                 prefix_cache_bytes: int = 0):
        spec = model.decoding_spec()
        if not spec.supports_speculative:  # (a prompt prefilled in pieces, into the cache its steps read)
            raise ValueError("the engine serves a model that continues its prompt (DecodingSpec.supports_speculative, "
                             "as the decoder-only Decoder)")
        self.model, self.params, self.vocab_size = model, params, spec.vocab_size
        self.max_batch = as_int(max_batch, "max_batch", minimum=1)
        self.capacity = as_int(spec.max_seq_len if capacity is None else capacity, "capacity", minimum=1,
                               maximum=spec.max_seq_len, maximum_name="max_seq_len")
        self.prefill_chunk = as_int(prefill_chunk, "prefill_chunk", minimum=1)
        if self.prefill_chunk & (self.prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two (got {prefill_chunk})")
        self.max_queue = as_int(max_queue, "max_queue", minimum=0)
        self.stop_ids = frozenset(int(i) for i in stop_ids)
        for i in self.stop_ids:
            as_int(i, "stop_ids", minimum=0, maximum=spec.vocab_size - 1, maximum_name="vocab_size - 1")
        # The step decodes the first 1, 2, 4, ... rows, as few as hold the running requests.
        self._row_counts = sorted({1 << bit for bit in range(self.max_batch.bit_length())
                                   if 1 << bit < self.max_batch} | {self.max_batch})
        # A free row decodes greedily (the step skips the sort when no row samples), with an unused key.
        self._free_row = (Sampling.create(1, spec.vocab_size), np.asarray(jax.random.key_data(jax.random.key(0))))
        self._compile()
        self._cache = model.init_cache(self.max_batch, self.capacity)
        self._prefixes = PrefixCache(as_int(prefix_cache_bytes, "prefix_cache_bytes", minimum=0))
        # An entry with rings is reused while whole; one with states (a linear layer's) only whole: a state
        # holds every token it read, and cannot be set back (a ring of no slots, for `PrefixCache.longest`).
        self._ring = 0 if spec.keeps_state else min(self._cache.ring_slots, default=None)
        # Prompts started, those that began from a cached prefix, the tokens copied so and those prefilled,
        # and the pieces prefilled in the same call as a decode step.
        self._prefill_counts = collections.Counter(prompts=0, prefix_hits=0, cached_tokens=0, prefilled_tokens=0,
                                                   pieces_with_decode=0)
        self._slots: list[_Slot | None] = [None] * self.max_batch
        self._waiting: collections.deque[Handle] = collections.deque()
        self._finished: collections.Counter[str] = collections.Counter()  # requests ended, by finish_reason
        self._admitted = itertools.count()
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="jaxformer-engine", daemon=True)
        self._thread.start()

    # The compiled programs, made once: every call reuses them (`warmup` runs each at every shape).

    def _compile(self) -> None:
        model, capacity = self.model, self.capacity
        top = min(MAX_LOGPROBS, self.vocab_size)

        def scores(logits, temperature, ids, wanted):
            """`(logprob of ids [...], top ids [..., top], their logprobs)` from `logits` `[..., vocab]`;
            `wanted` (`Handle.wanted`, the most of the rows'): 0 skips it all, 1 the top."""
            blank = (jnp.zeros(ids.shape, jnp.float32), jnp.zeros(ids.shape + (top,), jnp.int32),
                     jnp.zeros(ids.shape + (top,), jnp.float32))

            def chosen(with_top: bool):
                logprobs = log_probabilities(logits, temperature)  # [..., vocab]
                picked = jnp.take_along_axis(logprobs, jnp.maximum(ids, 0)[..., None], axis=-1)[..., 0]
                if not with_top:
                    return picked, *blank[1:]
                values, best = jax.lax.top_k(logprobs, top)
                return picked, best.astype(jnp.int32), values

            return jax.lax.switch(wanted, (lambda: blank, lambda: chosen(False), lambda: chosen(True)))

        def pick(picking, last_logits):  # last_logits [rows, vocab]: each row's, at its last position
            token = pick_rows(picking.sampling, jax.random.wrap_key_data(picking.keys), picking.made, last_logits,
                              picking.allowed)
            return {"token": token, "scores": scores(last_logits, picking.sampling.temperature, token, picking.wanted)}

        def piece_out(logits, piece):  # logits [1, n, vocab]
            last = jax.lax.dynamic_index_in_dim(logits, piece.real - 1, axis=1, keepdims=False)  # [1, vocab]
            return {"last_logits": last, "piece_scores": scores(logits, piece.temperature, piece.targets, piece.wanted)}

        def piece(params, row, piece):
            logits, row = prefill_piece(model, params, piece.tokens, row, piece.real)
            return {**piece_out(logits, piece), "row": row}

        # The first `rows` of the batch decode (requests take the lowest free rows, so the busy
        # ones are there); a free row among them decodes too, from position 0, where it
        # overwrites nothing anyone reads: `insert` replaces the whole row when a request takes it.
        # Attention reads slots 0 .. span - 1 (static), which hold every running row's positions.
        def head_of(cache, rows):
            n = rows.active.shape[0]
            head = cache if n == cache.batch_size else jax.tree.map(lambda leaf: leaf[:n], cache)
            written = jnp.where(rows.active, head.pos, 0)  # [rows]: the position each row writes
            return head.replace(pos=written, span=rows.span), written

        def back(cache, head, written):
            head = head.replace(span=None)  # (the batch's cache keeps one layout between steps)
            # (Of fewer rows, the slot each row wrote goes back, not the rows' whole caches.)
            return head if head.batch_size == cache.batch_size else cache.with_steps_of(head, written)

        def step(params, cache, rows):
            head, written = head_of(cache, rows)
            # (Context None: a model that continues its prompt reads the cache alone, as in `prefill_piece`.)
            logits, head = step_fn(model, params, None)(rows.tokens[:, None], head)  # [rows, 1, vocab]
            return {**pick(rows.picking, logits[:, 0]), "cache": back(cache, head, written)}

        def fused(params, cache, rows, row, piece):
            # `step` and a prompt's `piece` in one call of the model: two groups of rows, each in its cache.
            head, written = head_of(cache, rows)
            end = row.pos + piece.real  # (as `prefill_piece`: the padding stays out of the rings, and is overwritten)
            (logits, piece_logits), (head, row) = step_fn(model, params, None)(
                (rows.tokens[:, None], piece.tokens), (head, row.replace(stop=end)))
            return {**pick(rows.picking, logits[:, 0]), "cache": back(cache, head, written),
                    **piece_out(piece_logits, piece), "row": row.replace(pos=end, stop=None)}

        # Every program the engine runs, by name. Each takes its inputs by name and returns a
        # dict of its outputs; a cache it writes comes back under the name it went in by (`cache`,
        # `row`) and is donated, the engine keeping only what comes back (the row an insert
        # reads is not: the prefix cache may hold it). `warmup` runs each at every shape `_calls`
        # lists, and a test checks that the list names every program here.
        self._programs = {
            "empty_row": jax.jit(lambda: {"row": model.init_cache(1, capacity)}),
            "piece": jax.jit(piece, donate_argnames="row"),
            "pick": jax.jit(pick),
            "step": jax.jit(step, donate_argnames="cache"),
            "fused": jax.jit(fused, donate_argnames=("cache", "row")),
            # (`index` is the engine's own row, in range: no guard, whose pass over the cache costs a step.)
            "insert": jax.jit(lambda cache, index, row: {"cache": cache.insert(index, row, guard=False)},
                              donate_argnames="cache"),
        }
        self._every_id = functools.cache(lambda rows: jnp.ones((rows, self.vocab_size), bool))

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> None:
        """Runs every call of `_calls` once, so that no request waits for a compile.

        A call's inputs that `_calls` leaves out are the engine's (its parameters, the batch's
        cache) or what the calls before it gave back (a prompt's `row`, its `last_logits`), by
        name; the batch's cache the last call gives back is the engine's again.

        Args:
          progress: called after each call with `(done, total, what it was)`: compiling
            for a long context takes minutes, and a command says how far it has come.
        """
        calls = self._calls()
        with self._lock:
            held = {"params": self.params, "cache": self._cache}
            for done, (name, what, inputs) in enumerate(calls, 1):
                program = self._programs[name]
                taken = {arg: held[arg] for arg in inspect.signature(program).parameters if arg not in inputs}
                if "row" in taken:  # (each call writes the row from position 0, so every piece fits in it)
                    taken["row"] = taken["row"].replace(pos=jnp.zeros_like(taken["row"].pos))
                held.update(jax.block_until_ready(program(**taken, **inputs)))
                if progress is not None:
                    progress(done, len(calls), what)
            self._cache = held["cache"]

    def _calls(self) -> list[tuple[str, str, dict]]:
        """Every call serving makes, one per shape, as `(program, what, inputs)`: the empty
        cache a prompt starts in; a piece of each size `pieces` cuts (1, 2, 4, ..., up to
        `prefill_chunk`); the pick of a prompt's first token; a step of each row count and
        span; a whole chunk riding with each of those steps; a row's insert into the batch.
        `warmup` runs them (filling in the inputs left out here), and tests check that they
        name every program of `_programs` and that serving compiles nothing more."""
        sizes = [1 << bit for bit in range(self.prefill_chunk.bit_length()) if 1 << bit <= self.capacity]
        steps = [(rows, span) for rows in self._row_counts for span in spans(self.capacity)]
        n = self.prefill_chunk
        rides = steps if n <= self.capacity else []  # (a whole chunk rides with a step)
        return ([("empty_row", "a prompt's empty cache", {})]
                + [("piece", f"prefill of {size} token{'s' * (size > 1)}", {"piece": self._blank_piece(size)})
                   for size in sizes]
                + [("pick", "sampling", {"picking": self._picking([None])})]
                + [("step", f"decode step of {rows} rows reading {span} slots", {"rows": self._free_rows(rows, span)})
                   for rows, span in steps]
                + [("fused", f"decode step of {rows} rows with a prefill of {n} reading {span} slots",
                    {"rows": self._free_rows(rows, span), "piece": self._blank_piece(n)}) for rows, span in rides]
                + [("insert", "row insert", {"index": np.int32(0)})])

    @staticmethod
    def _blank_piece(n: int) -> Piece:
        """A piece of `n` tokens, all real, that scores nothing: a piece's shapes, for `warmup`."""
        zeros = np.zeros((1, n), np.int32)
        return Piece(tokens=zeros, real=np.int32(n), targets=zeros, temperature=np.ones(1, np.float32),
                     wanted=np.int32(0))

    def _free_rows(self, rows: int, span: int) -> Rows:
        """The step's inputs for `rows` free rows reading `span` slots: its shapes, for `warmup`."""
        return Rows(tokens=np.zeros(rows, np.int32), active=np.zeros(rows, bool), picking=self._picking([None] * rows),
                    span=span)

    def _picking(self, handles: list[Handle | None]) -> Picking:
        """A `Picking` of a row per handle: its request's `Sampling` and key's data, the tokens
        it has made (the index of the one drawn next), and the ids its constraint allows next;
        a free row (None) is greedy and free. What is scored is the most any of them wants."""
        rows = [self._free_row + (0,) if h is None else (h.sampling, h.key, h.made) for h in handles]
        samplings, keys, made = zip(*rows)
        sampling = jax.tree.map(lambda *columns: np.concatenate(columns), *samplings)
        if all(h is None or h.constraint is None for h in handles):
            allowed = self._every_id(len(handles))  # (kept on the device: nothing to send)
        else:
            allowed = np.stack([np.ones(self.vocab_size, bool) if h is None or h.constraint is None
                                else h.constraint.allowed() for h in handles])
        wanted = max((h.wanted for h in handles if h is not None), default=0)
        return Picking(sampling=sampling, keys=np.stack(keys), made=np.asarray(made, np.int32), allowed=allowed,
                       wanted=np.int32(wanted))

    # The requests' side: any thread.

    def submit(self, prompt: Sequence[int], options: DecodeOptions, *,
               listener: Callable[[Event], None] | None = None, logprobs: int | None = None,
               prompt_logprobs: bool = False, constraint=None) -> Handle:
        """Queues a request: `prompt`'s ids continued by up to `options.max_new_tokens` tokens.

        Args:
          options: its `max_new_tokens` (0: the prompt is only scored), sampling settings and
            `key` (required to sample: the key of token i is `fold_in(key, i)`); the fields of
            `NOT_SERVED` stay at their defaults.
          listener: called with each `Event` on the engine's thread (it must not block); without
            one the events wait in the handle (`Handle.events`).
          logprobs: None, or each token's logprob with its `logprobs` (0 .. `MAX_LOGPROBS`)
            likeliest alternatives (`Event.logprobs`).
          prompt_logprobs: the same for the prompt's tokens (`Event.prompt_logprobs`); needs `logprobs`.
          constraint: a `constrained.Constraint` (its `allowed` ids are the only ones picked;
            the request stops when it `is_finished`), or None. Logprobs stay the model's own.

        Raises:
          ValueError: a bad argument, naming it and its limit (ids past the vocabulary, a prompt
            and `max_new_tokens` past the capacity), before the request is queued: the one check
            of a request, the server's included.
          QueueFull: `max_queue` requests wait already.
          EngineClosed: the engine is shutting down.
        """
        return self.submit_all([prompt], options, listener=listener, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs, constraint=constraint)[0]

    def submit_all(self, prompts: Sequence[Sequence[int]], options: DecodeOptions | Sequence[DecodeOptions], *,
                   listener: Callable[[Event], None] | None = None, logprobs: int | None = None,
                   prompt_logprobs: bool = False, constraint=None) -> list[Handle]:
        """`submit` of each of `prompts` (with `options`, or one `DecodeOptions` each), queued
        together once every one is checked: all or none, and in this order, so the engine takes
        them into its rows as it would the same list again (a run that samples many completions
        at once draws the same ones from the same keys and weights)."""
        options = [options] * len(prompts) if isinstance(options, DecodeOptions) else list(options)
        if len(options) != len(prompts):
            raise ValueError(f"options must be one DecodeOptions or one per prompt ({len(prompts)}), "
                             f"got {len(options)}")
        handles = [self._handle(prompt, option, listener, logprobs, prompt_logprobs, constraint)
                   for prompt, option in zip(prompts, options)]
        with self._lock:
            if self._closing:
                raise EngineClosed("the server is shutting down")
            if len(self._waiting) + len(handles) > self.max_queue + self._free_slots():
                raise QueueFull(f"{len(self._waiting)} requests are waiting; {len(handles)} more would pass what "
                                f"the queue holds (max_queue {self.max_queue}) and the free rows")
            self._waiting.extend(handles)
            self._lock.notify()
        return handles

    def _handle(self, prompt, options: DecodeOptions, listener, logprobs, prompt_logprobs, constraint) -> Handle:
        """A request's `Handle`, every argument checked (`submit`'s Raises)."""
        prompt = self._checked_prompt(prompt)
        max_tokens = as_int(options.max_new_tokens, "max_new_tokens", minimum=0)
        if logprobs is not None:
            logprobs = as_int(logprobs, "logprobs", minimum=0, maximum=min(MAX_LOGPROBS, self.vocab_size))
        if prompt_logprobs and logprobs is None:
            raise ValueError("prompt_logprobs needs logprobs (0 for the tokens' own alone)")
        if len(prompt) + max_tokens > self.capacity:
            raise ValueError(f"the prompt's {len(prompt)} tokens and max_new_tokens {max_tokens} make "
                             f"{len(prompt) + max_tokens}, past the server's max_seq_len {self.capacity}")
        check_served(options)
        sampling = options.sampling(1, self.vocab_size)  # (`Sampling.create` checks the settings)
        return Handle(prompt, max_tokens, sampling, self._key_data(options.key, sampling), listener, logprobs,
                      bool(prompt_logprobs), constraint)

    def set_params(self, params) -> None:
        """Decodes with `params` from now on: a policy in training samples with its weights of
        the moment, no copy made. They must be the tree of shapes and dtypes the engine was made
        with (no program compiles again), and no request may be running or waiting. The prefix
        cache is emptied: its entries were prefilled by the old weights.

        Raises:
          ValueError: another tree, shape or dtype (the first leaf that differs named), or requests in flight.
        """
        def shapes(tree):
            return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)

        old, new = jax.tree_util.tree_flatten_with_path(shapes(self.params)), jax.tree_util.tree_flatten_with_path(
            shapes(params))
        if old[1] != new[1]:
            raise ValueError("set_params: params must have the engine's tree of parameters (another structure given)")
        for (path, was), (_, now) in zip(old[0], new[0]):
            if was != now:
                raise ValueError(f"set_params: {jax.tree_util.keystr(path)} is {now[0]} {now[1]}, the engine's is "
                                 f"{was[0]} {was[1]}")
        with self._lock:
            if self._waiting or any(slot is not None for slot in self._slots):
                raise ValueError("set_params: requests are running or waiting; set the weights between them")
            self.params = params
            self._prefixes.clear()

    def _checked_prompt(self, prompt: Sequence[int]) -> list[int]:
        """`prompt` as a list of ids, each in the vocabulary, at least one."""
        if any(python_int(i) is None for i in prompt):
            raise ValueError(f"prompt must hold integer token ids (got {list(prompt)[:8]!r}...)")
        prompt = [int(i) for i in prompt]
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = min(prompt) if min(prompt) < 0 else max(prompt)
            raise ValueError(f"prompt holds token id {bad}, outside the model's vocabulary [0, {self.vocab_size})")
        return prompt

    def _key_data(self, key, sampling: Sampling) -> np.ndarray:
        """The data of a request's `key` (what the step's keys array holds), the free row's
        unused key for a greedy request without one."""
        unused = self._free_row[1]
        if key is None:
            if sampling.samples.any():
                raise ValueError("key is required when temperature > 0: pass key=jax.random.key(seed)")
            return unused
        try:
            data = np.asarray(jax.random.key_data(key))
        except (TypeError, ValueError):
            data = None
        if data is None or data.shape != unused.shape or data.dtype != unused.dtype:
            raise ValueError(f"key must be one PRNG key, jax.random.key(seed) (got {key!r})")
        return data

    def load(self) -> dict:
        """`{"running": requests holding a row, "waiting": queued for one, "finished": {reason: count},
        "prefill": {prompts, prefix_hits, cached_tokens, prefilled_tokens, pieces_with_decode},
        "prefix_cache": {entries, bytes}}`."""
        with self._lock:
            return {"running": self.max_batch - self._free_slots(), "waiting": len(self._waiting),
                    "finished": dict(self._finished), "prefill": dict(self._prefill_counts),
                    "prefix_cache": {"entries": len(self._prefixes), "bytes": self._prefixes.nbytes}}

    def _free_slots(self) -> int:
        return sum(slot is None for slot in self._slots)

    def close(self) -> None:
        """Takes no new request, finishes those running and waiting, then stops the loop."""
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join()

    # The engine's side: its own thread alone touches the cache and the slots.

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closing and not self._waiting and all(slot is None for slot in self._slots):
                    self._lock.wait()
                if self._closing and not self._waiting and all(slot is None for slot in self._slots):
                    return
                self._admit()
            self._turn()

    def _admit(self) -> None:
        """Cancelled requests leave; waiting ones take the free rows (called holding the lock)."""
        for row, slot in enumerate(self._slots):
            if slot is not None and slot.handle.cancelled.is_set():
                self._finish(row, Event(finish_reason="cancelled"))
        for handle in [h for h in self._waiting if h.cancelled.is_set()]:
            self._waiting.remove(handle)
            self._finished["cancelled"] += 1
            handle._send(Event(finish_reason="cancelled"))
        for row in range(self.max_batch):
            if self._slots[row] is None and self._waiting:
                self._slots[row] = _Slot(self._waiting.popleft(), next(self._admitted))

    def _turn(self) -> None:
        """Prefills up to `prefill_chunk` prompt tokens, then decodes one token for every running
        row; where rows are running and the first prompt waiting has a whole chunk to go, that
        chunk rides with the decode step, one call of the model for both (`_ride`)."""
        budget = self.prefill_chunk
        running = self._running()
        prefilling = [row for row, slot in enumerate(self._slots)
                      if slot is not None and slot.prefilled < len(slot.handle.prompt)]
        for row in sorted(prefilling, key=lambda row: self._slots[row].order):
            slot = self._slots[row]
            if budget == 0:
                break
            try:
                if slot.cache is None:
                    if self._awaits_prefix(slot):
                        continue
                    self._start(slot)
                planned = pieces(len(slot.handle.prompt) - slot.prefilled, self.prefill_chunk,
                                 self.capacity - slot.prefilled)
                if running and budget == self.prefill_chunk == planned[0][0]:
                    self._ride(running, row, slot, *planned[0])
                    return
                budget -= self._prefill(row, slot, budget, planned)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._finish(row, Event(finish_reason="error", error=f"prefill failed: {type(e).__name__}: {e}"))
        running = self._running()  # (with the prompts done just now)
        if not running:
            return
        try:
            out = self._programs["step"](params=self.params, cache=self._cache, rows=self._batch_inputs())
        except Exception as e:  # noqa: BLE001 - the batch's state is lost: its requests fail, the engine goes on
            self._lost(running, e)
            return
        self._cache = out["cache"]
        self._decoded(running, out["token"], out["scores"])

    def _running(self) -> list[int]:
        """The rows whose prompts are in the batch: each decodes a token this turn."""
        return [row for row, slot in enumerate(self._slots)
                if slot is not None and slot.prefilled == len(slot.handle.prompt)]

    def _decoded(self, running: list[int], tokens, scored) -> None:
        """Hands each running row its token from a step (read back to the host here: the step's one wait)."""
        tokens, scored = np.asarray(tokens), jax.tree.map(np.asarray, scored)
        for row in running:
            self._deliver(row, int(tokens[row]), *(part[row] for part in scored))

    def _lost(self, running: list[int], e: Exception) -> None:
        """A step failed: the batch's state is lost, its requests fail, the engine goes on."""
        self._cache = self.model.init_cache(self.max_batch, self.capacity)
        for row in running:
            self._finish(row, Event(finish_reason="error", error=f"decode step failed: {type(e).__name__}: {e}"))

    def _ride(self, running: list[int], row: int, slot: _Slot, n: int, real: int) -> None:
        """The decode step and `slot`'s next piece, `n` tokens (`real` of them the prompt's), in one call."""
        piece, following = self._piece_inputs(slot, n, real)
        try:
            out = self._programs["fused"](params=self.params, cache=self._cache, rows=self._batch_inputs(),
                                          row=slot.cache, piece=piece)
        except Exception as e:  # noqa: BLE001 - both fail: the batch's requests and this prompt's
            self._lost(running, e)
            self._finish(row, Event(finish_reason="error", error=f"prefill failed: {type(e).__name__}: {e}"))
            return
        self._cache, slot.cache = out["cache"], out["row"]
        with self._lock:
            self._prefill_counts["pieces_with_decode"] += 1
        self._decoded(running, out["token"], out["scores"])
        self._took(row, slot, real, following, out["last_logits"], out["piece_scores"])

    def _piece_inputs(self, slot: _Slot, n: int, real: int) -> tuple[Piece, list[int]]:
        """`slot`'s next `Piece`, `n` tokens of which `real` the prompt's, and the ids its
        positions predict (its `targets`) as a list."""
        handle, start = slot.handle, slot.prefilled
        tokens = np.zeros((2, n), np.int32)
        tokens[0, :real] = handle.prompt[start:start + real]
        following = handle.prompt[start + 1:start + 1 + real]
        tokens[1, :len(following)] = following
        return Piece(tokens=tokens[:1], real=np.int32(real), targets=tokens[1:],
                     temperature=handle.sampling.temperature,
                     wanted=np.int32(handle.wanted if handle.prompt_logprobs else 0)), following

    def _prefill(self, row: int, slot: _Slot, budget: int, planned: list[tuple[int, int]]) -> int:
        """Prefills the `planned` pieces of `slot`'s prompt that fit `budget` tokens, alone. Returns
        the tokens prefilled."""
        used = 0
        for n, real in planned:
            if n > budget - used:
                break
            piece, following = self._piece_inputs(slot, n, real)
            out = self._programs["piece"](params=self.params, row=slot.cache, piece=piece)
            slot.cache = out["row"]
            used += n
            self._took(row, slot, real, following, out["last_logits"], out["piece_scores"])
        return used

    def _took(self, row: int, slot: _Slot, real: int, following: list[int], logits, scored) -> None:
        """After a piece of `slot`'s prompt (its last logits, and the logprobs it `scored` if asked):
        its positions counted, and at the prompt's end its first token picked and its row put
        into the batch (or, scoring alone, the request done)."""
        handle, prompt = slot.handle, slot.handle.prompt
        if handle.prompt_logprobs:
            scored = jax.tree.map(lambda part: np.asarray(part)[0], scored)
            handle.scored += [handle.logprob(token, *(part[i] for part in scored)) for i, token in enumerate(following)]
        slot.prefilled += real
        with self._lock:
            self._prefill_counts["prefilled_tokens"] += real
        if slot.prefilled < len(prompt):
            return
        if self._prefixes.max_bytes:
            self._prefixes.add(prompt, slot.cache, *((handle.scored, float(handle.sampling.temperature[0]),
                                                      handle.logprobs) if handle.prompt_logprobs else ()))
        if handle.prompt_logprobs:
            handle._send(Event(prompt_logprobs=tuple(handle.scored)))
        if handle.max_tokens == 0:  # scoring alone: nothing is made
            slot.cache = None
            self._finish(row, Event(finish_reason="length"))
            return
        picked = self._programs["pick"](picking=self._picking([handle]), last_logits=logits)  # [1] each
        self._cache = self._programs["insert"](cache=self._cache, index=np.int32(row), row=slot.cache)["cache"]
        slot.cache = None
        self._deliver(row, int(np.asarray(picked["token"])[0]), *(np.asarray(part)[0] for part in picked["scores"]))

    def _start(self, slot: _Slot) -> None:
        """Gives `slot` its one-row cache: a copy of the cached prefix its prompt begins with (the
        positions `slot.prefilled` counts from), else an empty one."""
        handle = slot.handle
        entry, used = self._prefixes.longest(handle.prompt, self._ring) if self._prefixes.max_bytes else (None, 0)
        if entry is not None and handle.prompt_logprobs and self._ring == 0:
            entry, used = None, 0  # (it would prefill position used - 1 again, which a state has read already)
        if entry is not None and handle.prompt_logprobs:
            # A scoring request takes the entry's logprobs too: tokens 1 .. used - 1 of them, as token
            # `used` may differ from the entry's, and position used - 1 (prefilled again) scores it.
            used -= 1
            top = entry.top if entry.scored is not None else -1
            if entry.scored is None or top < handle.logprobs or entry.temperature != handle.sampling.temperature[0]:
                entry, used = None, 0
            else:
                handle.scored = [None] + [dataclasses.replace(r, top=r.top[:handle.logprobs])
                                          for r in entry.scored[1:used + 1]]
        if entry is None or used < 1:
            slot.cache = self._programs["empty_row"]()["row"]
        else:
            slot.cache, slot.prefilled, handle.cached = restored(entry, used), used, used
        with self._lock:
            self._prefill_counts["prompts"] += 1
            self._prefill_counts["prefix_hits"] += handle.cached > 0
            self._prefill_counts["cached_tokens"] += handle.cached

    def _awaits_prefix(self, slot: _Slot) -> bool:
        """Whether `slot`'s prompt should wait for an earlier one still prefilling, which shares
        more of its start than the prefix cache holds: its entry will hold those positions (the
        `n` choices of a prompt, one context scored with several endings, arriving together)."""
        if not self._prefixes.max_bytes:
            return False
        prompt = np.asarray(slot.handle.prompt)
        _, cached = self._prefixes.longest(slot.handle.prompt, self._ring)
        return any(shared_start(np.asarray(other.handle.prompt), prompt) > cached for other in self._slots
                   if other is not None and other.order < slot.order and other.prefilled < len(other.handle.prompt))

    def _batch_inputs(self) -> Rows:
        """The step's `Rows`: the first rows, enough to hold every running one (a count of
        `_row_counts`), and the span that holds the longest of them."""
        running = [slot if slot is not None and slot.prefilled == len(slot.handle.prompt) else None
                   for slot in self._slots]
        last = max(row for row, slot in enumerate(running) if slot is not None)
        running = running[:next(n for n in self._row_counts if n > last)]
        # A running row holds its prompt and every token made but the last, which this step
        # writes at slot len(prompt) + made - 1: the span must hold len(prompt) + made slots.
        span = span_for(max(len(slot.handle.prompt) + slot.handle.made for slot in running if slot is not None),
                        self.capacity)
        return Rows(tokens=np.asarray([0 if slot is None else slot.token for slot in running], np.int32),
                    active=np.asarray([slot is not None for slot in running]),
                    picking=self._picking([None if slot is None else slot.handle for slot in running]), span=span)

    def _deliver(self, row: int, token: int, *scored) -> None:
        """Hands row `row`'s new token to its request (with its logprob, top ids and top logprobs
        from `scored`, if it asked); frees the row when the request is done."""
        slot = self._slots[row]
        handle = slot.handle
        handle.made += 1
        slot.token = token
        logprobs = () if handle.logprobs is None else (handle.logprob(token, *scored),)
        if token == NO_TOKEN:
            event = Event(finish_reason="error", error=f"new token {handle.made - 1}: {NonFiniteLogitsError.CAUSE}")
        elif token in self.stop_ids:
            event = Event(finish_reason="stop", stop_id=token)
        elif handle.constraint is not None and (failed := self._follow(handle.constraint, token)):
            event = Event(finish_reason="error", error=failed)
        elif handle.constraint is not None and handle.constraint.is_finished():  # the grammar ends here
            event = Event((token,), finish_reason="stop", logprobs=logprobs)
        elif handle.made == handle.max_tokens:
            event = Event((token,), finish_reason="length", logprobs=logprobs)
        else:
            event = Event((token,), logprobs=logprobs)
        if event.finish_reason is not None:
            self._finish(row, event)
            return
        try:
            handle._send(event)
        except Exception as e:  # noqa: BLE001 - a listener that fails ends its own request only
            self._finish(row, Event(finish_reason="error", error=f"delivering a token failed: {type(e).__name__}: {e}"))

    @staticmethod
    def _follow(constraint, token: int) -> str | None:
        """Moves `constraint` past `token`; what went wrong, if it could not."""
        try:
            constraint.advance(token)
        except (ValueError, RuntimeError) as e:  # (a grammar past its library's limits: this request's fault)
            return f"response_format: {e}"
        return None

    def _finish(self, row: int, event: Event) -> None:
        """Frees row `row` and sends its request's last event."""
        handle, self._slots[row] = self._slots[row].handle, None
        with self._lock:
            self._finished[event.finish_reason] += 1
        try:
            handle._send(event)
        except Exception:  # noqa: BLE001 - its listener is gone with it; the row is free either way
            pass
