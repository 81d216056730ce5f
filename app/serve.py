"""`specchat serve`: an OpenAI-compatible HTTP server over one engine.

Routes, shaped as OpenAI's API and llama.cpp's `llama-server` shape them:
`GET /health`, `GET /slots`, `GET /v1/models`, `POST /v1/chat/completions` (the messages go
through the model's chat template, `app.prompt_format.PromptFormat.tokens`;
plain text for a model without one) and `POST /v1/completions` (the prompt
text as it is, `PromptFormat.raw`). Both stream as server-sent events
(`data: {...}` blocks, then `data: [DONE]`) or answer in one JSON object.
Every answer carries `usage` and, as llama-server's do, a `timings` object
(prompt_n, prompt_ms, predicted_n, predicted_ms, predicted_per_second,
draft_n, draft_n_accepted, ...) extended with specchat's own figures from
`backends.events.GenStats`: the strategy, target forwards, tokens per forward
and acceptance by draft position. A stream's last chunk carries them.

Per request, a `speculative` object picks the strategy and its settings:
`{"strategy": "lookahead", "window": 4, "ngram": 3, "guesses": 4}`, the field
names of the strategy's dataclass in `backends.config`. llama-server's
`n_max` / `n_min` / `p_min` are understood inside that object or as its flat
keys `"speculative.n_max"` ...: n_max is the most drafted tokens per step
(the K of sps, lookup and auto, like `--draft-max`; 0 means plain decoding), p_min
stops drafting under that draft probability (`--draft-p-min`), and n_min,
llama-server's "discard a draft shorter than this", is accepted as 0 or 1
only, where it changes nothing; specchat never discards a draft, so larger
values are refused rather than silently ignored.

Why Starlette on uvicorn: routing and a streaming response are all this
server needs, and Starlette is small. FastAPI's pydantic layer would add a
second validation with its own error shape; requests are checked here,
field by field, and refused in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}`.

One engine serves every client. llama.cpp work runs on one worker thread,
so the event loop stays free: up to `--parallel` requests decode together,
their rows packed into one batch per step (continuous batching,
backends.scheduler), and further requests wait in a FIFO queue. Each running
request has a slot of the engine, whose KV cache keeps the longest common
prefix (`backends.kv.KvSequence.sync`): a chat client that re-sends its
conversation lands in the slot that holds it and decodes only the new turn
(`usage.prompt_tokens_details.cached_tokens`, `timings.cache_n`). A client
that goes away cancels its generation: the strategies poll `should_stop`
between target forwards. A failing request answers 400 (the user's mistake,
`app.errors.is_user_error`) or 500 with one line; tracebacks stay in the
server's log.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import queue
import socket
import threading
import time
import sys
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Mapping

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.chat_template import ChatMessage
from app.errors import describe, is_user_error
from app.prompt_format import PromptFormat
from app.settings import Settings, with_paths
from backends.config import StrategyOptions
from backends.engine import Engine
from backends.events import Done, GenStats, Prefilled, Token
from backends.batch import SlotPool
from backends.registry import NEEDS_DRAFT, STRATEGIES, n_seq_needed, strategy_label
from backends.sampling import GenParams

log = logging.getLogger("specchat.serve")

MAX_BODY_BYTES = 1 << 20  # 1 MiB: a long conversation fits many times over
MAX_QUEUED = 64  # requests waiting for the engine; more are refused with 503
N_SEQ_MAX = 64  # sequence ids of the engine's contexts: every strategy's settings fit (kv_unified: no extra memory)

Endpoint = Literal["chat", "text"]


# -- errors -----------------------------------------------------------------


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _from_exception(e: BaseException) -> ApiError:
    """A user error is the client's 400; anything else a 500 whose details stay in the log."""
    if is_user_error(e):
        return _bad(describe(e))
    return ApiError(500, "the generation failed on the server (see its log)")


# -- request fields -----------------------------------------------------------


