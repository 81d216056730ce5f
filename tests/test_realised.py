"""The check on what speculation delivers (backends.realised): its rule on synthetic ticks (pure logic) and the
scheduler's record of real ticks on real llama.cpp. The record kept for the next process (backends.slot.Learnt):
tests/test_realised_kept.py; `auto`'s side of it: tests/test_realised_auto.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from backends.engine import Engine, EngineConfig
from backends.realised import (DECIDE_SLACK, MIN_GROSS, MIN_PLAIN, MIN_SPECULATED, PLAIN_EVERY, PROBE_SHARE, STALE,
                               Realised)
from backends.sampling import GenParams
from backends.slot_pool import SlotPool
from auto_helpers import pool_run
from realised_helpers import _drive, _ticks


def test_a_hold_back_lasts_until_speculations_own_new_evidence_not_while_plain_ticks_slow_down() -> None:
    """Speculating ticks 5% slower than plain ones are held back. The machine then slows by 10%, and the plain
    ticks with it: judged as seen, the frozen speculating rate now beats them (`pays`), yet speculation stays held
    back but for its probes, until a probe brings new evidence of its own, which judges it again."""
    r = Realised()
    _ticks(r, 20, 1, False, 1, 0.002)  # 500 tok/s plain
    _ticks(r, 20, 1, True, 1, 0.0021)  # 476 tok/s speculating
    assert not r.allows(1)
    _ticks(r, 30, 1, False, 1, 0.0022)  # held back: plain ticks only, 455 tok/s on the slower machine
    assert r.pays(1) is True, "as seen, speculation now looks the faster"
    allowed = []
    for _ in range(2 * STALE):
        if r.allows(1):
            allowed.append(r.tick)
        _ticks(r, 1, 1, False, 1, 0.0022)
    assert allowed and all(t % STALE == STALE // 2 for t in allowed), f"only its probes: {allowed}"
    _ticks(r, 1, 1, True, 1, 0.0026)  # a probe's tick, well under plain's (the frozen evidence weighs a quarter)
    assert r.pays(1) is False and not r.allows(1), "judged again: still slower"
    _ticks(r, 1, 1, True, 3, 0.0023)  # a later probe finds it paying
    assert r.pays(1) is True and r.allows(1), "released by its own evidence"


def _deciding_ticks(r: Realised, n: int, decode: float, host: float) -> None:
    """Ticks of plain rows that `auto` decided: a step's decode, and its lookups and pricing on top."""
    for _ in range(n):
        r.deciding()
        r.add(1, False, 1, decode + host, decode)
        r.next_tick()


def test_ticks_that_decided_plain_rows_are_judged_by_their_host_work_not_by_the_machines_pace() -> None:
    """While `auto` looks for proposals and finds none worth a row, its ticks are plain rows and its work on top.
    Counted as seen, they were compared with plain ticks of another spell: here the machine is 10% slower while
    `auto` decides, and speculation was held back (before it found a code answer's repeats, which prompt lookup
    alone speeds up 1.56x). Their decode is a plain tick's of now, so their host work is what is judged: 1% of a
    step passes, whatever the machine's pace, and 10% of one is held back, even where a faster spell hides it."""
    for pace, host, pays in ((1.10, 0.0003, True), (0.90, 0.003, False), (1.0, 0.0003, True)):
        r = Realised()
        for _ in range(int(MIN_PLAIN) + 2):  # plain: a 30 ms decode and 0.3 ms of host work
            r.add(1, False, 1, 0.0303, 0.030)
            r.next_tick()
        _deciding_ticks(r, 20, 0.030 * pace, 0.0003 + host)
        assert r.speculated[1].count >= MIN_SPECULATED
        assert r.pays(1) is pays, (pace, host)
        assert r.allows(1) is pays or r.plain_due(1)
        raw = 1 / (0.030 * pace + 0.0003 + host)  # as seen: the old verdict, the other way round
        assert (raw >= r.plain[1].rate) is not pays, (pace, host)
    # Where plain ticks are too few to tell their host work (or a decode was not timed), they count as seen, less
    # the slack: the decided ticks, a lower bound of plain's rate, are these same ticks, and speculation's
    # evidence was held back or not on the one tick that differs (the first, which only decided the next rows).
    for first in (0.025, 0.035):
        r = Realised()
        r.add(1, False, 1, 0.0303, 0.030)
        r.next_tick()
        r.deciding()
        r.add(1, False, 1, first, first)
        r.next_tick()
        _deciding_ticks(r, 10, 0.030, 0.001)
        assert r.speculated[1].rate == pytest.approx(1 / 0.031 / (1 - DECIDE_SLACK))
        assert r.decided[1].count > r.speculated[1].count and r.pays(1) is True, first


