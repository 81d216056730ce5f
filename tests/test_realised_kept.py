"""The realised check's record kept for the next process (backends.realised `to_json` / `from_json`,
backends.slot.Learnt): round trips, another spell of the machine, stale and malformed records, schedulers and
pools taking it up. The rule itself: tests/test_realised.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.engine import Engine, EngineConfig
from backends.realised import DECAY, KEPT_FOR, MIN_SPECULATED, STALE, Realised
from backends.sampling import GenParams
from backends.scheduler import Scheduler
from backends.slot import Learnt
from backends.slot_pool import SlotPool
from backends.store import JsonStore
from auto_helpers import pool_run
from realised_helpers import _drive, _ticks


def _losing_at_2() -> Realised:
    r = Realised()
    _ticks(r, 20, 2, False, 2, 0.02)
    _ticks(r, 20, 2, True, 3, 0.04)
    _ticks(r, 20, 1, True, 3, 0.02)
    for _ in range(6):  # decided, plain rows, at 1
        r.deciding()
        r.add(1, False, 1, 0.01)
        r.next_tick()
    return r


def test_the_record_round_trips_through_json() -> None:
    r = _losing_at_2()
    entry = json.loads(json.dumps(r.to_json()))
    assert len(json.dumps(entry)) < 400, "a few hundred bytes"
    again = Realised.from_json(entry)
    # (a new process goes on from the next multiple of STALE: its first ticks plain, `test_a_kept_record_is...`)
    assert again.tick == -(-r.tick // STALE) * STALE and set(again.plain) == {2} and set(again.speculated) == {1, 2}
    assert set(again.decided) == {1} and again.decided[1].rate == pytest.approx(r.decided[1].rate, rel=1e-5)
    for b in (1, 2):
        assert again.pays(b) == r.pays(b)
    assert again.speculated[2].rate == pytest.approx(r.speculated[2].rate, rel=1e-5)
    assert again.speculated[2].count == pytest.approx(r.speculated[2].count, abs=1e-3)
    for x in (r, again):  # and it goes on from there alike
        _ticks(x, STALE, 2, False, 2, 0.02)
    assert again.pays(2) is r.pays(2) is False and not again.allows(2) and not r.allows(2)


def test_a_record_of_many_ticks_round_trips_too() -> None:
    """A kind seen for hundreds of ticks has a count at its limit, 1/(1-DECAY); kept to three decimals it reads
    20.0, a hair above the limit in floating point, and the whole record was refused: every session longer than
    a few hundred ticks kept nothing (found in the chat app's learnt.json, its plain count at 20.0)."""
    r = Realised()
    _ticks(r, 400, 1, False, 1, 0.02)
    _ticks(r, 20, 1, True, 2, 0.03)
    entry = json.loads(json.dumps(r.to_json()))
    assert entry["plain"]["1"][3] == pytest.approx(1 / (1 - DECAY), abs=1e-3)
    again = Realised.from_json(entry)
    assert set(again.plain) == set(again.speculated) == {1}
    assert again.plain[1].rate == pytest.approx(50.0, rel=1e-5) and again.pays(1) is r.pays(1) is True


def test_a_kept_record_is_another_spell_of_the_machine() -> None:
    """A record kept under load (plain ticks at 15.6 tok/s, speculation at 45.9: it pays) is taken up by the next
    process on a quiet machine, where plain decoding runs at 51.8 tok/s and speculation delivers 43.9. Its verdict
    stands at first, but its first ticks are plain (due at once), and their rate replaces the kept one: held back
    until a probe brings speculation's own new evidence, which replaces its kept rate and count, so that a few
    ticks of this spell judge it, and hold it back again. (Kept at full weight, the old plain rate let the chat
    app's next answer speculate unchecked at 0.85x plain decoding: still 16.5 tok/s after a dozen ticks here.)"""
    old = Realised()
    _ticks(old, 20, 1, False, 1, 1 / 15.6)
    _ticks(old, 20, 1, True, 2, 2 / 45.9)
    assert old.pays(1) is True
    r = Realised.from_json(json.loads(json.dumps(old.to_json())))
    assert r.pays(1) is True and r.allows(1) is False and r.plain_due(1), "its verdict stands; a plain tick is due"
    kinds = _drive(r, 2 * STALE, 1, lambda rows: (2, 2 / 43.9) if rows == "decided" else (1, 1 / 51.8))
    assert all(k == "held" for k in kinds[:STALE // 2]), f"held back until its probe: {kinds}"
    assert 1 <= kinds.count("decided") <= MIN_SPECULATED + 4, f"a few ticks of this spell judge it: {kinds}"
    assert r.plain[1].rate == pytest.approx(51.8, rel=1e-6), "the plain rate of now"
    assert r.speculated[1].rate == pytest.approx(43.9, rel=1e-6), "speculation's, of now"
    assert r.pays(1) is False and not r.allows(1), "held back: it delivers less than plain decoding now"
    # One tick of this spell tells a plain rate, not a speculating one: the first new plain tick keeps the kept
    # count (evidence enough to judge by), the first speculating tick starts it over (a probe judged as twenty
    # held the Gemma pair back in the chat app).
    r = Realised.from_json(json.loads(json.dumps(old.to_json())))
    kept = r.plain[1].count
    r.add(1, False, 1, 1 / 51.8)
    r.next_tick()
    r.add(1, True, 2, 2 / 20.0)
    assert r.plain[1].count == pytest.approx(kept * DECAY + 1) and r.speculated[1].count == 1.0
    assert r.pays(1) is None, "one speculating tick of this spell: not yet judged (a gross loss after two)"
    # The other way: kept held back, the next process does not speculate before its own evidence says it pays,
    # and it probes within STALE ticks: on a machine where it now pays, it runs again.
    old = Realised()
    _ticks(old, 20, 1, False, 1, 0.02)
    _ticks(old, 20, 1, True, 1, 0.03)
    r = Realised.from_json(json.loads(json.dumps(old.to_json())))
    kinds = _drive(r, 2 * STALE, 1, lambda rows: (3, 0.025) if rows == "decided" else (1, 0.02))
    assert all(k == "held" for k in kinds[:STALE // 2]), "no speculation before its probe"
    after = kinds[STALE // 2 + 2:]
    assert after.count("decided") >= len(after) - 4, f"it runs again (but for due plain ticks): {kinds}"


def test_a_stale_or_malformed_record_is_ignored() -> None:
    entry = _losing_at_2().to_json()
    now = entry["saved_at"]
    bad = [
        None, [], {}, {**entry, "format": 3}, {**entry, "format": 5}, {**entry, "tick": -1}, {**entry, "tick": 1.5},
        {**entry, "plain": []}, {**entry, "plain": {"0": [1, 1, 0, 1, 0]}}, {**entry, "plain": {"x": [1, 1, 0, 1, 0]}},
        {**entry, "plain": {"2": [1, 1, 1, 0]}}, {**entry, "plain": {"2": [1, -1, 0, 1, 0]}},
        {**entry, "plain": {"2": [1, float("nan"), 0, 1, 0]}},
        {**entry, "plain": {"2": [1, 1, 0, 1, entry["tick"] + 1]}}, {**entry, "plain": {"2": [1, 1, 0, 1e9, 0]}},
        {**entry, "plain": {"2": [1, 1, 2, 1, 0]}},  # more seconds in the decode than in the tick
        {k: v for k, v in entry.items() if k != "speculated"},
        {k: v for k, v in entry.items() if k != "decided"},
        {**entry, "saved_at": None},
    ]
    for data in bad:
        r = Realised.from_json(data, now)
        assert r.tick == 0 and not r.plain and not r.speculated and not r.decided, data
    assert not Realised.from_json(entry, now + KEPT_FOR + 1).plain, "older than a week"
    assert Realised.from_json(entry, now + KEPT_FOR - 1).plain


def test_a_new_scheduler_starts_from_the_record_kept_and_a_bench_from_nothing(tmp_path: Path) -> None:
    """A session's schedulers share one record (a bench's runs, each with its own pool, go on from the last
    one's, as a server's one pool does); a new session starts from what the last kept, a bench from nothing."""
    store = JsonStore(tmp_path / "learnt.json")
    learnt = Learnt(store, lambda: "k")
    scheduler = Scheduler(None, learnt)
    assert scheduler.load.realised.tick == 0
    learnt.flush(force=True)
    assert not store.path.exists(), "nothing learnt: nothing written"
    losing, record = _losing_at_2(), scheduler.load.realised  # (what its ticks would have recorded)
    record.plain, record.speculated, record.tick = losing.plain, losing.speculated, losing.tick
    assert Scheduler(None, learnt).load.realised is record, "the session's next scheduler goes on from it"
    learnt.flush(force=True)
    assert Scheduler(None, Learnt(store, lambda: "k")).load.realised.pays(2) is False
    bench = Learnt(store, lambda: "k")
    bench.afresh()
    assert not Scheduler(None, bench).load.realised.plain
    learnt.afresh()
    assert not Scheduler(None, learnt).load.realised.plain, "afresh: this session's record starts over too"
    assert not Scheduler(None, Learnt(store, lambda: "other device")).load.realised.plain


def test_a_restarted_pool_takes_up_what_the_last_one_recorded(tiny, tmp_path: Path) -> None:
    """Real llama.cpp: two sequences decode plainly; the engine closes. The next engine on the same files starts
    its pool's record from that one's."""
    config = EngineConfig(target=tiny.target, n_ctx=512, threads=1, n_seq_max=8, n_parallel=2,
                          cost_cache=tmp_path / "device-cost.json")
    engine = Engine(config)
    try:
        prompts = [engine.tokenize("the cat sat on the mat"), engine.tokenize("once upon a time there was")]
        pool, _ = pool_run(engine, [("ar", p) for p in prompts], GenParams(max_tokens=16, temperature=0.0))
        recorded = pool.scheduler.load.realised
    finally:
        engine.close()
    engine = Engine(config)
    try:
        again = SlotPool(engine).scheduler.load.realised
        assert again.tick == -(-recorded.tick // STALE) * STALE and set(again.plain) == set(recorded.plain)
        assert again.plain[2].rate == pytest.approx(recorded.plain[2].rate, rel=1e-5)
    finally:
        engine.close()
