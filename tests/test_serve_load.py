"""`specchat serve` under load (--parallel 4, the default): eight clients at once each get the text they get
alone, streamed or not, in every strategy; n choices of one request decode together from one prompt decode;
random disconnects and bad requests among them leave every valid request whole and no KV cell behind.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
from engine_helpers import BATCH_NOISE, min_greedy_gap
from serve_helpers import API_KEY, Served, at_once, spec, timings_of

# Prompts whose greedy answers (48 tokens) have no near-tie that batching could flip (checked below).
CONCURRENT = [("the cat sat on the mat", "ar"), ("once the dog sat", "sps"), ("the house ran", "lookup"),
              ("return a mat", "lookahead"), ("hello house", "auto"), ("ran sat time hello once", "tree"),
              ("to print once house mat", "sps"), ("ran to cat", "ar")]
CONCURRENT_N = 48


def test_the_concurrent_prompts_have_no_near_tie(tiny_engine) -> None:
    """The precondition of the tests below: llama.cpp's batched arithmetic moves a logit by up to
    BATCH_NOISE / 2, so an answer whose greedy choices all win by more than BATCH_NOISE is the same in any
    batch. (A prompt with a closer call may rightly answer otherwise under load: tests/test_batching.py
    prints such divergences with their gaps.)"""
    for prompt, _ in CONCURRENT:
        gap = min_greedy_gap(tiny_engine, tiny_engine.tokenize(prompt), CONCURRENT_N)
        assert gap > BATCH_NOISE, f"{prompt!r}: a greedy choice wins by {gap:.4f} only"


def _answer(client: openai.OpenAI, prompt: str, strategy: str, stream: bool, n: int = CONCURRENT_N) -> str:
    kwargs = dict(model="target", prompt=prompt, max_tokens=n, temperature=0, extra_body=spec(strategy))
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    return client.completions.create(**kwargs).choices[0].text


def test_concurrent_clients_decode_together_and_each_gets_its_text(server: Served) -> None:
    """Eight clients at once on four slots (the default --parallel): four decode together, the others wait
    their turn, and each answer (every strategy, streamed or not) is the one it gets alone."""
    client = server.client()
    alone = [_answer(client, p, s, stream=False) for p, s in CONCURRENT]
    got, most = at_once(server, [lambda i=i, prompt=prompt, strategy=strategy:
                                 _answer(server.client(), prompt, strategy, stream=i % 2 == 0)
                                 for i, (prompt, strategy) in enumerate(CONCURRENT)])
    assert most == 4, f"at most {most} requests decoded at once"
    assert got == alone
    health = server.health()
    assert health["parallel"] == 4 and health["running"] == 0 and health["kv_errors"] == 0


def test_n_choices_decode_together_from_one_prompt_decode(server: Served) -> None:
    """n = 3: three choices in one batch. Greedy, each is the answer alone; sampled with a seed, they differ and
    each is reproducible; the prompt is decoded once (the other choices report it cached); a stream's chunks
    carry each choice's index and assemble to the same texts as the whole answer."""
    client = server.client()
    prompt, strategy = CONCURRENT[0]
    alone = _answer(client, prompt, strategy, stream=False)
    kwargs = dict(model="target", prompt=prompt, max_tokens=CONCURRENT_N, extra_body=spec(strategy))
    greedy = client.completions.create(n=3, temperature=0, **kwargs)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert [c.text for c in greedy.choices] == [alone] * 3
    assert greedy.usage.completion_tokens == 3 * timings_of(greedy)[0]["predicted_n"]
    assert [t["cache_n"] for t in timings_of(greedy)[1:]] == [greedy.usage.prompt_tokens - 1] * 2

    sampled = client.completions.create(n=3, temperature=1.0, seed=7, **kwargs)
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) == 3, texts
    streamed = ["", "", ""]
    finish = [None, None, None]
    for chunk in client.completions.create(n=3, temperature=1.0, seed=7, stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert streamed == texts and finish == [c.finish_reason for c in sampled.choices]
    one = client.completions.create(temperature=1.0, seed=7, **kwargs)
    assert one.choices[0].text == texts[0]  # choice 0 draws with the request's seed, choice k with seed + k

    chat = server.client().chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                                   n=2, max_tokens=8, temperature=1.0, seed=3, stream=True)
    indices = {c.index for chunk in chat for c in chunk.choices}
    assert indices == {0, 1}
    health = server.health()
    assert health["running"] == 0 and health["kv_errors"] == 0


def test_disconnects_and_bad_requests_under_load_leave_every_valid_request_whole(server: Served) -> None:
    """8 clients x 6 requests, each at random a whole answer, a stream, a stream the client drops after two
    chunks, or an invalid request: every valid one completes with its own text, the bad ones get 400, and the
    slots end idle with their caches as their records say (kv_errors counts any that did not)."""
    import random

    client = server.client()
    alone = {(p, s): _answer(client, p, s, stream=False) for p, s in CONCURRENT}
    failures: list[str] = []
    before = server.health()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        c = server.client()
        for _ in range(6):
            prompt, strategy = rng.choice(CONCURRENT)
            kind = rng.choice(["whole", "stream", "drop", "bad"])
            try:
                if kind == "bad":
                    r = server.post("/v1/completions", {"prompt": prompt, "temperature": -1})
                    if r.status_code != 400:
                        failures.append(f"bad request answered {r.status_code}")
                elif kind == "drop":
                    stream = c.completions.create(model="target", prompt=prompt, max_tokens=4000, temperature=0,
                                                  stream=True, extra_body=spec(strategy))
                    it = iter(stream)
                    next(it), next(it)
                    stream.close()
                else:
                    text = _answer(c, prompt, strategy, stream=kind == "stream")
                    if text != alone[(prompt, strategy)]:
                        failures.append(f"{strategy} on {prompt!r}: {text!r} != {alone[(prompt, strategy)]!r}")
            except Exception as e:  # noqa: BLE001 - collected and reported below
                failures.append(f"{kind}: {e!r}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    deadline = time.monotonic() + 30
    while server.health()["running"] and time.monotonic() < deadline:  # dropped streams end within a step
        time.sleep(0.05)
    health = server.health()
    assert health["running"] == 0 and health["queued"] == 0 and health["kv_errors"] == 0
    assert health["cancelled"] > before["cancelled"], "the dropped streams were cancelled"
    slots = httpx.get(f"{server.url}/slots", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()
    assert len(slots) == 4 and not any(s["is_processing"] for s in slots)
    # No cell leaked: the caches hold exactly what the slots' records keep for the prefix cache (counted by
    # llama.cpp over every sequence id, target and draft), and the target's part is what /slots reports.
    assert health["kv_cells"] == health["kv_cached"] > 0
    assert sum(s["cached_tokens"] for s in slots) <= health["kv_cached"]