def test_decided_ticks_of_another_spell_do_not_bar_speculation() -> None:
    """Decided ticks bound plain decoding's rate from below on the machine they ran on. Here they ran in a quiet
    spell at 50 tok/s, speculation (47.6) was held back against them; then another program slows everything:
    plain ticks at 20 tok/s, and a probe's speculating ticks at 40, twice that. Judged against the old decided
    rate, speculation would stay held back at 2x plain (as a chat session's record did); it runs again."""
    r = Realised()
    _ticks(r, 20, 1, False, 1, 0.019)  # quiet: plain
    for _ in range(20):  # quiet: ticks whose plain rows auto decided (lookups and pricing on top)
        r.deciding()
        r.add(1, False, 1, 0.02)
        r.next_tick()
    _ticks(r, 10, 1, True, 1, 0.021)  # speculating, 47.6 tok/s: under the decided ticks' 50
    assert r.pays(1) is False and not r.allows(1)
    _ticks(r, 3 * STALE, 1, False, 1, 0.05)  # held back, the machine slowed: plain at 20 tok/s
    for _ in range(4 * STALE):  # plain ticks until a probe
        if r.allows(1):
            break
        _ticks(r, 1, 1, False, 1, 0.05)
    assert r.allows(1) and r.tick % STALE == STALE // 2, "a probe"
    _ticks(r, 1, 1, True, 2, 0.05)  # the probe's rows: 40 tok/s
    assert r.pays(1) is True and r.allows(1), "judged against the plain rate of now, not the quiet spell's decided"


def test_speculation_is_held_back_where_its_ticks_deliver_less_than_plain_ones() -> None:
    r = Realised()
    assert r.pays(2) is None and r.allows(2), "no evidence: the cost model decides"
    _ticks(r, 20, 2, False, 2, 0.02)  # 100 tok/s plain
    _ticks(r, 4, 2, True, 3, 0.035)  # 86 tok/s speculating, but too few ticks to judge a loss this small
    assert r.pays(2) is None and r.allows(2)
    _ticks(r, 20, 2, True, 3, 0.04)
    assert r.pays(2) is False
    assert not r.allows(2), "held back at this batch size"
    assert r.allows(4) and r.pays(1) is None, "another batch size has its own evidence"
    _ticks(r, 20, 4, False, 4, 0.02)  # 200 tok/s plain at 4
    _ticks(r, 20, 4, True, 6, 0.02)  # 300 tok/s speculating at 4
    assert r.pays(4) is True and r.allows(4)


def test_speculation_that_only_matches_plain_decoding_is_held_back() -> None:
    """Its ticks carry `auto`'s work already, and the 3% the promise allows is spent by the host work `auto` does
    where it is held back: a small loss is no gain (the Q8_0 draft at 0.8 over HTTP with 8 clients, 0.97x)."""
    r = Realised()
    _ticks(r, 20, 8, False, 8, 0.08)  # 100 tok/s plain
    _ticks(r, 20, 8, True, 8 * 98, 8.0)  # 98 tok/s speculating
    assert r.pays(8) is False and not r.allows(8)
    _ticks(r, 20, 8, True, 8 * 101, 8.0)
    assert r.pays(8) is True


