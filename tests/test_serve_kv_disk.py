"""A restarted server answers a returning prompt at once: when `specchat serve` stops, its slots' cells and its
RAM prompt cache go to the KV store on disk (backends.prompt_cache, backends.kv_store), and the next server
takes them back by the longest prefix of a prompt instead of decoding it; the answer is the same."""

from __future__ import annotations

import httpx
import pytest

from serve_helpers import API_KEY, start_server, stop_server

PROMPT = " ".join(["the cat sat on the mat and the dog ran to the tree"] * 12)


def _complete(served, prompt: str) -> dict:
    r = httpx.post(f"{served.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                   json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_restarted_server_restores_a_returning_prompt(tiny, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_KV_DIR", str(tmp_path / "kv"))
    args = ["-m", str(tiny.target), "-md", str(tiny.draft), "--api-key", API_KEY, "-np", "4"]
    served = start_server(args, tmp_path / "first.log")
    try:
        first = _complete(served, PROMPT)
    finally:
        stop_server(served)
    assert list((tmp_path / "kv").glob("*.kv")), "the slots' cells went to disk when the server stopped"
    served = start_server(args, tmp_path / "second.log")
    try:
        again = _complete(served, PROMPT)
    finally:
        stop_server(served)
    prompt_tokens = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 2
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
