"""The answers' shapes: OpenAI's completion objects and stream chunks, with llama-server's `timings`."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

from starlette.responses import JSONResponse, Response

from app.chat_template import ToolCall
from app.serve.fields import ApiError
from app.serve.request import GenRequest
from app.serve.harmony_tools import HarmonyToolStream, calls_of
from app.serve.tools import ToolFormat, ToolStream, parse_answer
from backends.events import Done, GenStats, Token
from backends.harmony import AsWritten
from backends.reasoning import HARMONY
from backends.text import TextStream
from backends.registry import strategy_label


# -- responses -------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(stats: GenStats | tuple[GenStats, ...], reasoning_tokens: int | None = None) -> dict[str, object]:
    """OpenAI's usage; for several choices, the prompt once and every choice's completion tokens. For a thinking
    model's chat, `completion_tokens_details.reasoning_tokens`: the output tokens that stood in its thinking."""
    many = stats if isinstance(stats, tuple) else (stats,)
    completion = sum(s.generated_tokens for s in many)
    out: dict[str, object] = {
        "prompt_tokens": many[0].prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": many[0].prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": many[0].prompt_cached},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


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


class RawStream:
    """reasoning_format "none": a choice's content as llama.cpp gives it, from the output's token ids (push each,
    flush at the end): what the generation prompt wrote of the thinking block (`opening`,
    backends.reasoning.opening), then the output as written, stop strings cut as the strategies cut them; for
    gpt-oss, its messages as llama.cpp's gpt-oss parser keeps them (backends.harmony.AsWritten)."""

    def __init__(self, piece: Callable[[int], bytes], stop: tuple[str, ...], opening: str = "",
                 harmony: bool = False) -> None:
        self._stream = TextStream(piece, stop)
        self._opening = opening
        self._harmony = AsWritten(HARMONY, opened=False) if harmony else None

    def _written(self, text: str) -> str:
        text, self._opening = self._opening + text, ""
        return text if self._harmony is None else self._harmony.push(text)[1]

    def push(self, token: int) -> str:
        """The content this output token releases ('' while held back)."""
        return self._written(self._stream.push(token))

    def flush(self) -> str:
        """At the output's end: the content held back."""
        out = self._written(self._stream.flush())
        return out if self._harmony is None else out + self._harmony.flush()[1]