def test_without_plain_ticks_the_live_curves_prediction_judges_and_a_gross_loss_takes_few_ticks() -> None:
    """A burst of 8 clients: plain ticks at 8 come only every PLAIN_EVERY ticks, so the speculating ticks are
    judged against the plain rate the target lane's live curve predicts (8 rows in 0.05 s: 160 tok/s). A loss
    within the prediction's wide margin is left to real plain ticks; a clear one is held back once there are
    MIN_SPECULATED ticks of it; a gross one after MIN_GROSS."""
    r = Realised(plain_seconds=lambda rows: 0.05 if rows == 8 else None)
    _ticks(r, int(MIN_SPECULATED) + 4, 8, True, 8 * 9, 0.5)  # 144 tok/s: 0.9x the prediction
    assert r.pays(8) is True and r.allows(8), "within the prediction's margin"
    r = Realised(plain_seconds=lambda rows: 0.05 if rows == 8 else None)
    _ticks(r, int(MIN_GROSS) + 1, 8, True, 8 * 12, 0.75)  # 128 tok/s: 0.8x, not gross
    assert r.pays(8) is None and r.allows(8)
    _ticks(r, int(MIN_SPECULATED), 8, True, 8 * 12, 0.75)
    assert r.pays(8) is False and not r.allows(8), "a clear loss, once there is evidence enough"
    r = Realised(plain_seconds=lambda rows: 0.05 if rows == 8 else None)
    _ticks(r, int(MIN_GROSS) + 1, 8, True, 20, 0.3)  # 67 tok/s: 0.42x
    assert r.pays(8) is False and not r.allows(8), "a gross loss after a few ticks"
    assert r.pays(4) is None, "no prediction at 4 rows: the cost model decides"
    _ticks(r, 20, 8, False, 8, 0.04)  # real plain ticks at 8: 200 tok/s; they judge from now on
    r.speculated[8] = type(r.speculated[8])()
    _ticks(r, int(MIN_SPECULATED) + 2, 8, True, 8 * 2, 0.1)  # 160 tok/s: the prediction's rate, 0.8x the real one
    assert r.pays(8) is False
    assert Realised().pays(8) is None and Realised(plain_seconds=lambda rows: None).pays(8) is None
    # The host's work: plain ticks of 4 took 0.04 s where the curve predicts decodes of 0.025 s. A plain tick of 8
    # is then predicted at 0.08 s (100 tok/s), and speculating ticks at 90 tok/s are no loss to hold back.
    r = Realised(plain_seconds=lambda rows: {4: 0.025, 8: 0.05}.get(rows))
    _ticks(r, 20, 4, False, 4, 0.04)
    _ticks(r, int(MIN_SPECULATED) + 2, 8, True, 9, 0.1)
    assert r.pays(8) is True
    _ticks(r, 20, 8, True, 7, 0.1)  # 70 tok/s: a loss against the scaled prediction too
    assert r.pays(8) is False


def test_speculation_delivering_less_than_the_ticks_auto_decided_plainly_is_held_back_without_plain_ticks() -> None:
    """A tick where `auto` decided, found nothing worth speculating and decoded plainly delivers at most what
    plain decoding does: where the ticks that did speculate deliver less than those, speculation loses, without
    waiting for plain ticks (which come only every PLAIN_EVERY ticks) and within the live curve's wide margin.
    8 clients over HTTP at one thread: lookup chains at 0.965x plain, decided ticks at 0.995x (docs/results.md)."""
    def run(spec_rate: float, decided_rate: float) -> Realised:
        r = Realised(plain_seconds=lambda rows: 0.08 if rows == 8 else None)  # 100 tok/s predicted
        for i in range(3 * int(MIN_SPECULATED)):  # alternating, as lookups find a chain or not
            r.deciding()
            speculates = i % 2 == 0
            rate = spec_rate if speculates else decided_rate
            r.add(8, speculates, 16 if speculates else 8, (16 if speculates else 8) / rate)
            r.next_tick()
        assert not r.plain, "no plain ticks yet"
        return r

    assert run(90.7, 93.5).pays(8) is False, "below the decided ticks' rate: a loss"
    assert run(97.0, 93.5).pays(8) is True, "above it, and within the prediction's margin"
    assert run(80.0, 70.0).pays(8) is False, "the prediction's margin still judges: 0.8x"
    # A gross loss against the decided ticks is judged after a few ticks.
    r = Realised()
    for speculates in (False, True) * int(MIN_PLAIN + 1):
        r.deciding()
        r.add(8, speculates, 8, 0.08 if not speculates else 0.2)
        r.next_tick()
    assert r.speculated[8].count < MIN_SPECULATED and r.pays(8) is False


