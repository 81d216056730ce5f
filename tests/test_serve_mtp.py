"""`specchat serve -np 4` on a target that carries its own MTP head (tests/drafter_factory.py): eight clients
at once, every strategy that drafts with the head among them, each get the text they get alone; the answers'
timings count the head's drafts; no KV cell is left behind."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from drafter_factory import MtpModel, write_mtp_target
from engine_helpers import BATCH_NOISE, min_greedy_gap
from serve_helpers import API_KEY, Served, spec, start_server, stop_server, timings_of

# Prompts whose greedy answers have no near-tie that batching could flip (checked below).
PROMPTS = [("the cat sat on the mat", "sps"), ("return a mat", "auto"), ("the big red dog", "ar"),
           ("print hello world", "tree"), ("there was a house", "sps"), ("the mat is red", "auto"),
           ("hello world code", "sps"), ("big small red blue", "ar")]
N = 40


@pytest.fixture(scope="module")
def mtp_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mtp_target(tmp_path_factory.mktemp("mtp") / "agreeing.gguf", MtpModel(residual=0.1, head_noise=0.1))


@pytest.fixture(scope="module")
def mtp_server(mtp_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Served:
    served = start_server(["-m", str(mtp_file), "--api-key", API_KEY, "-np", "4", "--no-memory"],
                          tmp_path_factory.mktemp("serve-mtp") / "server.log")
    yield served
    stop_server(served)


def test_the_prompts_have_no_near_tie(mtp_file: Path) -> None:
    """The precondition below: every greedy choice wins by more than batching can move a logit."""
    from backends.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(target=mtp_file, n_ctx=512, threads=1, cost_cache=Path(""), memory=False))
    try:
        for prompt, _ in PROMPTS:
            assert min_greedy_gap(engine, engine.tokenize(prompt), N) > BATCH_NOISE, prompt
    finally:
        engine.close()


def _answer(served: Served, prompt: str, strategy: str, stream: bool):
    kwargs = dict(model="agreeing", prompt=prompt, max_tokens=N, temperature=0, extra_body=spec(strategy))
    client = served.client()
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        return "".join(c.choices[0].text for c in chunks if c.choices), timings_of(chunks[-1])
    answer = client.completions.create(**kwargs)
    return answer.choices[0].text, timings_of(answer)


def test_concurrent_clients_draft_with_the_head_and_each_gets_its_text(mtp_server: Served) -> None:
    alone = [_answer(mtp_server, p, s, stream=False) for p, s in PROMPTS]
    plain = [_answer(mtp_server, p, "ar", stream=False)[0] for p, _ in PROMPTS]
    assert [text for text, _ in alone] == plain, "every strategy gives ar's text"
    assert sum(t.get("draft_n_accepted", 0) for _, t in alone) > 0, [t for _, t in alone]
    got: list[str | None] = [None] * len(PROMPTS)

    def ask(i: int) -> None:
        got[i] = _answer(mtp_server, *PROMPTS[i], stream=i % 2 == 0)[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == plain
    health = mtp_server.health()
    assert health["parallel"] == 4 and health["running"] == 0 and health["kv_errors"] == 0
