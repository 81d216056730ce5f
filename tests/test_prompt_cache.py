"""The server's prompt cache (backends.prompt_cache) on real llama.cpp: what a slot gives up for a new prompt is
saved in RAM (its target's cells and its draft's: a draft model, an MTP head, an EAGLE-3 or DFlash drafter) and
put back when its conversation returns, with the same greedy text, no leaked cells, and within its bound;
`specchat serve -np 1` serves two alternating conversations without decoding them again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.config import StrategyOptions
from backends.engine import Engine, EngineConfig
from backends.events import Done, Event
from backends.kv import common_prefix
from backends.prompt_cache import MIN_TOKENS, PromptCache
from backends.sampling import GenParams
from backends.slot_pool import SlotPool
from dflash_factory import DFlashPair, write_dflash_pair
from drafter_factory import MtpModel, write_mtp_target
from eagle3_factory import Eagle3Pair, write_eagle3_pair
from serve_helpers import start_server, stop_server
from test_batching import _leaks

# Long enough to be worth saving (MIN_TOKENS), and sharing less than half of their tokens.
TEXTS = ["the cat sat on the mat and the dog ran to the house " * 3,
         "once upon a time there was a big red dog " * 3,
         "print hello world def return the big cat " * 3]
GREEDY = GenParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def one_slot(tiny) -> Engine:
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1, n_seq_max=4,
                                 n_parallel=1, cost_cache=None))
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["draft model", "mtp", "eagle3", "dflash"])
def drafted(request, one_slot: Engine, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """One slot with each kind of draft sequence: a draft model's (the tiny pair), a target's MTP head, an EAGLE-3
    and a DFlash drafter (the agreeing files of tests/test_mtp.py, test_eagle3.py, test_dflash.py)."""
    if request.param == "draft model":
        yield one_slot
        return
    d = tmp_path_factory.mktemp(request.param)
    target, draft = d / "target.gguf", d / "draft.gguf"
    if request.param == "mtp":
        write_mtp_target(target, MtpModel(residual=0.1, head_noise=0.1))
        draft = None
    elif request.param == "eagle3":
        write_eagle3_pair(target, draft, model=Eagle3Pair(residual=0.02, head_noise=0.1))
    else:
        write_dflash_pair(target, draft, model=DFlashPair(residual=0.02, sharpness=3.0, noise=0.1, ffn_noise=0.1,
                                                          mix=8.0))
    engine = Engine(EngineConfig(target=target, draft=draft, n_ctx=512, threads=1, n_seq_max=4, n_parallel=1,
                                 cost_cache=None, memory=False))
    assert engine.slots[0].draft is not None
    yield engine
    engine.close()


def _admit(pool: SlotPool, prompt: list[int], strategy: str = "ar") -> list[Event]:
    events: list[Event] = []
    pool.admit(strategy, StrategyOptions(), prompt, GREEDY, events.append)
    return events


def _finish(pool: SlotPool, events: list[Event]) -> Done:
    pool.run()
    done = events[-1]
    assert isinstance(done, Done) and done.reason == "length", done
    return done


def _run(pool: SlotPool, prompt: list[int], strategy: str = "ar") -> Done:
    return _finish(pool, _admit(pool, prompt, strategy))


def _fresh_pool(engine: Engine, cache_mib: int = 64) -> SlotPool:
    pool = SlotPool(engine, cache_mib)
    for slot in range(pool.size):
        pool.reset(slot)
    return pool


def test_a_conversation_that_lost_its_slot_is_put_back(one_slot: Engine) -> None:
    pool = _fresh_pool(one_slot)
    a, b = (one_slot.tokenize(t) for t in TEXTS[:2])
    assert len(a) >= 2 * MIN_TOKENS and len(b) >= 2 * MIN_TOKENS
    first = _run(pool, a)
    _run(pool, b)  # takes the only slot: a's cells are saved first
    assert pool.prompt_cache.stats().entries == 1
    for strategy in ("ar", "sps"):
        again = _run(pool, a, strategy)
        assert again.stats.prompt_cached == len(a) - 1  # all of it but the last token, decoded for its logits
        assert again.tokens == first.tokens
        _run(pool, b)  # and b comes back from the cache in turn
    stats = pool.prompt_cache.stats()
    assert stats.restored == 4 and stats.tokens_restored > 0
    assert _leaks(one_slot) == []
    held, recorded = pool.cells()
    assert held == recorded


def test_a_conversation_s_draft_cells_come_back_with_its_target_s(drafted: Engine) -> None:
    """The slot given up keeps its draft's cells beside its target's: when the conversation returns, the draft
    holds its prompt again (not the other conversation's cells, which it would decode the prompt after), and
    sps says token for token what ar says."""
    engine = drafted
    pool = _fresh_pool(engine)
    draft = engine.slots[0].draft
    a, b = (engine.tokenize(t) for t in TEXTS[:2])
    assert len(a) >= 2 * MIN_TOKENS and common_prefix(a, b) < MIN_TOKENS
    want = _run(pool, a).tokens
    assert _run(pool, a, "sps").tokens == want  # the draft decodes a's conversation
    assert common_prefix(draft.tokens, a) >= len(a) - 1
    _run(pool, b, "sps")  # takes the only slot: a's cells, the target's and the draft's, are saved first
    assert common_prefix(draft.tokens, a) < MIN_TOKENS
    events = _admit(pool, a, "sps")
    assert common_prefix(draft.tokens, a) >= len(a) - 1, "the draft's cells came back with the target's"
    stats = pool.prompt_cache.stats()
    assert stats.restored == 1 and stats.draft_tokens_restored >= len(a) - 1 - MIN_TOKENS
    again = _finish(pool, events)
    assert again.stats.prompt_cached == len(a) - 1
    assert again.tokens == want
    assert _leaks(engine) == []
    held, recorded = pool.cells()
    assert held == recorded


def test_off_the_prompt_decodes_again(one_slot: Engine) -> None:
    pool = _fresh_pool(one_slot, cache_mib=0)
    a, b = (one_slot.tokenize(t) for t in TEXTS[:2])
    first = _run(pool, a)
    _run(pool, b)
    again = _run(pool, a)
    assert again.stats.prompt_cached < len(a) // 2  # only what b's conversation shares with it
    assert again.tokens == first.tokens
    assert pool.prompt_cache.stats().entries == 0


def test_the_cache_keeps_to_its_bound_least_recently_used_out(one_slot: Engine) -> None:
    pool = _fresh_pool(one_slot, cache_mib=0)
    a, b, c = (one_slot.tokenize(t) for t in TEXTS)
    sizes = []
    for prompt in (a, b, c):
        _run(pool, prompt)
        sizes.append(len(one_slot.slots[0].target.save()))
    pool = _fresh_pool(one_slot)
    pool.prompt_cache = PromptCache(max(sizes) + min(sizes) - 1)  # room for any one of them, never two
    _run(pool, a)
    _run(pool, b)  # a saved
    _run(pool, c)  # b saved, a out
    stats = pool.prompt_cache.stats()
    assert stats.entries == 1 and stats.bytes <= pool.prompt_cache.max_bytes
    assert _run(pool, b).stats.prompt_cached == len(b) - 1
    assert _run(pool, a).stats.prompt_cached < len(a) // 2  # gone: decoded again


def test_a_conversation_that_goes_on_replaces_its_shorter_self(one_slot: Engine) -> None:
    pool = _fresh_pool(one_slot)
    a, b = (one_slot.tokenize(t) for t in TEXTS[:2])
    answer = _run(pool, a).tokens
    _run(pool, b)  # a (with its answer) saved
    turn = a + list(answer) + one_slot.tokenize(" and the dog")
    assert _run(pool, turn).stats.prompt_cached >= len(a) + len(answer) - 1
    _run(pool, b)  # the longer conversation is saved; the shorter one it extends goes
    assert pool.prompt_cache.stats().entries == 2  # b and the whole conversation, not a as well


def test_serve_puts_a_returning_conversation_back(tiny, tmp_path: Path) -> None:
    served = start_server(["-m", str(tiny.target), "-np", "1"], tmp_path / "server.log")
    try:
        client = served.client()
        texts = {}
        for i in (0, 1, 0, 1):
            r = client.completions.create(model="target", prompt=TEXTS[i], max_tokens=8, temperature=0)
            cached = r.usage.prompt_tokens_details.cached_tokens
            if i in texts:
                assert cached == r.usage.prompt_tokens - 1 and r.choices[0].text == texts[i]
            else:
                assert cached < r.usage.prompt_tokens // 2
                texts[i] = r.choices[0].text
        health = served.health()
        assert health["prompt_cache"]["restored"] == 2 and health["kv_cells"] == health["kv_cached"]
    finally:
        stop_server(served)
