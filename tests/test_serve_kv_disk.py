"""A restarted server answers a returning prompt at once: when `specchat serve` stops, its slots' cells (the
target's and the draft's) and its RAM prompt cache go to the KV store on disk (backends.prompt_cache,
backends.kv_store), and the next server takes them back by the longest prefix of a prompt instead of decoding it,
in the target and in the draft; the answer is the same."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from backends.kv import common_prefix
from serve_helpers import API_KEY, start_server, stop_server

PROMPT = " ".join(["the cat sat on the mat and the dog ran to the tree"] * 12)


def _complete(served, prompt: str) -> dict:
    r = httpx.post(f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                   json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def _twice(args: list[str], tmp_path: Path) -> tuple[dict, dict, list[dict]]:
    """PROMPT answered by a server, then by a second one started after the first stopped: the second answer, the
    second server's /health after it, and the header lines of the KV files the first server left."""
    served = start_server(args, tmp_path / "first.log")
    try:
        first = _complete(served, PROMPT)
    finally:
        stop_server(served)
    files = list((tmp_path / "kv").glob("*.kv"))
    assert files, "the slots' cells went to disk when the server stopped"
    headers = [json.loads(path.read_bytes().partition(b"\n")[0]) for path in files]  # kv_store.write_entry's
    served = start_server(args, tmp_path / "second.log")
    try:
        again = _complete(served, PROMPT)
        health = served.health()
    finally:
        stop_server(served)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the first decoded it: no store yet
    prompt_tokens = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 2
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    return again, health, headers


def test_a_restarted_server_restores_a_returning_prompt(tiny, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_KV_DIR", str(tmp_path / "kv"))
    # Plain decoding (-s ar), so that "the same answer" holds token for token: under the default `auto` the two
    # servers' batches follow their live timings, and the answer's 7th token wins by 0.022 only
    # (tests/perf/greedy_margins.py).
    _twice(["-m", str(tiny.target), "-md", str(tiny.draft), "--api-key", API_KEY, "-np", "4", "-s", "ar"], tmp_path)


def test_a_restarted_server_restores_the_draft_s_cells_too(tiny, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a strategy that drafts (`-s sps`), the draft's cells go to disk beside the target's and come back with
    them: the second server's draft does not decode the prompt again; the greedy answer is the first server's
    (which decoded the prompt, the store empty)."""
    monkeypatch.setenv("SPECCHAT_KV_DIR", str(tmp_path / "kv"))
    args = ["-m", str(tiny.target), "-md", str(tiny.draft), "--api-key", API_KEY, "-np", "4", "-s", "sps"]
    again, health, headers = _twice(args, tmp_path)
    prompt_tokens = again["usage"]["prompt_tokens"]
    assert any(common_prefix(h["draft_tokens"], h["target_tokens"]) >= prompt_tokens - 1 and h["draft_bytes"] > 0
               for h in headers), "a KV file holds the draft's cells of the prompt"
    cache = health["prompt_cache"]
    assert cache["restored"] == 1 and cache["tokens_restored"] >= prompt_tokens - 2
    assert cache["draft_tokens_restored"] >= prompt_tokens - 2
    assert health["kv_cells"] == health["kv_cached"]