def _piece(piece: Callable[[int], bytes], token: int) -> tuple[str, list[int]]:
    raw = piece(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


@dataclass(frozen=True)
class Reply:
    """The fixed parts of one response's objects, chunks included (OpenAI's shapes), for its `n` choices.

    `piece` renders a token id (log-probabilities list tokens by their text and bytes); `tool_format` is how
    the model calls tools (app.serve.tools), used when the request offers them; `thinks`: a thinking model's
    chat whose reasoning goes to `reasoning_content` (the Done's and Tokens' `reasoning`), apart from `content`;
    `raw`: one with reasoning_format "none", whose content is the output as written, tags and all, as llama.cpp
    gives it (`raw_stream`), `opening` first: what the generation prompt wrote of the thinking block.
    """

    request: GenRequest
    model: str
    piece: Callable[[int], bytes] = lambda _t: b""
    tool_format: ToolFormat = "generic"
    thinks: bool = False
    raw: bool = False
    # The tokens' pieces with the format's markers rendered (harmony's calls; a thinking model's raw output).
    call_piece: Callable[[int], bytes] | None = None
    opening: str = ""  # reasoning_format none: the prompt's part of the thinking block (backends.reasoning.opening)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    # text_chunk's bytes before and after the text, by choice: the chunk the general path writes, cut at its text
    _text_frames: dict[int, tuple[bytes, bytes]] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def chat(self) -> bool:
        return self.request.endpoint == "chat"

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _object(self, kind: str, choices: list[dict[str, object]]) -> dict[str, object]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def raw_stream(self) -> RawStream | None:
        """For a `raw` answer: its content from its token ids (push each output token, flush at the end); gpt-oss's
        read with its markers rendered."""
        if not self.raw:
            return None
        return RawStream(self.call_piece or self.piece, self.request.params.stop, self.opening,
                         self.tool_format == "harmony")

    def _text(self, done: Done) -> str:
        """A choice's content: the answer, or for a `raw` one everything the model wrote (as llama.cpp shows it)."""
        stream = self.raw_stream()
        if stream is None:
            return done.text
        return "".join(stream.push(token) for token in done.tokens) + stream.flush()

    @property
    def _names(self) -> list[str]:
        return [t.name for t in self.request.tool_choice.offered(self.request.tools)]

    def tool_stream(self) -> ToolStream | HarmonyToolStream:
        """A choice's stream of content and calls, for a request that offers tools."""
        if self.tool_format == "harmony":
            return HarmonyToolStream(self.call_piece or self.piece, self._names)
        return ToolStream(self.tool_format, self.request.must_call, self._names)

    # -- log-probabilities ---------------------------------------------------

    def piece_text(self, token: int) -> str:
        """A token's own text (the completions API's text_offset counts these, held back for a stop or not)."""
        return _piece(self.piece, token)[0]

    def logprobs(self, tokens: Sequence[Token], offset: int = 0) -> dict[str, object] | None:
        """OpenAI's logprobs of these output tokens: chat's `{"content": [...]}`, or the completions API's
        legacy `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (offsets from `offset`)."""
        if self.request.params.logprobs is None:
            return None
        if self.chat:
            content = []
            for t in tokens:
                text, raw = _piece(self.piece, t.id)
                # A token the server wrote itself (a thinking budget's end tag, a forced header: source "grammar")
                # was never drawn from the model and had no other choice: 0.0, where OpenAI's field is a number.
                logprob = t.logprob if t.logprob is not None else 0.0
                content.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": [
                    {"token": (p := _piece(self.piece, i))[0], "logprob": lp, "bytes": p[1]}
                    for i, lp in t.top_logprobs]})
            return {"content": content}
        texts = [self.piece_text(t.id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": texts, "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{_piece(self.piece, i)[0]: lp for i, lp in t.top_logprobs} for t in tokens],
                "text_offset": offsets}

    # -- choices -----------------------------------------------------------

    def _choice(self, index: int, text: str | None, finish_reason: str | None, delta: bool, role: bool = False,
                logprobs: dict[str, object] | None = None, calls: Sequence[tuple[int, ToolCall]] = (),
                reasoning: str = "") -> dict[str, object]:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        body: dict[str, object] = {"role": "assistant"} if role or not delta else {}
        if reasoning:  # llama-server's field, before the content as it sends them
            body["reasoning_content"] = reasoning
        if text or (not delta and not calls) or role:
            body["content"] = text or ""
        elif not delta:
            body["content"] = None  # only tool calls
        if calls:
            body["tool_calls"] = [{**({"index": k} if delta else {}), "id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}} for k, c in calls]
        return {"index": index, ("delta" if delta else "message"): body, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def _extras(self, dones: tuple[Done, ...], thought: int = 0) -> dict[str, object]:
        """usage (`thought`: the choices' tokens of thinking) and llama-server's timings (for several choices, a
        list of each one's)."""
        label = strategy_label(self.request.strategy, self.request.options)
        each = [timings(d.stats, label) for d in dones]
        return {"usage": usage(tuple(d.stats for d in dones), thought if self.thinks else None),
                "timings": each[0] if len(each) == 1 else each}

    def whole(self, dones: tuple[Done, ...], tokens: Sequence[Sequence[Token]] = ()) -> dict[str, object]:
        """The whole answer: each choice's text (or, when it called tools, its calls) and log-probabilities."""
        kind = "chat.completion" if self.chat else "text_completion"
        choices = []
        for i, d in enumerate(dones):
            text, calls = self._text(d), []
            if self.request.calls_tools and self.tool_format == "harmony":  # the content is the split's already
                calls = calls_of(d.tokens, self.call_piece or self.piece, self._names)
            elif self.request.calls_tools:
                text, calls = parse_answer(text, self.tool_format, self._names)
            finish = "tool_calls" if calls else FINISH_REASONS.get(d.reason, "stop")
            choices.append(self._choice(i, text, finish, delta=False,
                                        logprobs=self.logprobs(tokens[i] if i < len(tokens) else ()),
                                        calls=list(enumerate(calls)), reasoning=d.reasoning if self.thinks else ""))
        thought = sum(t.channel == "reasoning" for each in tokens for t in each)
        return {**self._object(kind, choices), **self._extras(dones, thought)}

    def chunk(self, text: str, index: int = 0, role: bool = False, logprobs: dict[str, object] | None = None,
              calls: Sequence[tuple[int, ToolCall]] = (), reasoning: str = "") -> dict[str, object]:
        return self._object(self._chunk_kind, [self._choice(index, text, None, delta=True, role=role,
                                                            logprobs=logprobs, calls=calls, reasoning=reasoning)])

    def text_chunk(self, text: str, index: int = 0) -> bytes:
        """`sse(self.chunk(text, index))` for a chunk of non-empty text alone (no log-probabilities, reasoning or
        calls): most of a stream's chunks. The object around the text is serialized once per choice, and each
        chunk only encodes its text: building and encoding the whole object took about a third of the event
        loop's time per streamed token, and that loop shares the cores llama.cpp decodes on."""
        frame = self._text_frames.get(index)
        if frame is None:
            encoded = _JSON.encode(_MARK).encode()
            before, mark, after = sse(self.chunk(_MARK, index)).partition(encoded)
            assert mark and encoded not in after, "a text chunk holds its text once"
            frame = self._text_frames[index] = (before, after)
        return b"%s%s%s" % (frame[0], _JSON.encode(text).encode(), frame[1])

    def finish_chunk(self, index: int, done: Done, text: str | None = None, called: bool = False,
                     reasoning: str = "") -> dict[str, object]:
        """A choice's last chunk: its finish reason (and any text held back for a stop string, any reasoning
        held back for a tag that did not come)."""
        finish = "tool_calls" if called else FINISH_REASONS.get(done.reason, "stop")
        return self._object(self._chunk_kind, [self._choice(index, done.tail if text is None else text, finish,
                                                            delta=True, reasoning=reasoning)])

    def closing_chunks(self, last: dict[str, object], dones: tuple[Done, ...], thought: int = 0
                       ) -> list[dict[str, object]]:
        """The stream's end, after every choice's finish chunk (`last` is the last of them): the timings on it,
        as llama-server sends them; with include_usage, a usage chunk after it that carries them instead."""
        extras = self._extras(dones, thought)
        if not self.request.include_usage:
            return [{**last, "timings": extras["timings"]}]
        return [last, {**self._object(self._chunk_kind, []), **extras}]


# json.dumps(obj, ensure_ascii=False) builds an encoder per call; one encoder, reused, writes the same text.
_JSON = json.JSONEncoder(ensure_ascii=False)
_MARK = "\x00text\x00"  # text_chunk's stand-in for the text, while it serializes a chunk's frame


def sse(obj: object) -> bytes:
    return f"data: {_JSON.encode(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def done_error(done: Done) -> ApiError:
    if done.reason == "cancelled":
        return ApiError(503, "the generation was cancelled (the server is stopping)", code="cancelled")
    return ApiError(500, f"the generation failed: {done.error or 'unknown error'}", code="generation_failed")


def done_response(dones: tuple[Done, ...], reply: Reply, tokens: Sequence[Sequence[Token]] = ()) -> Response:
    return JSONResponse(reply.whole(dones, tokens))
