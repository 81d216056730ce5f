"""A restarted server answering a returning conversation: its KV cells from the disk store against decoding
the prompt (not a test: a measurement for backends/prompt_cache.py and backends/kv_store.py).

Each repeat, for the store on (`--kv-cache-disk 2G`, the default) and off
(`--kv-cache-disk 0`), in alternating order: a fresh data folder, a server
that answers a conversation of about --tokens tokens (one token) and is
stopped (Ctrl-C: its cells go to disk), then a new server that is sent the
same conversation, streamed; its time to first token is the figure (from the
request to the first chunk with text, as a client sees it). Medians over
repeats.

    python tests/perf/kv_server_restart.py -m smollm2 -md smollm2-draft --tokens 3000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402

from serve_helpers import start_server, stop_server  # noqa: E402


def conversation(turns: int) -> list[dict]:
    """A made-up chat of `turns` exchanges, and a last question (the returning user's)."""
    messages: list[dict] = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"Question {i}: what do you know about topic number {i}? "
                                                 "Be thorough."},
                     {"role": "assistant", "content": " ".join(f"Topic {i} has property {j}, which matters because "
                                                               f"of reason {j * 7 % 11}." for j in range(12))}]
    return [*messages, {"role": "user", "content": "Summarize everything."}]


def first_token(url: str, messages: list[dict]) -> tuple[float, int, int]:
    """Seconds to the first chunk with text; the prompt's tokens, and how many of them were cached."""
    t0 = time.perf_counter()
    ttft, prompt_tokens, cached = None, 0, 0
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if ttft is None:
        raise RuntimeError("no token came")
    return ttft, prompt_tokens, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", default="smollm2")
    ap.add_argument("-md", default="smollm2-draft")
    ap.add_argument("--tokens", type=int, default=3000, help="about this many prompt tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-t", default="2")
    args = ap.parse_args()
    messages = conversation(max(1, args.tokens // 230))  # about 230 tokens an exchange through SmolLM2's template
    times: dict[str, list[float]] = {"store": [], "none": []}
    tokens = 0
    for rep in range(args.repeats):
        for kind in (("store", "none") if rep % 2 == 0 else ("none", "store")):
            folder = Path(tempfile.mkdtemp(prefix=f"kv-restart-{kind}-"))
            os.environ["SPECCHAT_KV_DIR"] = str(folder / "kv")
            flags = ["-m", args.m, "-md", args.md, "-c", str(args.tokens + 1024), "-np", "1",
                     "--kv-cache-disk", "2G" if kind == "store" else "0"]
            served = start_server(flags, folder / "first.log", threads=args.t)
            try:
                first_token(served.url, messages)
            finally:
                stop_server(served)
            served = start_server(flags, folder / "second.log", threads=args.t)
            try:
                ttft, tokens, cached = first_token(served.url, messages)
            finally:
                stop_server(served)
            times[kind].append(ttft)
            print(f"repeat {rep + 1}, {kind}: first token after {ttft:.3f} s ({tokens} prompt tokens, {cached} cached)",
                  flush=True)
    store, none = statistics.median(times["store"]), statistics.median(times["none"])
    print(f"{tokens} prompt tokens: restored {store:.3f} s, decoded {none:.3f} s, restored / decoded {store / none:.3f}")


if __name__ == "__main__":
    main()