def test_held_back_speculation_is_probed_and_resumes_when_the_machine_changes() -> None:
    r = Realised()
    _ticks(r, 30, 1, False, 1, 0.02)
    _ticks(r, 30, 1, True, 1, 0.03)  # speculation loses
    assert r.pays(1) is False
    allowed = []
    for _ in range(3 * STALE):  # plain ticks only, as when every sequence is held back
        allowed.append(r.allows(1))
        r.add(1, False, 1, 0.02)
        r.next_tick()
    probes = [i for i, a in enumerate(allowed) if a]
    assert probes and len(probes) <= 3, f"a probe per {STALE} stale ticks at most: {probes}"
    # A probe that finds speculation losing as before keeps it held back at once: no unchecked ticks after it.
    again = copy.deepcopy(r)
    again.add(1, True, 1, 0.03)
    again.next_tick()
    assert again.pays(1) is False and not again.allows(1)
    # The machine changed: a probe's speculating tick now delivers twice the plain rate. Stale evidence
    # weighs a quarter in the rate, so the probe is judged with it and speculation runs again.
    r.add(1, True, 4, 0.02)
    r.next_tick()
    assert r.pays(1) is True and r.allows(1)
    _ticks(r, int(MIN_SPECULATED) + 2, 1, True, 4, 0.02)
    assert r.pays(1) is True


def test_held_back_probes_are_spaced_by_what_they_cost() -> None:
    """A probe that costs many plain ticks (a large tree on a steep curve) is made seldom enough that probes take
    about PROBE_SHARE of the time beyond what they deliver, whether or not an option still being learnt chose its
    rows (a probe's rows count either way: held back, options are not taken and stay being learnt, and probes
    that chose one were never counted); one that costs about a plain tick, as often as before."""
    for probe_seconds, learnt in ((0.2, False), (0.2, True), (0.021, False)):  # ten plain ticks' time for one token
        r = Realised()
        _ticks(r, 30, 1, False, 1, 0.02)
        _ticks(r, 30, 1, True, 1, probe_seconds)  # speculation loses
        assert r.pays(1) is False and not r.allows(1)
        probes, spent, ticks, probing = 0, 0.0, 40 * STALE, False
        for _ in range(ticks):
            if probing:  # the rows a probe chose in the tick before (by an option still being learnt or not)
                probes += 1
                spent += probe_seconds - 0.02  # beyond the plain tick it stands for
                assert r.add(1, True, 1, probe_seconds) == "speculated"
            else:
                r.add(1, False, 1, 0.02)
            probing = r.allows(1)
            if probing:
                r.deciding()
                if learnt:
                    r.learning()
            r.next_tick()
        if probe_seconds > 0.1:
            assert r.probe_interval(1) == pytest.approx(0.18 / 0.02 / PROBE_SHARE)
            assert 0 < spent / (ticks * 0.02) <= 1.5 * PROBE_SHARE, (learnt, probes, spent)
        else:
            assert r.probe_interval(1) == STALE
            # (older than STALE ticks at one of every STALE ticks: every second one)
            assert probes >= 40 // 2 - 1, f"a cheap probe every {2 * STALE} ticks: {probes}"


def test_where_everyone_speculates_a_bounded_share_of_ticks_is_plain() -> None:
    r = Realised()
    kinds = _drive(r, 20 * PLAIN_EVERY, 3, lambda rows: (9, 0.02) if rows == "decided" else (3, 0.02 / 1.5))
    held = kinds.count("held")
    assert 20 <= held <= 42, f"two plain ticks per {PLAIN_EVERY} keep the plain rate current: {held}"
    assert r.pays(3) is True
    assert r.plain[3].rate == pytest.approx(225.0), "only held ticks (nobody decided) are plain evidence"


