"""The answers' shapes: OpenAI's completion objects and stream chunks, with llama-server's `timings`."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from starlette.responses import JSONResponse, Response

from app.serve.request import ApiError, GenRequest
from backends.events import Done, GenStats
from backends.registry import strategy_label



# -- responses -------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(stats: GenStats | tuple[GenStats, ...]) -> dict[str, object]:
    """OpenAI's usage; for several choices, the prompt once and every choice's completion tokens."""
    many = stats if isinstance(stats, tuple) else (stats,)
    completion = sum(s.generated_tokens for s in many)
    return {
        "prompt_tokens": many[0].prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": many[0].prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": many[0].prompt_cached},
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
    """The fixed parts of one response's objects, chunks included (OpenAI's shapes), for its `n` choices."""

    request: GenRequest
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

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

    def _choice(self, index: int, text: str, finish_reason: str | None, delta: bool,
                role: bool = False) -> dict[str, object]:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        body: dict[str, object] = {"role": "assistant"} if role or not delta else {}
        if text or not delta or role:
            body["content"] = text
        return {"index": index, ("delta" if delta else "message"): body, "logprobs": None,
                "finish_reason": finish_reason}

    def _extras(self, dones: tuple[Done, ...]) -> dict[str, object]:
        """usage and llama-server's timings (for several choices, a list of each one's)."""
        label = strategy_label(self.request.strategy, self.request.options)
        each = [timings(d.stats, label) for d in dones]
        return {"usage": usage(tuple(d.stats for d in dones)), "timings": each[0] if len(each) == 1 else each}

    def whole(self, dones: tuple[Done, ...]) -> dict[str, object]:
        kind = "chat.completion" if self.chat else "text_completion"
        choices = [self._choice(i, d.text, FINISH_REASONS.get(d.reason, "stop"), delta=False)
                   for i, d in enumerate(dones)]
        return {**self._object(kind, choices), **self._extras(dones)}

    def chunk(self, text: str, index: int = 0, role: bool = False) -> dict[str, object]:
        return self._object(self._chunk_kind, [self._choice(index, text, None, delta=True, role=role)])

    def finish_chunk(self, index: int, done: Done) -> dict[str, object]:
        """A choice's last chunk: its finish reason (and any text held back for a stop string)."""
        return self._object(self._chunk_kind,
                            [self._choice(index, done.tail, FINISH_REASONS.get(done.reason, "stop"), delta=True)])

    def closing_chunks(self, last: dict[str, object], dones: tuple[Done, ...]) -> list[dict[str, object]]:
        """The stream's end, after every choice's finish chunk (`last` is the last of them): the timings on it,
        as llama-server sends them; with include_usage, a usage chunk after it that carries them instead."""
        extras = self._extras(dones)
        if not self.request.include_usage:
            return [{**last, "timings": extras["timings"]}]
        return [last, {**self._object(self._chunk_kind, []), **extras}]


def sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def done_error(done: Done) -> ApiError:
    if done.reason == "cancelled":
        return ApiError(503, "the generation was cancelled (the server is stopping)", code="cancelled")
    return ApiError(500, f"the generation failed: {done.error or 'unknown error'}", code="generation_failed")


def done_response(dones: tuple[Done, ...], reply: Reply) -> Response:
    return JSONResponse(reply.whole(dones))
