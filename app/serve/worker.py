"""The one thread that runs llama.cpp for the server: the queue, the slots, and the events back to the event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable


from app.errors import describe, is_user_error
from app.prompt_format import PromptFormat
from app.serve.fields import ApiError, from_exception
from app.serve.harmony_tools import forced_header
from app.serve.request import MAX_QUEUED, GenRequest
from app.serve.responses import done_error
from app.serve.tools import prompt_messages, tool_format
from backends.config import PROMPT_CACHE_MIB
from backends.engine import Engine
from backends.events import Done, Prefilled, Token
from backends.harmony import PRESERVED
from backends.llama_process import release_compute_threads
from backends.reasoning import opening
from backends.sampling import GenParams
from backends.slot_pool import SlotPool
from backends.text import rendering

log = logging.getLogger("specchat.serve")


# -- the engine's worker thread -------------------------------------------------


@dataclass(frozen=True)
class Started:
    """The prompt is in the cache and tokens follow."""

    prompt_tokens: int


@dataclass(frozen=True)
class Failed:
    error: ApiError


class Job:
    """One request on its way through the queue; its events go back to the event loop that asked."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.id = uuid.uuid4().hex[:24]
        self.events: asyncio.Queue[object] = asyncio.Queue()
        self._loop = loop
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


def post_all(items: list[tuple[Job, object]]) -> None:
    """Hand many jobs' events to their event loops, with one wake-up of each loop.

    A step of N running requests makes N tokens at once; waking the loop
    once per step rather than once per token keeps the server's own thread
    off the cores llama.cpp's threads are decoding on (on 2 cores each
    wake-up takes time from the next decode).
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, object]]] = {}
    for job, item in items:
        by_loop.setdefault(job._loop, []).append((job, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the loop is closed: the server is stopping
            for job, _item in batch:
                job.cancel()


def _deliver(batch: list[tuple[Job, object]]) -> None:
    for job, item in batch:
        job.events.put_nowait(item)


# Put on the queue after a call (EngineWorker.call), so that a worker waiting for a job wakes up to run it.
_WAKE = object()


def _settle(future: "asyncio.Future[Any]", result: object, error: BaseException | None) -> None:
    if future.cancelled():  # the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass(frozen=True)
class Finished:
    """Every choice of the request has ended well: their Done events, by choice."""

    dones: tuple[Done, ...]


class _Running:
    """A request in the pool: its job, when it started, its choices' ends, whether its answer has begun or gone."""

    __slots__ = ("job", "t0", "started", "answered", "dones", "held")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.t0 = time.perf_counter()
        self.started = False  # a Prefilled came: tokens follow
        self.answered = False  # its Finished or Failed went out
        self.dones: list[Done | None] = [None] * job.request.n
        self.held: list[tuple[int, Token]] = []  # a whole answer's tokens, handed on with its choices' ends


