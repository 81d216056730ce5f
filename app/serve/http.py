"""The Starlette application: routes, streaming, disconnects, and the uvicorn server that announces itself."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.settings import Settings
from app.serve.fields import ApiError, bad
from app.serve.slots import SlotFiles, slot_action
from app.serve.request import MAX_BODY_BYTES, Endpoint, GenRequest, parse_request
from app.serve.thinking import reasoning_info, template_kwargs
from app.serve.harmony_tools import HarmonyToolStream
from app.serve.tools import grammar_for
from app.serve.responses import SSE_DONE, Reply, done_error, done_response, sse
from app.serve.worker import EngineWorker, Failed, Finished, Job
from backends.events import Done, Token
from backends.grammar import GrammarError, compile_grammar
from backends.harmony import marker_terminal
from models.errors import ModelError
from backends.registry import STRATEGIES, strategy_label

log = logging.getLogger("specchat.serve")


class _ClientGone(Exception):
    pass


async def coalesced(chunks: AsyncIterator[bytes], more: Callable[[], bool]) -> AsyncIterator[bytes]:
    """`chunks` joined while `more()` says the next is ready (a step that accepted several tokens queues them at
    once): one write of the socket, and one pass through Starlette and uvicorn, for what the client could not
    have seen apart anyway. The event loop's time per chunk is taken from the cores llama.cpp decodes on."""
    held: list[bytes] = []
    async for chunk in chunks:
        held.append(chunk)
        if not more():
            yield b"".join(held)
            held.clear()
    if held:
        yield b"".join(held)


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


async def _outcome(job: Job) -> tuple[object, list[list[Token]]]:
    """The job's Finished, Failed, or the Done of a choice that failed; and each choice's tokens on the way (for
    their log-probabilities)."""
    tokens: list[list[Token]] = [[] for _ in range(job.request.n)]
    while not isinstance(event := await job.events.get(), (Finished, Done, Failed)):
        if isinstance(event, tuple) and isinstance(event[1], Token):
            tokens[event[0]].append(event[1])
    return event, tokens


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
    slot_save_path: Path | None = None  # --slot-save-path: POST /slots/{id}?action=save|restore|erase