def test_a_tick_auto_decided_counts_with_speculation_whatever_it_chose() -> None:
    """`auto` looks its proposals up and prices them, then often decodes plainly: those ticks are its cost, not
    plain decoding's. Here its ticks, speculating or not, deliver 0.95x what held-back (plain) ticks do: held
    back, though its speculating ticks deliver as much as its own plain ones (judged against those, as before,
    it would speculate on at 0.95x plain decoding)."""
    r = Realised()
    r.deciding()  # decided in this tick: its rows are plain (no decision), but it is no plain evidence
    r.add(2, False, 2, 0.02)
    assert not r.plain and not r.speculated and r.decided[2].count == 1, "a lower bound of plain's rate"
    r.next_tick()
    r.add(2, False, 2, 0.02)  # plain rows that a decision chose: speculation's evidence, and a bound of plain's
    assert not r.plain and r.speculated[2].count == 1 and r.decided[2].count == pytest.approx(1.95)
    r.next_tick()
    r.deciding()
    r.add(2, True, 3, 0.02)  # a speculating tick bounds nothing
    assert r.speculated[2].count == pytest.approx(1.95) and r.decided[2].count == pytest.approx(1.95)
    r.next_tick()
    r.add(2, False, 2, 0.02)  # speculation's rows, not counted plain
    r.next_tick()
    r.add(2, False, 2, 0.02)  # nobody decided its rows nor in it: plain evidence
    assert r.plain[2].count == 1

    r, turn = Realised(), iter(range(1 << 20))

    def tick(rows: str) -> tuple[int, float]:
        if rows == "held":
            return 2, 0.02  # 100 tok/s
        return (3, 0.0316) if next(turn) % 2 else (2, 0.0211)  # 95 tok/s either way: lookups, pricing, events

    kinds = _drive(r, 12 * PLAIN_EVERY, 2, tick)
    assert r.plain[2].rate == pytest.approx(100.0) and r.speculated[2].rate == pytest.approx(95.0, rel=0.01)
    assert r.pays(2) is False and not r.allows(2)
    assert kinds[-STALE:].count("held") >= STALE - 2, "held back, but for a probe"


def test_a_drafts_catch_up_is_left_out_of_the_ticks_time() -> None:
    """The draft catching up on what it missed is a switching cost `auto` prices apart: the tick that paid it
    counts without it (the longest of several sequences' catch-ups: they run in the same batched decodes), the
    next tick in full, and a tick that was all catch-up not at all."""
    r = Realised()
    r.switching(0.03)
    r.switching(0.01)
    r.add(1, True, 3, 0.05)
    assert r.speculated[1].seconds == pytest.approx(0.02), "0.05 s less the longer catch-up"
    r.next_tick()
    r.add(1, True, 3, 0.05)
    assert r.speculated[1].seconds == pytest.approx(0.02 * 0.95 + 0.05), "the next tick in full"
    r.next_tick()
    r.switching(0.05)
    r.add(1, False, 1, 0.05)
    assert r.speculated[1].count == pytest.approx(1.95) and not r.plain, "all catch-up: not counted"


def test_the_ticks_an_option_still_being_learnt_chose_are_not_counted() -> None:
    """A sequence that chose its next rows with an option still being learnt (its estimates near their priors,
    its chains short) marks it in the tick it decided in: the next tick, where those rows run, counts for
    nothing; the one after counts again."""
    r = Realised()
    r.deciding()
    r.learning()
    r.add(1, False, 1, 0.02)  # this tick's rows were decided before: a decided tick
    assert r.decided[1].count == 1 and not r.speculated
    r.next_tick()
    r.add(1, True, 2, 0.05)  # the learning option's rows: not counted, of any kind
    assert not r.speculated and r.decided[1].count == 1 and not r.plain
    r.next_tick()
    r.add(1, True, 5, 0.05)
    assert r.speculated[1].count == 1 and r.speculated[1].tokens == 5


