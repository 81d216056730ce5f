"""A streamed answer's text chunks: the frame serialized once per choice (Reply.text_chunk) writes the same bytes as
the whole chunk object encoded each time (sse(Reply.chunk)), for both endpoints, every choice and any text."""

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
