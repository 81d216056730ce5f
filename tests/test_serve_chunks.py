"""A streamed answer's text chunks: the frame serialized once per choice (Reply.text_chunk) writes the same bytes as
the whole chunk object encoded each time (sse(Reply.chunk)), for both endpoints, every choice and any text. And how
often the engine's thread wakes the event loop: a step a stream, once for a whole answer."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.serve.request import parse_request
from app.serve.responses import Reply, sse
from app.settings import Settings

TEXTS = ["Hello", " world", "\n", 'a "quoted" word', "back\\slash", "tab\there", "\x00\x1f control", "é ü 漢字",
         "emoji 🙂", "\u2028 line separator", "</think>", "data: [DONE]\n\n", "\x00text\x00"]


def _reply(endpoint: str, n: int = 3) -> Reply:
    body = {"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat" else {"prompt": "Hi"}
    request = parse_request({**body, "stream": True, "n": n}, endpoint,  # type: ignore[arg-type]
                            Settings(), 2048, has_draft=False, parallel=n)
    return Reply(request, "smollm2-135m-instruct-F32")


@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_a_text_chunk_is_the_chunk_object_encoded(endpoint: str) -> None:
    reply = _reply(endpoint)
    for index in range(3):
        for text in TEXTS:
            fast = reply.text_chunk(text, index)
            assert fast == sse(reply.chunk(text, index)), (index, text)
            # and, read back as a client reads it, the text of that choice
            assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
            choice = json.loads(fast[len(b"data: "):])["choices"][0]
            assert choice["index"] == index
            assert (choice["delta"]["content"] if endpoint == "chat" else choice["text"]) == text
            assert choice["finish_reason"] is None


def test_each_answer_has_its_own_frame() -> None:
    """Two replies' chunks carry their own ids (the frame is per reply, not shared)."""
    a, b = _reply("chat", 1), _reply("chat", 1)
    assert a.id != b.id
    ids = {json.loads(r.text_chunk("x")[len(b"data: "):])["id"] for r in (a, b)}
    assert ids == {"chatcmpl-" + a.id, "chatcmpl-" + b.id}


def test_chunks_ready_together_go_out_in_one_write() -> None:
    """What the stream has ready at once (the tokens one step accepted) is joined; a chunk with nothing behind it
    goes out at once, whole, and nothing is lost or reordered."""
    from app.serve.http import coalesced

    ready = asyncio.Queue()  # the job's events: what the next chunk waits for
    steps = [[b"a"], [b"b", b"c", b"d"], [b"e"], [b"f", b"g"]]  # the chunks of each step, queued at once

    async def chunks():
        for step in steps:
            for chunk in step:
                ready.put_nowait(chunk)
            while not ready.empty():
                yield ready.get_nowait()

    async def sent() -> list[bytes]:
        return [c async for c in coalesced(chunks(), lambda: not ready.empty())]

    assert asyncio.run(sent()) == [b"a", b"bcd", b"e", b"fg"]


def test_a_whole_answer_wakes_the_event_loop_once_and_a_stream_once_a_step(tiny_engine, monkeypatch) -> None:
    """A request that is not streamed is read only once whole: its tokens go to the event loop with its end, in
    one hand-over, not one a step (each wakes the loop, whose CPU takes a core from the decoding threads on a
    small machine). Its answer, log-probabilities included, is the streamed one's."""
    from starlette.testclient import TestClient

    from app.serve import EngineWorker, ServerConfig, make_app
    from app.serve import worker as worker_module

    handed: list[int] = []
    deliver = worker_module._deliver
    monkeypatch.setattr(worker_module, "_deliver", lambda batch: (handed.append(len(batch)), deliver(batch)))
    worker = EngineWorker(tiny_engine)
    worker.start()
    try:
        app = make_app(ServerConfig(defaults=Settings(target="t", strategy="ar"), model_ids=("t",)), worker)
        body = {"prompt": "the cat", "max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True}
        with TestClient(app) as client:
            whole = client.post("/v1/completions", json=body).json()
            whole_handed, handed[:] = list(handed), []
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                chunks = [json.loads(line.removeprefix("data: ")) for line in s.iter_lines()
                          if line.startswith("data: {")]
    finally:
        worker.stop()
    choice = whole["choices"][0]
    assert whole["usage"]["completion_tokens"] == 12 and len(choice["logprobs"]["tokens"]) == 12
    assert len(whole_handed) <= 3, f"a whole answer handed over in {whole_handed}"
    assert len(handed) >= 12, "a stream's tokens go out as they come"
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]] \
        == choice["logprobs"]["tokens"]