class Server:
    """The routes over one `EngineWorker`."""

    def __init__(self, config: ServerConfig, worker: EngineWorker) -> None:
        self.config = config
        self.worker = worker
        self.n_ctx = worker.engine.target.n_ctx
        self.has_draft = worker.engine.draft is not None
        self.n_seq_max = worker.engine.target.n_seq_max  # what the context really has (the engine clamps it)
        self.started = int(time.time())
        self.slot_files = SlotFiles(config.slot_save_path, worker) if config.slot_save_path is not None else None

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
            raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", code="invalid_json")
        return body

    def _model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.config.model_ids[0]
        if not isinstance(model, str):
            raise bad("'model' must be a string", "model")
        if model not in self.config.model_ids:
            raise ApiError(404, f"the model {model!r} does not exist; this server has {self.config.model_ids[0]!r}",
                           "model", "model_not_found")
        return model

    # -- routes --------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        w = self.worker
        return JSONResponse({"status": "ok", "parallel": w.parallel, "running": w.running, "queued": w.queued,
                             "handled": w.handled, "cancelled": w.cancelled, "kv_errors": w.pool.kv_errors,
                             "kv_cells": w.pool.kv_cells, "kv_cached": w.pool.kv_cached,
                             "prompt_cache": w.pool.cache_stats.as_json()})

    async def slots(self, request: Request) -> Response:
        """llama-server's GET /slots: what each slot is doing and how much of a prompt it holds."""
        self._authorize(request)
        return JSONResponse(self.worker.pool.slots())

    async def slot_action(self, request: Request) -> Response:
        """llama-server's POST /slots/{id_slot}?action=save|restore|erase (app.serve.slots)."""
        self._authorize(request)
        return await slot_action(self.slot_files, self.worker.parallel, request, lambda: self._json(request))

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        model_id, *aliases = self.config.model_ids
        d = self.config.defaults
        return JSONResponse({"object": "list", "data": [{
            "id": model_id, "object": "model", "created": self.started, "owned_by": "specchat",
            "aliases": aliases,
            "meta": {"n_ctx": self.n_ctx, "draft": self.config.draft_id, "strategy": d.strategy,
                     "strategies": list(STRATEGIES), "strategy_settings": strategy_label(d.strategy, d.options),
                     "reasoning": reasoning_info(self.worker.reasoning)},
        }]})

    async def props(self, request: Request) -> Response:
        """llama-server's GET /props, the parts that apply: the defaults, the slots, the template and its tokens,
        and how the model thinks (`reasoning`, as /v1/models' meta has it; chat_template_caps.supports_thinking)."""
        self._authorize(request)
        d, fmt, info = self.config.defaults, self.worker.format, self.worker.engine.target_info
        model = self.worker.engine.target_model
        token = (lambda t: model.token_text(t) if t is not None else "")
        return JSONResponse({
            "default_generation_settings": {"n_ctx": self.n_ctx, "params": {
                "n_predict": d.params.max_tokens, "temperature": d.params.temperature, "top_k": d.params.top_k,
                "top_p": d.params.top_p, "min_p": d.params.min_p, "reasoning_budget_tokens":
                    -1 if d.params.reasoning_budget is None else d.params.reasoning_budget}},
            "total_slots": self.worker.parallel, "model_alias": self.config.model_ids[0],
            "modalities": {"vision": False, "audio": False}, "chat_template": fmt.template or "",
            "chat_template_caps": {"supports_thinking": self.worker.reasoning is not None},
            "bos_token": token(info.bos_id), "eos_token": token(info.eos_id),
            "reasoning": reasoning_info(self.worker.reasoning), "thinking": d.thinking,
        })

    async def tokenize(self, request: Request) -> Response:
        """llama-server's POST /tokenize: {"content", "add_special"} -> {"tokens"} (the vocabulary is read-only:
        no need to wait for the engine's thread)."""
        self._authorize(request)
        body = await self._json(request)
        content, add_special = body.get("content"), body.get("add_special", False)
        if not isinstance(content, str):
            raise bad("'content' must be a string", "content")
        if not isinstance(add_special, bool):
            raise bad("'add_special' must be true or false", "add_special")
        model = self.worker.engine.target_model
        return JSONResponse({"tokens": model.tokenize(content, add_special=add_special, parse_special=True)})

    async def detokenize(self, request: Request) -> Response:
        """llama-server's POST /detokenize: {"tokens"} -> {"content"}."""
        self._authorize(request)
        tokens = (await self._json(request)).get("tokens")
        model = self.worker.engine.target_model
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                   and 0 <= t < model.n_vocab for t in tokens):
            raise bad(f"'tokens' must be a list of token ids (0..{model.n_vocab - 1})", "tokens")
        # The pieces, as completions render them (and llama-server's detokenize does).
        return JSONResponse({"content": b"".join(model.piece(t) for t in tokens).decode("utf-8", errors="replace")})

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "text")

    async def _complete(self, request: Request, endpoint: Endpoint) -> Response:
        self._authorize(request)
        body = await self._json(request)
        model = self._model(body)
        gen = parse_request(body, endpoint, self.config.defaults, self.n_ctx, self.has_draft, self.n_seq_max,
                            self.worker.parallel)
        if endpoint == "chat":  # enable_thinking over the request's variables: a 400 where it cannot be honoured
            gen = replace(gen, thinking=replace(gen.thinking, kwargs=template_kwargs(gen.thinking, self.worker.format)))
        gen = await self._constrained(gen)
        job = Job(gen, asyncio.get_running_loop())
        self.worker.submit(job)
        thinks = self.worker.reasoning is not None and endpoint == "chat"
        reply = Reply(gen, model, self.worker.engine.target_model.piece, self.worker.tool_format,
                      thinks=thinks and gen.thinking.split, raw=thinks and not gen.thinking.split,
                      call_piece=self.worker.call_piece,
                      opening=self.worker.opening(gen) if thinks and not gen.thinking.split else "")
        try:
            first = await _unless_gone(job.events.get(), job, request)  # Started, or Failed
            if isinstance(first, Failed):
                return first.error.response()
            if gen.stream:
                return _JobStream(coalesced(self._stream(job, reply), lambda: not job.events.empty()), job)
            outcome, tokens = await _unless_gone(_outcome(job), job, request)  # type: ignore[misc]
        except _ClientGone:
            log.info("%s: the client went away", job.id)
            return Response(status_code=499)
        if isinstance(outcome, Failed):
            return outcome.error.response()
        if isinstance(outcome, Done):  # a choice failed or was cancelled
            return done_error(outcome).response()
        assert isinstance(outcome, Finished)
        return done_response(outcome.dones, reply, tokens)

    async def _constrained(self, gen: GenRequest) -> GenRequest:
        """The request with its grammar compiled (from response_format / grammar / json_schema, or from its
        tools): a grammar that does not compile is a 400 naming the field, never an answer that ignores it.
        Compiling may take a while for a large schema: off the event loop."""
        if gen.grammar is not None:
            kind, source, param = gen.grammar.kind, gen.grammar.source, gen.grammar.param
        elif gen.calls_tools and (spec := grammar_for(gen.tools, gen.tool_choice, self.worker.tool_format,
                                                       gen.parallel_tool_calls,
                                                       marker_terminal(self.worker.engine.target_model))):
            (kind, source), param = spec, "tools"
        else:
            return gen
        model = self.worker.engine.target_model
        try:
            grammar = await asyncio.to_thread(
                lambda: compile_grammar(kind, source, model.guidance_tokenizer, model.n_vocab))  # type: ignore[arg-type]
        except (GrammarError, ModelError) as e:  # ModelError: a vocabulary grammars cannot run on
            raise bad(str(e), param) from None
        return replace(gen, params=replace(gen.params, grammar=grammar))

    async def _stream(self, job: Job, reply: Reply) -> AsyncIterator[bytes]:
        """Each choice's tokens as they come (chunks carry the choice's index), its finish chunk when it ends,
        then the timings (and usage) and [DONE]; an error ends the stream with an error object."""
        gen = reply.request
        if reply.chat:
            for i in range(gen.n):
                yield sse(reply.chunk("", i, role=True))
        tools = [reply.tool_stream() for _ in range(gen.n)] if gen.calls_tools else None
        offsets = [0] * gen.n  # text sent, by choice (the completions API's logprobs text_offset)
        reasoned = [""] * gen.n  # reasoning sent, by choice: its Done's rest goes with the finish chunk
        thought = [0] * gen.n  # tokens of the thinking, by choice (usage's reasoning_tokens)
        raws = [reply.raw_stream() for _ in range(gen.n)]  # reasoning_format "none": the output as written
        held: dict[str, object] | None = None  # the last finish chunk, sent with the timings once all end
        while True:
            event = await job.events.get()
            if isinstance(event, tuple):
                index, item = event
                if isinstance(item, Token):
                    logprobs = reply.logprobs([item], offsets[index])
                    raw = raws[index]
                    text, reasoning = (item.text, item.reasoning) if raw is None else (raw.push(item.id), "")
                    offsets[index] += len(reply.piece_text(item.id)) if logprobs is not None else 0
                    reasoned[index] += reasoning
                    thought[index] += item.channel == "reasoning"
                    if tools is None:
                        if text and not reasoning and logprobs is None:
                            yield reply.text_chunk(text, index)
                        elif text or reasoning or logprobs is not None or not (reply.thinks or reply.raw):
                            yield sse(reply.chunk(text, index, logprobs=logprobs, reasoning=reasoning))
                        continue
                    text, new = tools[index].push(text)
                    if isinstance(tools[index], HarmonyToolStream):  # gpt-oss's calls: from the tokens
                        new = tools[index].push_token(item.id)
                    if text or reasoning or logprobs is not None:
                        yield sse(reply.chunk(text, index, logprobs=logprobs, reasoning=reasoning))
                    if new:
                        yield sse(reply.chunk("", index, calls=new))
                else:
                    if held is not None:
                        yield sse(held)
                    raw = raws[index]
                    text = None if raw is None else raw.flush()
                    if tools is not None:  # what was held back for a stop string
                        text, new = tools[index].push(item.tail if text is None else text)
                        rest, more = tools[index].finish()
                        text, new = text + rest, new + more
                        if new:
                            yield sse(reply.chunk("", index, calls=new))
                    done_reasoning = item.reasoning if reply.thinks else ""
                    rest = done_reasoning[len(reasoned[index]):] if done_reasoning.startswith(reasoned[index]) else ""
                    held = reply.finish_chunk(index, item, text,
                                              called=tools is not None and tools[index].sent_calls > 0, reasoning=rest)
            elif isinstance(event, Failed):
                yield sse(event.error.body())
                return
            elif isinstance(event, Done):  # a choice failed or was cancelled
                yield sse(done_error(event).body())
                return
            elif isinstance(event, Finished):
                assert held is not None
                for chunk in reply.closing_chunks(held, event.dones, sum(thought)):
                    yield sse(chunk)
                yield SSE_DONE
                return


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
            Route("/slots/{id_slot}", server.slot_action, methods=["POST"]),
            Route("/props", server.props, methods=["GET"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/tokenize", server.tokenize, methods=["POST"]),
            Route("/detokenize", server.detokenize, methods=["POST"]),
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