def _number(body: Mapping[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number", name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    return value


def _stop(body: Mapping[str, Any], default: tuple[str, ...]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return default
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
        raise _bad("'stop' must be a non-empty string or a list of them", "stop")
    return tuple(values)


def _max_tokens(body: Mapping[str, Any], default: int, n_ctx: int) -> int:
    """max_completion_tokens (OpenAI's current name), max_tokens, or llama-server's n_predict; at most the context."""
    given = {name: _integer(body, name, None) for name in ("max_completion_tokens", "max_tokens", "n_predict")}
    given = {k: v for k, v in given.items() if v is not None and not (k == "n_predict" and v == -1)}
    if len(set(given.values())) > 1:
        raise _bad(f"{' and '.join(given)} disagree; send one of them", next(iter(given)))
    name, value = next(iter(given.items()), ("max_tokens", min(default, n_ctx)))  # serve -n over -c: the context
    if value < 1:
        raise _bad(f"'{name}' must be at least 1", name)
    if value > n_ctx:
        raise _bad(f"'{name}' is {value} but the context holds {n_ctx} tokens", name)
    return value


def sampling_params(body: Mapping[str, Any], defaults: GenParams, n_ctx: int) -> GenParams:
    """OpenAI's sampling fields (and llama-server's top_k / min_p) over the server's defaults."""
    seed = _integer(body, "seed", defaults.seed)
    if seed is not None and seed < 0:
        if seed != -1:
            raise _bad("'seed' must be >= 0, or -1 for a random one", "seed")
        seed = None
    try:
        return GenParams(
            max_tokens=_max_tokens(body, defaults.max_tokens, n_ctx),
            temperature=_number(body, "temperature", defaults.temperature),
            top_k=_integer(body, "top_k", defaults.top_k),  # type: ignore[arg-type]
            top_p=_number(body, "top_p", defaults.top_p),
            min_p=_number(body, "min_p", defaults.min_p),
            seed=seed,
            stop=_stop(body, defaults.stop),
        )
    except ValueError as e:
        raise _bad(str(e)) from None


def _refuse(name: str, why: str) -> ApiError:
    return _bad(f"'{name}' is not supported: {why}", name, "unsupported_parameter")


def refuse_unsupported(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    """Fields whose meaning this server cannot honour: a clear 400 rather than an answer that ignores them."""
    if body.get("n") not in (None, 1):
        raise _refuse("n", "one completion per request (n = 1)")
    if body.get("best_of") not in (None, 1):
        raise _refuse("best_of", "one completion per request")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise _refuse("logprobs", "log probabilities are not returned")
    for name in ("tools", "functions"):
        if body.get(name):
            raise _refuse(name, "tool calling is not implemented")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise _refuse("tool_choice", "tool calling is not implemented")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise _refuse("response_format", "only {'type': 'text'} (no JSON mode or schemas)")
    for name in ("frequency_penalty", "presence_penalty", "repeat_penalty"):
        default = 1.0 if name == "repeat_penalty" else 0.0
        if _number(body, name, default) != default:
            raise _refuse(name, "repetition penalties are not implemented (speculative verification "
                                "needs the same distribution at every position)")
    if body.get("logit_bias"):
        raise _refuse("logit_bias", "logit biases are not implemented")
    if body.get("echo"):
        raise _refuse("echo", "the prompt is not echoed")
    if body.get("suffix"):
        raise _refuse("suffix", "no fill-in-the-middle")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]) or body.get("audio") or body.get("prediction"):
        raise _refuse("modalities" if modalities not in (None, ["text"]) else
                      "audio" if body.get("audio") else "prediction", "text only, no predicted outputs")
    if endpoint == "text" and "messages" in body:
        raise _bad("'messages' belongs to /v1/chat/completions; /v1/completions takes 'prompt'", "messages")
    if endpoint == "chat" and "prompt" in body:
        raise _bad("'prompt' belongs to /v1/completions; /v1/chat/completions takes 'messages'", "prompt")


# -- per-request speculation ------------------------------------------------

_LLAMA_SERVER_KEYS = ("n_max", "n_min", "p_min")


def _speculative_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The `speculative` object merged with llama-server's flat `speculative.X` keys."""
    nested = body.get("speculative") or {}
    if not isinstance(nested, dict):
        raise _bad("'speculative' must be an object", "speculative")
    flat = {key.split(".", 1)[1]: value for key, value in body.items() if key.startswith("speculative.")}
    for key in flat.keys() & nested.keys():
        if flat[key] != nested[key]:
            raise _bad(f"'speculative.{key}' is given twice with different values", f"speculative.{key}")
    return {**flat, **nested}


def _typed(section: object, name: str, value: Any) -> Any:
    """`value` checked against the type of the dataclass field's current value (JSON gives no more)."""
    current = getattr(section, name)
    param = f"speculative.{name}"
    if isinstance(current, bool):
        ok = isinstance(value, bool)
    elif isinstance(current, int) or name == "nodes":
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (name == "nodes" and value == "auto")
    elif isinstance(current, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, type(current))
    if not ok:
        raise _bad(f"'{param}' must be of type {type(current).__name__}", param)
    return value


def speculation(body: Mapping[str, Any], defaults: Settings, has_draft: bool,
                n_seq_max: int = N_SEQ_MAX) -> tuple[str, StrategyOptions]:
    """The strategy and its settings for one request, over the server's defaults (the CLI flags)."""
    spec = _speculative_fields(body)
    strategy = spec.pop("strategy", None)
    n_max = spec.pop("n_max", None)
    n_min = spec.pop("n_min", None)
    p_min = spec.pop("p_min", None)
    if n_max is not None and (isinstance(n_max, bool) or not isinstance(n_max, int) or n_max < 0):
        raise _bad("'speculative.n_max' must be an integer >= 0", "speculative.n_max")
    if strategy is None:
        strategy = "ar" if n_max == 0 else defaults.strategy
    if strategy not in STRATEGIES:
        raise _bad(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}", "speculative.strategy")
    if n_max == 0 and strategy != "ar":
        raise _bad(f"'speculative.n_max' 0 means plain decoding, which contradicts strategy {strategy!r}",
                   "speculative.n_max")
    if strategy in NEEDS_DRAFT and not has_draft:
        raise _bad(f"strategy {strategy!r} needs a draft model; the server was started without -md",
                   "speculative.strategy")
    _check_n_min(n_min, n_max)
    options = defaults.options
    changes: dict[str, Any] = {}
    if n_max:  # llama-server's most drafted tokens: K of the draft chain and of prompt lookup, as --draft-max
        changes.update({"sps.draft_max": n_max, "lookup.draft_max": n_max, "auto.draft_max": n_max})
    if p_min is not None:  # as --draft-p-min: the chain's and the static tree's stopping probability
        p = _typed(options.sps, "p_min", p_min)
        changes.update({"sps.p_min": p, "tree.p_min": p})
    if spec:
        section = getattr(options, strategy, None)
        names = {f.name for f in fields(section)} if section is not None else set()
        unknown = sorted(set(spec) - names)
        if unknown:
            allowed = ", ".join(["strategy", *_LLAMA_SERVER_KEYS, *sorted(names)])
            raise _bad(f"unknown setting {unknown[0]!r} for strategy {strategy!r}; allowed: {allowed}",
                       f"speculative.{unknown[0]}")
        changes.update({f"{strategy}.{name}": _typed(section, name, value) for name, value in spec.items()})
    try:
        options = with_paths(options, changes)  # dataclasses.replace: each config's __post_init__ checks it
    except ValueError as e:
        raise _bad(str(e), "speculative") from None
    if n_seq_needed(strategy, options) > n_seq_max:
        raise _bad(f"these {strategy} settings need {n_seq_needed(strategy, options)} sequences; "
                   f"the server has {n_seq_max}", "speculative")
    return strategy, options


def _check_n_min(n_min: Any, n_max: int | None) -> None:
    """llama-server drops drafts shorter than n_min (clamped to n_max); specchat never drops one."""
    if n_min is None:
        return
    if isinstance(n_min, bool) or not isinstance(n_min, int) or n_min < 0:
        raise _bad("'speculative.n_min' must be an integer >= 0", "speculative.n_min")
    if min(n_min, n_max if n_max is not None else n_min) > 1:
        raise _bad("'speculative.n_min' above 1 is not supported: llama-server discards drafts shorter than "
                   "n_min, specchat verifies every draft (its length follows p_min and the adaptive K); "
                   "send 0 or 1", "speculative.n_min", "unsupported_parameter")


# -- prompts --------------------------------------------------------------------

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _content(message: Mapping[str, Any], i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts of type text."""
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def chat_messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = _ROLES.get(m["role"]) if isinstance(m.get("role"), str) else None
        if role is None:
            raise _bad(f"messages[{i}].role {m.get('role')!r} is not supported (system, developer, user, assistant)",
                       f"messages[{i}].role")
        out.append(ChatMessage(role, _content(m, i)))  # type: ignore[arg-type]
    return tuple(out)


def completion_prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    """A completion's prompt: a string, a list of one string, or token ids (as llama-server takes them)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    raise _bad("'prompt' must be a string, or a list of token ids (one prompt per request)", "prompt")


# -- one request, parsed ----------------------------------------------------


@dataclass(frozen=True)
class GenRequest:
    """One generation, as the worker runs it."""

    endpoint: Endpoint
    strategy: str
    options: StrategyOptions
    params: GenParams
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | tuple[int, ...] = ""
    stream: bool = False
    include_usage: bool = False


def parse_request(body: Mapping[str, Any], endpoint: Endpoint, defaults: Settings, n_ctx: int,
                  has_draft: bool, n_seq_max: int = N_SEQ_MAX) -> GenRequest:
    refuse_unsupported(body, endpoint)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    strategy, options = speculation(body, defaults, has_draft, n_seq_max)
    return GenRequest(
        endpoint=endpoint, strategy=strategy, options=options,
        params=sampling_params(body, defaults.params, n_ctx),
        messages=chat_messages(body) if endpoint == "chat" else (),
        prompt=completion_prompt(body) if endpoint == "text" else "",
        stream=stream, include_usage=bool(stream_options.get("include_usage")),
    )


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

    def post(self, item: object) -> None:
        """From the worker thread. Nothing to do once the server's event loop is gone (it is stopping)."""
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            self.cancel()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()


class _Running:
    """A request in the pool: its job, when it started, and whether its answer has begun or gone out."""

    __slots__ = ("job", "t0", "started", "answered")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.t0 = time.perf_counter()
        self.started = False  # Prefilled came: tokens follow
        self.answered = False  # its Done or Failed went out


class EngineWorker:
    """The one thread that runs llama.cpp: up to `parallel` requests decode together, the rest wait in order.

    Each running request has a slot of the engine (backends.batch.SlotPool:
    its own sequence ids and cells, the free slot whose cache holds the
    longest prefix of its prompt); their strategies' rows go into one batch
    per step. A request joins at the next step after a slot frees, in arrival
    order. A request that fails ends alone and empties only its own slot.
    """

    def __init__(self, engine: Engine, max_queued: int = MAX_QUEUED) -> None:
        self.engine = engine
        self.format = PromptFormat(engine)
        self.pool = SlotPool(engine)
        self.parallel = self.pool.size
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._pending: set[Job] = set()
        self._thread = threading.Thread(target=self._serve, name="specchat-engine", daemon=True)
        self.handled = 0  # requests taken off the queue
        self.cancelled = 0  # of which cancelled (the client went away, or the server is stopping)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if len(self._pending) >= self._max_queued + self.parallel:
                raise ApiError(503, f"the server is busy ({self._max_queued} requests waiting); retry later",
                               code="server_busy")
            self._pending.add(job)
        self._queue.put(job)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self._queue.qsize()

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
            while self.pool.free and not stopping:
                try:  # wait for work only when there is nothing to step
                    job = self._queue.get(block=not len(self.pool))
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                else:
                    self._admit(job)
            self.pool.step()
        while not self._queue.empty():  # submitted while the server stopped
            if (job := self._queue.get_nowait()) is not None:
                self._finish(job, Failed(ApiError(503, "cancelled before it started (the server is stopping)",
                                                  code="cancelled")))

    def _finish(self, job: Job, outcome: object) -> None:
        job.post(outcome)
        with self._lock:
            self._pending.discard(job)
        self.handled += 1

    def _tokens(self, request: GenRequest) -> list[int]:
        if request.endpoint == "chat":
            return self.format.tokens(request.messages)
        if isinstance(request.prompt, tuple):
            n_vocab = self.engine.target_model.n_vocab
            if any(not 0 <= t < n_vocab for t in request.prompt):
                raise ValueError(f"the prompt has token ids outside the vocabulary (0..{n_vocab - 1})")
            return list(request.prompt)
        return self.format.raw(request.prompt)

    def _admit(self, job: Job) -> None:
        """Start `job` in a free slot, or answer it at once (cancelled, or refused before it could start)."""
        if job.cancelled:
            log.info("%s: cancelled while waiting", job.id)
            self.cancelled += 1
            self._finish(job, Failed(ApiError(503, "cancelled before it started (the server is stopping)",
                                              code="cancelled")))
            return
        request = job.request
        running = _Running(job)
        try:
            self.pool.admit(request.strategy, request.options, self._tokens(request), request.params,
                            lambda event: self._on_event(running, event), lambda error: self._on_end(running, error),
                            lambda: job.cancelled)
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the server
            if is_user_error(e):
                log.info("%s: refused: %s", job.id, describe(e))
            else:
                log.exception("%s: generation failed", job.id)
            self._finish(job, Failed(_from_exception(e)))

    def _on_event(self, r: _Running, event: object) -> None:
        job = r.job
        if isinstance(event, Prefilled):
            r.started = True
            job.post(Started(event.n_tokens))
        elif isinstance(event, Token) and event.kind != "rejected":
            job.post(event)
        elif isinstance(event, Done):
            self.cancelled += event.reason == "cancelled"
            _log_done(job, event, time.perf_counter() - r.t0)
            # Failed or cancelled before the prompt was in: nothing was streamed, the answer is an error.
            r.answered = True
            self._finish(job, event if r.started else Failed(_done_error(event)))

    def _on_end(self, r: _Running, error: BaseException | None) -> None:
        if error is not None:
            if is_user_error(error):
                log.info("%s: refused: %s", r.job.id, describe(error))
            else:
                log.error("%s: generation failed", r.job.id, exc_info=error)
            if not r.answered:  # the pool emptied its slot: a step stopped halfway left its caches unknown
                self._finish(r.job, Failed(_from_exception(error)))
        elif not r.answered:  # a machine that ended without Done (never, for the strategies of backends/)
            self._finish(r.job, Failed(ApiError(500, "the generation ended without an answer")))


def _log_done(job: Job, done: Done, seconds: float) -> None:
    s = done.stats
    log.info("%s: %s %s: %d tokens (%s), prompt %d (%d cached), %.2f s, %.1f tok/s, %.2f tokens/forward%s",
             job.id, job.request.endpoint, s.strategy, s.generated_tokens, done.reason, s.prompt_tokens,
             s.prompt_cached, seconds, s.tokens_per_second, s.mean_accepted_per_forward,
             f": {done.error}" if done.error else "")


# -- responses -------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(stats: GenStats) -> dict[str, object]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.prompt_cached},
    }


def timings(stats: GenStats, label: str) -> dict[str, object]:
    """llama-server's timings (prompt_n counts the prompt tokens decoded, cache_n those reused), plus specchat's."""
    prompt_n = stats.prompt_tokens - stats.prompt_cached
    prompt_ms, predicted_ms = stats.prompt_seconds * 1e3, stats.decode_seconds * 1e3
    return {
        "cache_n": stats.prompt_cached,
        "prompt_n": prompt_n,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
        "prompt_per_second": round(prompt_n / stats.prompt_seconds, 3) if stats.prompt_seconds > 0 else 0.0,
        "predicted_n": stats.generated_tokens,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / stats.generated_tokens, 3) if stats.generated_tokens else 0.0,
        "predicted_per_second": round(stats.tokens_per_second, 3),
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "strategy": stats.strategy,
        "strategy_settings": label,
        "target_forwards": stats.target_forwards,
        "tokens_per_forward": round(stats.mean_accepted_per_forward, 4),
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
    }


@dataclass(frozen=True)
class Reply:
    """The fixed parts of one response's objects, chunks included (OpenAI's shapes)."""

    request: GenRequest
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chat(self) -> bool:
        return self.request.endpoint == "chat"

    def _object(self, kind: str, choices: list[dict[str, object]]) -> dict[str, object]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def _choice(self, text: str, finish_reason: str | None, delta: bool, role: bool = False) -> dict[str, object]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body: dict[str, object] = {"role": "assistant"} if role or not delta else {}
        if text or not delta or role:
            body["content"] = text
        return {"index": 0, ("delta" if delta else "message"): body, "logprobs": None, "finish_reason": finish_reason}

    def _extras(self, done: Done) -> dict[str, object]:
        label = strategy_label(self.request.strategy, self.request.options)
        return {"usage": usage(done.stats), "timings": timings(done.stats, label)}

    def whole(self, done: Done) -> dict[str, object]:
        kind = "chat.completion" if self.chat else "text_completion"
        choice = self._choice(done.text, FINISH_REASONS.get(done.reason, "stop"), delta=False)
        return {**self._object(kind, [choice]), **self._extras(done)}

    def chunk(self, text: str, role: bool = False) -> dict[str, object]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, [self._choice(text, None, delta=True, role=role)])

    def final_chunks(self, done: Done) -> list[dict[str, object]]:
        """The chunk with the finish reason (and any held-back text); with include_usage, a usage chunk after it.

        The last one carries the timings (and usage, as llama-server sends it on the final chunk too).
        """
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        finish = self._object(kind, [self._choice(done.tail, FINISH_REASONS.get(done.reason, "stop"), delta=True)])
        extras = self._extras(done)
        if not self.request.include_usage:
            return [{**finish, "timings": extras["timings"]}]
        return [finish, {**self._object(kind, []), **extras}]


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