class EngineWorker:
    """The one thread that runs llama.cpp: up to `parallel` requests decode together, the rest wait in order.

    Each running request has a slot of the engine (backends.slot_pool.SlotPool:
    its own sequence ids and cells, the free slot whose cache holds the
    longest prefix of its prompt); their strategies' rows go into one batch
    per step. A request joins at the next step after a slot frees, in arrival
    order. A request that fails ends alone and empties only its own slot.
    """

    def __init__(self, engine: Engine, max_queued: int = MAX_QUEUED, cache_mib: int = PROMPT_CACHE_MIB,
                 kv_disk: int = 0) -> None:
        self.engine = engine
        self.format = PromptFormat(engine)
        self.tool_format = tool_format(self.format.template)  # how this model's template calls tools
        self.reasoning = self.format.reasoning  # how it thinks (None: it does not): found once, before any request
        # The output as written with the format's markers rendered where they are control tokens (which render as
        # nothing): gpt-oss's calls are read from it (app.serve.harmony_tools), and `reasoning_format: none` shows
        # it, a thinking model's tags included (Gemma 4's <|channel>, Command R7B's <|START_THINKING|>), as
        # llama-server renders a format's preserved tokens.
        self.call_piece = rendering(engine.target_model, PRESERVED) if self.tool_format == "harmony" else \
            rendering(engine.target_model, self.reasoning.tags) if self.reasoning is not None else None
        self.pool = SlotPool(engine, cache_mib, kv_disk)
        self.parallel = self.pool.size
        self._queue: queue.Queue[object] = queue.Queue()  # Jobs, _WAKE markers, and None: stop
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._pending: set[Job] = set()
        self._thread = threading.Thread(target=self._serve, name="specchat-engine", daemon=True)
        self.handled = 0  # requests taken off the queue
        self.cancelled = 0  # of which cancelled (the client went away, or the server is stopping)
        self._outbox: list[tuple[Job, object]] = []  # events of this step, posted together (post_all)
        self._head: Job | None = None  # the next job, waiting for as many free slots as it has choices
        # Work for the engine's thread between two steps (call): the function, its future and that one's loop.
        self._calls: list[tuple[Callable[[], object], asyncio.Future[Any], asyncio.AbstractEventLoop]] = []
        self._wakes = 0  # _WAKE markers on the queue (not requests: `queued` leaves them out)
        self._closed = False  # the thread has ended: no more calls

    def start(self) -> None:
        # From here on only the engine's thread decodes: the warm-up and the cost measurement ran on this one.
        release_compute_threads()
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if len(self._pending) >= self._max_queued + self.parallel:
                raise ApiError(503, f"the server is busy ({self._max_queued} requests waiting); retry later",
                               code="server_busy")
            self._pending.add(job)
        self._queue.put(job)

    def call(self, fn: Callable[[], object]) -> "asyncio.Future[Any]":
        """Run `fn` on the engine's thread, between two steps (no slot's cells are being decoded then), before
        the next request is admitted; its result, or what it raised, comes back in the returned future of the
        calling event loop. For what touches a slot's cells from outside a generation (app.serve.slots)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._closed:
                raise ApiError(503, "the server is stopping", code="cancelled")
            self._calls.append((fn, future, loop))
            self._wakes += 1
        self._queue.put(_WAKE)
        return future

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future, loop in calls:
            result: object = None
            error: BaseException | None = None
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - answered to the caller, the thread goes on
                error = e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

    def _take(self, block: bool) -> object:
        """The next item of the queue (queue.Empty when there is none and `block` is false)."""
        item = self._queue.get(block=block)
        if item is _WAKE:
            with self._lock:
                self._wakes -= 1
        return item

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return max(0, self._queue.qsize() - self._wakes) + (self._head is not None)

    @property
    def running(self) -> int:
        return self.pool.running

    def cancel_all(self) -> None:
        with self._lock:
            for job in self._pending:
                job.cancel()

    def stop(self) -> None:
        """Cancel everything, finish the current step and end the thread (then the engine may be closed)."""
        self.cancel_all()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join()

    def _serve(self) -> None:
        stopping = False
        while not stopping or len(self.pool):
            while not stopping:
                self._run_calls()
                self._flush()
                if self._head is None:
                    if not self.pool.free:
                        break
                    try:  # wait for work only when there is nothing to step
                        item = self._take(block=not len(self.pool))
                    except queue.Empty:
                        break
                    if item is _WAKE:  # a call: run it, then look again
                        continue
                    if item is None:
                        stopping = True
                        break
                    assert isinstance(item, Job)
                    self._head = item
                if len(self.pool.free) < self._head.request.n and not self._head.cancelled:
                    break  # first in, first out: the jobs behind it wait too
                job, self._head = self._head, None
                self._admit(job)
            self.pool.step()
            self._flush()
        if self._head is not None:
            self._queue.put(self._head)
        while not self._queue.empty():  # submitted while the server stopped
            if isinstance(job := self._take(block=False), Job):
                self._finish(job, Failed(ApiError(503, "cancelled before it started (the server is stopping)",
                                                  code="cancelled")))
        with self._lock:
            self._closed = True
        self._run_calls()  # the last ones: no generation runs now
        self._flush()
        try:  # what the slots and the prompt cache hold, onto disk for the next start (backends.prompt_cache)
            self.pool.spill()
        except Exception as e:  # noqa: BLE001 - a full disk must not keep the server from stopping
            print(f"specchat serve: KV cells not kept on disk: {e}", file=sys.stderr, flush=True)

    def _post(self, job: Job, item: object) -> None:
        self._outbox.append((job, item))

    def _flush(self) -> None:
        if self._outbox:
            items, self._outbox = self._outbox, []
            post_all(items)

    def _finish(self, job: Job, outcome: object) -> None:
        self._post(job, outcome)
        with self._lock:
            self._pending.discard(job)
        self.handled += 1

    def _prompt(self, request: GenRequest) -> tuple[list[int], GenParams]:
        """The prompt's tokens, and the request's parameters with a thinking model's format for a chat (its output
        in two phases, the thinking within the budget and the grammar on the answer, backends.reasoning.Thinking;
        reasoning_format "none" shows it as written, app.serve.responses.Reply.raw)."""
        params = request.params
        if request.endpoint == "chat":
            messages, tools = prompt_messages(request.messages, request.tools, request.tool_choice, self.tool_format)
            kwargs = request.thinking.kwargs
            text = self.format.render(messages, tools=tools, kwargs=kwargs)  # once: the prompt and its opening
            if self.reasoning is not None:
                fmt = self.format.reasoning_for(messages, tools=tools, kwargs=kwargs, rendered=text)
                if fmt is not None and self.tool_format == "harmony" and request.must_call:
                    # The call's header before its grammar, as the final header before response_format's.
                    fmt = replace(fmt, after=forced_header([t.name for t in request.tool_choice.offered(request.tools)]))
                if fmt is not None and not fmt.opened and not fmt.channels and params.grammar is not None \
                        and not request.thinking.split:
                    # reasoning_format "none" under a grammar: llama.cpp's grammar then leaves the optional block
                    # out (common/chat-auto-parser-generator.cpp:107, 141), so the content is the answer alone.
                    fmt = None
                params = replace(params, reasoning=fmt,
                                 reasoning_budget=request.thinking.budget, reasoning_message=request.thinking.message)
            return self.format.encode(text), params
        if isinstance(request.prompt, tuple):
            n_vocab = self.engine.target_model.n_vocab
            if any(not 0 <= t < n_vocab for t in request.prompt):
                raise ValueError(f"the prompt has token ids outside the vocabulary (0..{n_vocab - 1})")
            return list(request.prompt), params
        return self.format.raw(request.prompt), params

    def opening(self, request: GenRequest) -> str:
        """reasoning_format none: what the chat's generation prompt writes of the thinking block, which the content
        starts with (backends.reasoning.opening); never a tag a message writes."""
        if self.reasoning is None or request.endpoint != "chat":
            return ""
        messages, tools = prompt_messages(request.messages, request.tools, request.tool_choice, self.tool_format)
        return opening(self.reasoning,
                       self.format.generation_prompt(messages, tools=tools, kwargs=request.thinking.kwargs))

    def _admit(self, job: Job) -> None:
        """Start `job`'s choices in free slots (there are enough), or answer it at once (cancelled, or refused
        before it could start). The first choice decodes the prompt; the others share its cells."""
        if job.cancelled:
            log.info("%s: cancelled while waiting", job.id)
            self.cancelled += 1
            self._finish(job, Failed(ApiError(503, "cancelled before it started (the server is stopping)",
                                              code="cancelled")))
            return
        request = job.request
        running = _Running(job)
        first: int | None = None
        try:
            prompt, first_params = self._prompt(request)
            for k in range(request.n):
                params = first_params
                if k and params.seed is not None:  # each choice its own draw
                    params = replace(params, seed=params.seed + k)
                slot = self.pool.admit(request.strategy, request.options, prompt, params,
                                       partial(self._on_event, running, k), partial(self._on_end, running, k),
                                       lambda: job.cancelled, share=first)
                first = slot if first is None else first
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the server
            if is_user_error(e):
                log.info("%s: refused: %s", job.id, describe(e))
            else:
                log.exception("%s: generation failed", job.id)
            if first is not None:  # choices already running stop at their next step and answer nothing
                job.cancel()
                running.answered = True
            self._finish(job, Failed(from_exception(e)))

    def _on_event(self, r: _Running, k: int, event: object) -> None:
        job = r.job
        if r.answered:
            return
        if isinstance(event, Prefilled):
            if not r.started:
                r.started = True
                self._post(job, Started(event.n_tokens))
        elif isinstance(event, Token) and event.kind != "rejected":
            if job.request.stream:
                self._post(job, (k, event))
            else:  # read only once the answer is whole: not a wake-up of the event loop a step
                r.held.append((k, event))
        elif isinstance(event, Done):
            self.cancelled += event.reason == "cancelled"
            _log_done(job, event, time.perf_counter() - r.t0)
            if event.reason in ("error", "cancelled"):
                # The answer is an error (in a stream, after what was sent); the other choices stop.
                r.answered = True
                job.cancel()
                self._finish(job, event if r.started else Failed(done_error(event)))
                return
            r.dones[k] = event
            for item in r.held:
                self._post(job, item)
            r.held.clear()
            self._post(job, (k, event))
            if all(d is not None for d in r.dones):
                r.answered = True
                self._finish(job, Finished(tuple(r.dones)))  # type: ignore[arg-type]

    def _on_end(self, r: _Running, k: int, error: BaseException | None) -> None:
        if error is not None:
            if is_user_error(error):
                log.info("%s: refused: %s", r.job.id, describe(error))
            else:
                log.error("%s: generation failed", r.job.id, exc_info=error)
            if not r.answered:  # the pool emptied its slot: a step stopped halfway left its caches unknown
                r.answered = True
                r.job.cancel()
                self._finish(r.job, Failed(from_exception(error)))
        elif not r.answered and r.dones[k] is None:  # a machine that ended without Done (never, in backends/)
            r.answered = True
            r.job.cancel()
            self._finish(r.job, Failed(ApiError(500, "the generation ended without an answer")))


def _log_done(job: Job, done: Done, seconds: float) -> None:
    s = done.stats
    log.info("%s: %s %s: %d tokens (%s), prompt %d (%d cached), %.2f s, %.1f tok/s, %.2f tokens/forward%s",
             job.id, job.request.endpoint, s.strategy, s.generated_tokens, done.reason, s.prompt_tokens,
             s.prompt_cached, seconds, s.tokens_per_second, s.mean_accepted_per_forward,
             f": {done.error}" if done.error else "")