def test_exploration_ticks_that_gained_count_and_those_that_lost_do_not() -> None:
    """Exploration's ticks are left out for their losses (priors, tries), not for their gains: a tick of an option
    still being learnt that delivered more than plain ticks do is speculation's evidence. Left out, the ticks that
    paid were missing, and those that found nothing to propose judged speculation alone."""
    r = Realised()
    for _ in range(5):
        assert r.add(1, False, 1, 0.02) == "plain"  # 50 tok/s
        r.next_tick()
    for tokens, counted in ((1, "learning"), (6, "speculated"), (2, "learning")):  # 20, 120, 40 tok/s
        r.deciding()
        r.learning()
        r.next_tick()
        assert r.add(1, True, tokens, 0.05) == counted, tokens
    assert r.speculated[1].count == 1 and r.speculated[1].tokens == 6


def test_a_tick_whose_draft_only_caught_up_counts_as_neither_kind() -> None:
    """A tick whose draft phase was a switch (the draft catching up) and whose target batch verified nothing is not
    evidence; one that verified is, less the switch."""
    r = Realised()
    r.switching(0.05)
    assert r.add(1, True, 1, 0.08, verified=False) == "switch"
    assert not r.observed
    r.next_tick()
    r.switching(0.05)
    assert r.add(1, True, 3, 0.08, verified=True) == "speculated"
    assert r.speculated[1].seconds == pytest.approx(0.03)
    r.next_tick()
    assert r.add(1, True, 1, 0.05, verified=False) == "speculated", "a draft phase of its own: speculation's cost"


def test_the_scheduler_records_plain_and_speculating_ticks_but_not_prompt_chunks(tiny) -> None:
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1, n_seq_max=8,
                                 n_parallel=2, cost_cache=Path("")))
    try:
        prompts = [engine.tokenize("the cat sat on the mat"), engine.tokenize("once upon a time there was")]
        params = GenParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        pool, _ = pool_run(engine, [("ar", p) for p in prompts], params)
        realised = pool.scheduler.load.realised
        counted = sum(r.count for r in realised.plain.values())
        assert not realised.speculated and counted > 0, "plain decoding: plain ticks only"
        assert set(realised.plain) <= {1, 2} and realised.plain[2].rate > 0
        assert realised.tick == pool.scheduler.ticks and round(counted) < pool.scheduler.ticks, \
            "the prompt's ticks are not counted"
        pool, _ = pool_run(engine, [("sps", p) for p in prompts], params)
        realised = pool.scheduler.load.realised
        assert realised.speculated and realised.speculated[2].tokens > realised.speculated[2].count, \
            "sps speculates: more than a token per tick"
    finally:
        engine.close()


def test_lookahead_ticks_count_as_speculation_not_as_prompt_chunks(tiny) -> None:
    """Lookahead's window wants logits on its last level only, as a prompt chunk wants them on its last row:
    its ticks were left out of the realised check, which then never judged them."""
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=1024, threads=1, n_seq_max=8, cost_cache=Path("")))
    try:
        prompt = engine.tokenize("the cat sat on the mat")
        params = GenParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        pool, _ = pool_run(engine, [("lookahead", prompt)], params)
        realised = pool.scheduler.load.realised
        assert sum(r.count for r in realised.plain.values()) <= 1, "the first token alone, then windows"
        assert realised.speculated[1].count >= 10, "each window's tick is speculation's"
    finally:
        engine.close()


def test_the_scheduler_predicts_a_plain_tick_from_the_target_lanes_live_curve(tiny) -> None:
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=512, threads=1, n_seq_max=4, cost_cache=Path("")))
    try:
        pool = SlotPool(engine)
        predict = pool.scheduler.load.realised.plain_seconds
        assert predict is not None and predict(2) is None, "an unseeded curve predicts nothing"
        engine.slots[0].target.lane.live.seed([0.01, 0.012, 0.015])
        assert predict(2) == pytest.approx(0.012) and predict(4) is None
    finally:
        engine.close()
