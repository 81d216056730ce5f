"""`specchat serve -np 4 -md eagle3-draft.gguf` on a target and its EAGLE-3 draft (tests/eagle3_factory.py), started
for real: ten clients at once, greedy and sampled, streamed and not, of different lengths and strategies, on four
slots. Each greedy client gets the text `ar` gives for its prompt alone (in this process, without the draft);
each sampled one gets its whole answer; the answers' timings count the draft's accepted drafts; and the slots'
KV cells, the draft's context among them, are exactly what their records hold after the load (no cell leaks
through the draft's context), and none once the slots are erased, as at the start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from eagle3_factory import Eagle3Pair, write_eagle3_pair
from engine_helpers import BATCH_NOISE, min_greedy_gap, run_to_done
from serve_helpers import API_KEY, Served, at_once, spec, start_server, stop_server, timings_of


@dataclass(frozen=True)
class Ask:
    prompt: str
    strategy: str
    max_tokens: int
    stream: bool
    temperature: float = 0.0
    seed: int | None = None


# Greedy prompts whose answers have no near-tie that batching could flip (checked below), then sampled ones.
GREEDY = [Ask("the cat sat on the mat", "sps", 40, True), Ask("return a mat", "auto", 24, False),
          Ask("a red cat", "tree", 48, True), Ask("time to print", "ar", 16, False),
          Ask("there was a house", "sps", 32, False), Ask("once the dog sat", "tree", 40, False),
          Ask("hello world code", "auto", 48, True), Ask("big small red blue", "lookup", 24, True)]
SAMPLED = [Ask("once upon a time", "sps", 32, True, 0.8, 1), Ask("the dog ran to the house", "tree", 24, False, 1.0, 2)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("eagle3")
    target, draft = d / "agreeing-target.gguf", d / "agreeing-draft.gguf"
    write_eagle3_pair(target, draft, model=Eagle3Pair(residual=0.02, head_noise=0.1))
    return target, draft


@pytest.fixture(scope="module")
def alone(pair: tuple[Path, Path]) -> dict[str, str]:
    """Each greedy prompt's `ar` text, in this process on the target alone (its longest length); and the
    precondition of the test: every greedy choice on the way wins by more than batching can move a logit."""
    from backends.engine import Engine, EngineConfig
    from backends.sampling import GenParams

    engine = Engine(EngineConfig(target=pair[0], n_ctx=512, threads=1, cost_cache=Path(""), memory=False))
    try:
        texts = {}
        for ask in GREEDY:
            prompt = engine.tokenize(ask.prompt)
            assert min_greedy_gap(engine, prompt, ask.max_tokens) > BATCH_NOISE, ask.prompt
            texts[ask.prompt] = run_to_done(engine, "ar", prompt, GenParams(max_tokens=ask.max_tokens,
                                                                           temperature=0.0)).text
        return texts
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Served:
    d = tmp_path_factory.mktemp("serve-eagle3")
    (d / "slots").mkdir()
    server = start_server(["-m", str(pair[0]), "-md", str(pair[1]), "--api-key", API_KEY, "-np", "4", "--no-memory",
                           "--slot-save-path", str(d / "slots")], d / "server.log")
    yield server
    stop_server(server)


def _answer(served: Served, ask: Ask) -> tuple[str, str | None, int, dict]:
    """(text, finish reason, completion tokens, timings) of one completion."""
    kwargs = dict(model="agreeing-target", prompt=ask.prompt, max_tokens=ask.max_tokens,
                  temperature=ask.temperature, extra_body=spec(ask.strategy))
    if ask.seed is not None:
        kwargs["seed"] = ask.seed
    client = served.client()
    if ask.stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
        usage = next(c.usage for c in reversed(chunks) if c.usage is not None)
        return text, finish, usage.completion_tokens, timings_of(chunks[-1])
    out = client.completions.create(**kwargs)
    return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens, timings_of(out)


def test_mixed_concurrent_clients_with_the_eagle3_draft(served: Served, alone: dict[str, str]) -> None:
    start = served.health()
    assert start["parallel"] == 4 and start["kv_cells"] == start["kv_cached"] == 0 and start["kv_errors"] == 0
    asks = GREEDY + SAMPLED
    got, most = at_once(served, [lambda a=a: _answer(served, a) for a in asks])
    failed = [(a, g) for a, g in zip(asks, got) if not isinstance(g, tuple)]
    assert not failed, failed
    assert most == 4, f"at most {most} requests decoded at once"
    for a, (text, _, _, _) in zip(GREEDY, got):
        assert text == alone[a.prompt], f"{a.strategy} on {a.prompt!r} under load differs from ar alone"
    for a, (text, finish, n, timings) in zip(SAMPLED, got[len(GREEDY):]):
        assert text and finish in ("length", "stop") and 0 < n <= a.max_tokens, (a, text, finish, n)
        assert timings["predicted_n"] == n and timings["strategy"] == a.strategy, timings
        assert finish == "stop" or n == a.max_tokens, (a, finish, n)
    drafting = [t for a, (_, _, _, t) in zip(asks, got) if a.strategy in ("sps", "tree")]
    assert all(t["draft_n"] > 0 for t in drafting), drafting
    assert sum(t["draft_n_accepted"] for t in drafting) > 20, drafting

    health = served.health()
    assert health["running"] == 0 and health["queued"] == 0 and health["kv_errors"] == 0
    assert health["handled"] - start["handled"] == len(asks)
    # No cell leaked: every sequence id of every slot, the target's and the EAGLE-3 draft's, holds exactly what
    # the slots' records keep; erased, the slots hold nothing, as at the start.
    assert health["kv_cells"] == health["kv_cached"] > 0, health
    headers = {"Authorization": f"Bearer {API_KEY}"}
    slots = httpx.get(f"{served.url}/slots", headers=headers, timeout=10).json()
    assert len(slots) == 4 and not any(s["is_processing"] for s in slots)
    assert sum(s["cached_tokens"] for s in slots) < health["kv_cached"], "the draft's cells are counted too"
    for s in slots:
        r = served.post(f"/slots/{s['id']}?action=erase", {})
        assert r.status_code == 200 and r.json()["n_erased"] == s["cached_tokens"], r.text
    end = served.health()
    assert end["kv_cells"] == end["kv_cached"] == 0 and end["kv_errors"] == 0, end