class _ClientGone(Exception):
    pass


class _JobStream(StreamingResponse):
    """A streamed answer that cancels its generation however the response ends (a disconnect included)."""

    def __init__(self, content: AsyncIterator[bytes], job: Job) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # no-op after a complete answer; stops the generation after a disconnect


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the request's body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _outcome(job: Job) -> object:
    """The job's Done or Failed (a whole answer ignores the tokens on the way)."""
    while not isinstance(event := await job.events.get(), (Done, Failed)):
        pass
    return event


async def _unless_gone(awaitable: Awaitable[object], job: Job, request: Request) -> object:
    """`awaitable`'s result, or _ClientGone (and the job cancelled) if the client leaves first."""
    wanted = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({wanted, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if wanted.done():
        return wanted.result()
    wanted.cancel()
    job.cancel()
    raise _ClientGone


# -- the application --------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    defaults: Settings  # the CLI flags: every request's defaults
    model_ids: tuple[str, ...]  # the first is the listed id (the target file's stem); others are aliases
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    draft_id: str | None = None


class Server:
    """The routes over one `EngineWorker`."""

    def __init__(self, config: ServerConfig, worker: EngineWorker) -> None:
        self.config = config
        self.worker = worker
        self.n_ctx = worker.engine.target.n_ctx
        self.has_draft = worker.engine.draft is not None
        self.n_seq_max = worker.engine.target.n_seq_max  # what the context really has (the engine clamps it)
        self.started = int(time.time())

    # -- checks ------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def _json(self, request: Request) -> dict[str, Any]:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", code="invalid_json")
        return body

    def _model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.config.model_ids[0]
        if not isinstance(model, str):
            raise _bad("'model' must be a string", "model")
        if model not in self.config.model_ids:
            raise ApiError(404, f"the model {model!r} does not exist; this server has {self.config.model_ids[0]!r}",
                           "model", "model_not_found")
        return model

    # -- routes --------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        w = self.worker
        return JSONResponse({"status": "ok", "parallel": w.parallel, "running": w.running, "queued": w.queued,
                             "handled": w.handled, "cancelled": w.cancelled, "kv_errors": w.pool.kv_errors})

    async def slots(self, request: Request) -> Response:
        """llama-server's GET /slots: what each slot is doing and how much of a prompt it holds."""
        self._authorize(request)
        return JSONResponse(self.worker.pool.slots())

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model_id, *aliases = self.config.model_ids
        d = self.config.defaults
        return JSONResponse({"object": "list", "data": [{
            "id": model_id, "object": "model", "created": self.started, "owned_by": "specchat",
            "aliases": aliases,
            "meta": {"n_ctx": self.n_ctx, "draft": self.config.draft_id, "strategy": d.strategy,
                     "strategies": list(STRATEGIES), "strategy_settings": strategy_label(d.strategy, d.options)},
        }]})

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "text")

    async def _complete(self, request: Request, endpoint: Endpoint) -> Response:
        self._authorize(request)
        body = await self._json(request)
        model = self._model(body)
        gen = parse_request(body, endpoint, self.config.defaults, self.n_ctx, self.has_draft, self.n_seq_max)
        job = Job(gen, asyncio.get_running_loop())
        self.worker.submit(job)
        reply = Reply(gen, model)
        try:
            first = await _unless_gone(job.events.get(), job, request)  # Started, or Failed
            if isinstance(first, Failed):
                return first.error.response()
            if gen.stream:
                return _JobStream(self._stream(job, reply), job)
            outcome = await _unless_gone(_outcome(job), job, request)
        except _ClientGone:
            log.info("%s: the client went away", job.id)
            return Response(status_code=499)
        if isinstance(outcome, Failed):
            return outcome.error.response()
        assert isinstance(outcome, Done)
        return _done_response(outcome, reply)

    async def _stream(self, job: Job, reply: Reply) -> AsyncIterator[bytes]:
        if reply.chat:
            yield sse(reply.chunk("", role=True))
        while True:
            event = await job.events.get()
            if isinstance(event, Token):
                yield sse(reply.chunk(event.text))
            elif isinstance(event, Failed):
                yield sse(event.error.body())
                return
            elif isinstance(event, Done):
                if event.reason in ("error", "cancelled"):
                    yield sse(_done_error(event).body())
                    return
                for chunk in reply.final_chunks(event):
                    yield sse(chunk)
                yield SSE_DONE
                return


def _done_error(done: Done) -> ApiError:
    if done.reason == "cancelled":
        return ApiError(503, "the generation was cancelled (the server is stopping)", code="cancelled")
    return ApiError(500, f"the generation failed: {done.error or 'unknown error'}", code="generation_failed")


def _done_response(done: Done, reply: Reply) -> Response:
    if done.reason in ("error", "cancelled"):
        return _done_error(done).response()
    return JSONResponse(reply.whole(done))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return ApiError(500, "internal server error (see the server's log)").response()


def make_app(config: ServerConfig, worker: EngineWorker) -> Starlette:
    server = Server(config, worker)
    return Starlette(
        routes=[
            Route("/health", server.health, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/slots", server.slots, methods=["GET"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )


class AnnouncingServer(uvicorn.Server):
    """uvicorn's server, saying where it listens once it does, and cancelling generations when it stops."""

    def __init__(self, config: uvicorn.Config, model_id: str, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self.model_id = model_id
        self.on_shutdown = on_shutdown

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        host, port = self.config.host, self.config.port
        for server in getattr(self, "servers", ()):
            for sock in server.sockets or ():
                port = sock.getsockname()[1]  # the one the system chose for --port 0
        shown = f"[{host}]" if ":" in host else host
        print(f"specchat serve: {self.model_id} on http://{shown}:{port}/v1 (Ctrl-C stops)", file=sys.stderr,
              flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()  # running streams end within one step instead of running on to max_tokens
        await super().shutdown(sockets)
