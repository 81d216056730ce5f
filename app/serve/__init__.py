"""`specchat serve`: an OpenAI-compatible HTTP server over one engine.

Routes, shaped as OpenAI's API and llama.cpp's `llama-server` shape them:
`GET /health`, `GET /slots`, `GET /props`, `GET /v1/models`, `POST /tokenize` and `/detokenize`,
`POST /slots/{id}?action=save|restore|erase` (with `--slot-save-path`, `slots`),
`POST /v1/chat/completions` (the messages go
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

A thinking model's chat answers with `reasoning_content` apart from `content`
(llama-server's fields: `reasoning_format`, `chat_template_kwargs`,
`reasoning_effort`, `reasoning_budget_tokens`; `thinking`), and `/v1/models`
and `GET /props` say how it thinks.

The package, by concern: `fields` (the error shape and scalar fields),
`request` (a request's fields, checked), `thinking` (a chat's thinking fields),
`worker` (the engine's thread and its slots), `slots` (llama-server's slot
files), `responses` (OpenAI's answer shapes) and `http` (the Starlette routes
and the uvicorn server).
"""

from app.serve.http import AnnouncingServer, ServerConfig, make_app
from app.serve.worker import EngineWorker

__all__ = ["AnnouncingServer", "EngineWorker", "ServerConfig", "make_app"]
