"""`auto`'s decision rule and cost model on synthetic costs: the options' worth, the curve's correction by what
verification batches take, the cost cache, and a row's price under load (backends.strategies.auto.choose, .costs,
.decide; backends.device_cost)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Callable

import pytest

from backends.config import AutoConfig, StrategyOptions
from backends import device_cost
from backends.device_cost import BatchCost, CostCache, DeviceCost, cost_key, measure_draft_ratio
from backends.engine import Engine, EngineConfig
from backends.sampling import GenParams
from backends.strategies.auto.decide import SETTLE_STEPS, Choice, best_chain_length, expected_chain_tokens, still_learnt
from backends.strategies.auto.generation import Generation
from backends.strategies.auto.state import (LOOKUP_POSITIONS, MATCH_EXTEND, Acceptance, AutoState, Calibration,
                                            confidence_bin, lookup_acceptance, lookup_key)
from backends.strategies.drafting import Either, PMin
from backends.strategies.lookup import NgramIndex
from auto_helpers import TINY_PROMPTS, flat, prefilled as _prefilled, synthetic_engine as _engine
from engine_helpers import run_to_done
from test_lossless import _copying_prompt


# -- the decision rule, pure ------------------------------------------------------------------------------------------

def test_flat_curve_and_high_acceptance_speculate_long() -> None:
    k, tokens, seconds = best_chain_length([0.9] * 10, rate=100.0, t_plain=0.01, curve=lambda _k: 1.0)
    assert k == 10 and tokens > 6 and seconds == pytest.approx(0.01)


def test_a_choice_with_its_reason_is_the_same_choice_in_every_other_field() -> None:
    """Choice.because copies the fields by hand (dataclasses.replace costs ten times as much, once a step): a
    field added later and left out of it fails here."""
    values = {"option": "draft", "length": 3, "tokens": 2.5, "seconds": 0.02, "why": "before", "explore": True,
              "switch": 0.004, "horizon": 6.0, "nodes": (0, 2)}
    assert set(values) == {f.name for f in dataclasses.fields(Choice)}, "a new field: give it a value here"
    choice = Choice(**values)
    assert choice.because("after") == dataclasses.replace(choice, why="after")


def test_steep_curve_and_low_acceptance_stay_plain() -> None:
    k, tokens, _ = best_chain_length([0.3] * 10, rate=100.0, t_plain=0.01, curve=lambda k: float(k))
    assert k == 0 and tokens == 1.0


def test_chain_stops_where_the_next_token_costs_more_than_it_brings() -> None:
    """T(k)/T(1) = 1 + 0.2 (k-1), acceptance 0.5 per token: the i-th token brings 0.5^i, costs 0.2 plain steps."""
    k, _, _ = best_chain_length([0.5] * 10, rate=100.0, t_plain=0.01, curve=lambda k: 1 + 0.2 * (k - 1))
    assert k == 2  # 0.5 and 0.25 pay for 0.2 each; 0.125 does not
    k_draft, _, _ = best_chain_length([0.5] * 10, 100.0, 0.01, lambda k: 1 + 0.2 * (k - 1), per_token=0.002)
    assert k_draft == 1, "a draft token's own cost (0.2 plain steps) shortens the chain"


def test_a_learning_draft_proposes_where_either_rule_would_and_asks_both_every_time() -> None:
    """drafting.Either (a draft still being learnt: sps's rule or the stopping rule): a token is proposed, and
    drafting goes on, where either rule says so; both rules are asked at every token, so that the stopping
    rule's running chance of the chain sees the tokens the other kept."""
    asked: list[tuple[str, str, int]] = []

    @dataclasses.dataclass
    class Rule:
        name: str
        keeps: int  # proposes tokens 0 .. keeps-1
        goes_on: int  # drafts on after tokens 0 .. goes_on-1

        def keep(self, i: int, confidence: float) -> bool:
            asked.append((self.name, "keep", i))
            return i < self.keeps

        def more(self, i: int, confidence: float) -> bool:
            asked.append((self.name, "more", i))
            return i < self.goes_on

    rule = Either(Rule("sps", 1, 0), Rule("pays", 3, 2))
    assert [rule.keep(i, 0.5) for i in range(4)] == [True, True, True, False]
    assert [rule.more(i, 0.5) for i in range(4)] == [True, True, False, False]
    assert asked == [(n, what, i) for what in ("keep", "more") for i in range(4) for n in ("sps", "pays")]
    assert Either(Rule("a", 0, 0), Rule("b", 0, 0)).keep(0, 0.9) is False
    capped = PMin(0.4, first_always=True, longest=2)  # sps's rule up to its K, within a longer chain
    assert [capped.keep(i, c) for i, c in ((0, 0.1), (1, 0.5), (1, 0.3), (2, 0.9))] == [True, True, False, False]
    assert [capped.more(i, 0.9) for i in range(3)] == [True, False, False]
    with pytest.raises(ValueError):
        PMin(0.4, longest=0)


def test_acceptance_estimates_follow_the_evidence() -> None:
    a = Acceptance(lambda _k: 0.5, weight=2.0, decay=0.99)
    assert a.p("x") == 0.5
    for _ in range(50):
        a.update("x", True)
    assert a.p("x") > 0.9
    for _ in range(300):
        a.update("x", False)
    assert a.p("x") < 0.1, "old evidence decays"
    assert confidence_bin(0.0) == 0 and confidence_bin(0.55) == 5 and confidence_bin(1.0) == 9


def test_lookup_matches_are_followed_back_past_the_ngram_and_learnt_in_bins() -> None:
    """A suffix copied from a longer passage matches as far back as the copy goes (up to `extend`), so
    copying and quoting a phrase are learnt apart; the bins and positions clip as documented."""
    index = NgramIndex(1, 3)
    tokens = [7, 1, 2, 3, 4, 5, 9, 8, 1, 2, 3, 4, 5]
    assert index.propose_with_match(tokens, 2) == ([9, 8], 3)
    assert index.propose_with_match(tokens, 2, extend=1) == ([9, 8], 4)
    assert index.propose_with_match(tokens, 2, extend=16) == ([9, 8], 5), "stops where the texts differ (7 vs 8)"
    assert NgramIndex(1, 3).propose_with_match([1, 2, 3, 1, 2, 3], 2, extend=16) == ([1, 2], 3), "stops at the start"
    assert lookup_key(0, 0) == (1, 0) and lookup_key(3, 1) == (3, 1) and lookup_key(5, 7) == (4, LOOKUP_POSITIONS)
    assert lookup_key(12, 2) == (10, 2) and lookup_key(MATCH_EXTEND + 3, 0) == (16, 0)


def test_lookup_positions_not_yet_verified_borrow_the_estimate_before_them() -> None:
    """Copies accepted at the first two positions make the third and later worth verifying, so chains grow
    as far as the text repeats; a match length never seen keeps the low prior."""
    a = lookup_acceptance(first=0.15)
    assert a.p((3, 0)) == a.p((3, 2)) == 0.6, "a 3-token match starts likelier right than a 1-token one"
    assert (a.p((1, 0)), a.p((2, 0))) == (0.15, 0.3)
    for _ in range(30):
        a.update((3, 0), False)
    assert a.p((3, 0)) < 0.1 and a.p((3, 2)) < 0.1, "a prior that was too hopeful is corrected by what is seen"
    a = lookup_acceptance(first=0.15)
    for _ in range(30):
        a.update((3, 0), True)
        a.update((3, 1), True)
    assert a.p((3, 2)) > 0.85 and a.p((3, 3)) > 0.85, "unseen positions follow the ones before them"
    assert a.p((1, 0)) == 0.15 and a.p((1, 3)) == 0.15
    for _ in range(30):
        a.update((3, 2), False)
    assert a.p((3, 2)) < 0.2 and a.p((3, 3)) < 0.2, "evidence at a position overrides the borrowed prior"


def test_lookup_is_scaled_by_what_its_steps_really_gave_against_the_counts() -> None:
    """Counts learnt on copying text promise long lookups; in an answer whose lookups keep failing, the
    calibration (extra tokens given / predicted, each with 2 tokens of prior) scales them down until none
    pays, and back up when they pay; small promises broken move it little."""
    accept = [0.8] * 8
    curve = BatchCost(tuple(0.01 * (1 + 0.15 * k) for k in range(16)))
    rate = 1 / 0.01
    assert expected_chain_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    cal = Calibration()
    assert cal.factor() == 1.0  # no lookup step yet: the counts alone
    k, _, _ = best_chain_length(accept, rate, 0.01, curve.relative)
    assert k == len(accept)
    promised = expected_chain_tokens(accept, k) - 1
    cal.add(0.0, promised)
    assert cal.factor() == pytest.approx(2 / (promised + 2))
    for _ in range(5):  # each promised the whole chain, gave a quarter of a token beyond the first
        cal.add(0.25, promised)
    f = cal.factor()
    assert f < 0.25
    assert best_chain_length([accept[0] * f, *accept[1:]], rate, 0.01, curve.relative)[0] == 0
    for _ in range(30):  # copying again: more than predicted
        cal.add(6.0, 3.0)
    assert cal.factor() > 1.8
    small = Calibration()
    small.add(0.0, 0.5)
    assert small.factor() == pytest.approx(0.8)


def _a_measured_draft(tiny, tokens: float, cost: float) -> tuple[Engine, Generation]:
    """An engine on a flat device (a draft decode 0.6 of a plain step), its draft measured to give `tokens` a step
    for `cost` plain steps, and a generation of 400 tokens at most prefilled on it, choosing between plain and
    the draft only."""
    engine = _engine(tiny, tiny.draft, DeviceCost(flat(), 0.6))
    options = StrategyOptions(auto=AutoConfig(lookup=False, lookahead=False, explore_budget=0.0))
    state = engine.auto_states["greedy"]
    for _ in range(20):
        state.draft_step_tokens.add(tokens)
        state.draft_step_cost.add(cost)
    return engine, _prefilled(engine, options, engine.tokenize(TINY_PROMPTS[0]), max_tokens=400)


def test_switching_to_a_lagging_draft_must_pay_back_its_catch_up(tiny) -> None:
    """A draft measured to give 2 tokens for 1.6 plain steps pays (1 more token for 0.6 more steps) when it is
    in sync. After 100 tokens decoded without it, catching up costs ~9 plain steps (0.15 of a draft decode per
    token, the prior), more than 8 of its steps gain back: plain. A short lag is worth paying over 8 steps but
    not over the last step of the answer."""
    engine, gen = _a_measured_draft(tiny, 2.0, 1.6)
    try:
        assert gen.decide([], 0).option == "draft", "in sync: no catch-up, the draft pays"
        context = gen.run.context
        context.extend([context[-1]] * 10)  # decoded while the draft stood by (decide reads only the lag)
        assert gen.decide([], 0).option == "draft", "a short catch-up, paid back over 8 steps"
        gen.run.output.extend([0] * (400 - len(gen.run.output) - 2))  # two tokens of room left
        assert gen.decide([], 0).option == "plain", "the same catch-up with one step left to pay it back"
        gen.run.output[:] = []
        context.extend([context[-1]] * 90)
        assert gen.decide([], 0).option == "plain", "100 tokens behind: the catch-up costs more than it brings"
    finally:
        engine.close()


def test_an_option_still_being_learnt_is_judged_against_plain_decoding_and_a_settled_one_against_the_rate(
        tiny) -> None:
    """A draft measured at 2 tokens for 1.8 plain steps (1.11x plain) where `auto` has reached 1.3x plain (its own
    first steps): taken fewer than SETTLE_STEPS times it is taken (it beats plain decoding); once settled it is
    judged against the rate reached, and loses. An option that does not beat plain is not taken either way."""
    assert still_learnt([Choice("draft", 4, 2.0, 1.8)], {"draft": SETTLE_STEPS - 1}, 1.0) is not None
    assert still_learnt([Choice("draft", 4, 2.0, 1.8)], {"draft": SETTLE_STEPS}, 1.0) is None
    assert still_learnt([Choice("draft", 4, 2.0, 2.1)], {}, 1.0) is None, "slower than plain decoding"
    best = still_learnt([Choice("lookup", 2, 1.5, 1.2), Choice("draft", 4, 3.0, 2.0)], {}, 1.0)
    assert best is not None and best.option == "draft", "the one worth most against plain decoding"
    engine, gen = _a_measured_draft(tiny, 2.0, 1.8)
    state = engine.auto_states["greedy"]
    try:
        state.tokens.add(1.3)  # R: 1.3 tokens a plain step's time
        state.seconds.add(gen.costs.t_plain())
        assert gen.costs.rate() * gen.costs.t_plain() == pytest.approx(1.3)
        state.taken["draft"] = SETTLE_STEPS - 1
        assert gen.decide([], 0).option == "draft", "still being learnt: it beats plain decoding"
        state.taken["draft"] = SETTLE_STEPS
        assert gen.decide([], 0).option == "plain", "settled: below the rate reached"
        state.taken["draft"] = 0
        for _ in range(20):
            state.draft_step_cost.add(2.4)  # now slower than plain decoding
        assert gen.decide([], 0).option == "plain", "not even plain decoding's rate"
    finally:
        engine.close()


def test_a_curve_measured_too_steep_or_too_flat_is_corrected_by_what_verification_batches_take(tiny) -> None:
    """The measured curve says a batch of 2 costs 1.6 plain steps (a fast spell while T(1) alone was timed can
    make such a curve, and it is kept on disk for a month); verification batches keep taking 1.3. Its extra
    cost beyond one token is scaled by what the batches took against what it predicted (decayed sums, 2 plain
    steps of prior), so T(2)/T(1) goes to ~1.3 and a one-token lookup accepted 40% of the time, a loss on the
    measured curve, pays on the corrected one. Batches dearer than measured make the curve steeper."""
    curve = BatchCost(tuple(0.01 * (1.0 if k == 1 else 0.8 + 0.4 * k) for k in range(1, 17)))
    engine = _engine(tiny, None, DeviceCost(curve, 0.0))
    try:
        gen = _prefilled(engine)
        rate = 1 / 0.01
        assert gen.costs.relative(2) == pytest.approx(1.6) and gen.costs.relative(3) == pytest.approx(2.0)
        assert best_chain_length([0.4], rate, 0.01, gen.costs.relative)[0] == 0, "on the measured curve: plain"
        for _ in range(300):  # every batch of 2 took 1.3 plain steps: 0.3 extra where the curve predicted 0.6
            engine.auto_states["greedy"].batch_scale.add(0.3, 0.6)
        assert gen.costs.relative(2) == pytest.approx(1.3, abs=0.03)
        assert gen.costs.relative(3) == pytest.approx(1.53, abs=0.03), "the whole curve's extra scales alike"
        assert best_chain_length([0.4], rate, 0.01, gen.costs.relative)[0] == 1, "on the corrected one: lookup"
        engine.auto_states["greedy"] = AutoState(learn_timing=False)
        gen = _prefilled(engine)
        for _ in range(300):
            engine.auto_states["greedy"].batch_scale.add(1.2, 0.6)  # batches of 2 took 2.2 plain steps
        assert gen.costs.relative(2) == pytest.approx(2.2, abs=0.05)
    finally:
        engine.close()


def test_real_verification_batches_feed_the_curve_correction(tiny) -> None:
    """Learning its timing (as outside these tests), auto's lookup steps on a copying prompt are timed against
    the curve's prediction: the correction has seen them."""
    engine = _engine(tiny, None, DeviceCost(BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16))), 0.0))
    engine.auto_states["greedy"] = AutoState()  # learns timing
    try:
        prompt = _copying_prompt(engine)
        done = run_to_done(engine, "auto", prompt, GenParams(max_tokens=48))
        assert done.stats.steps_by_choice.get("lookup", 0) > 0
        scale = engine.auto_states["greedy"].batch_scale
        assert scale.predicted > 0 and scale.real != 0.0 and scale.factor() != 1.0
    finally:
        engine.close()


# -- the cost cache ---------------------------------------------------------------------------------------------------

def test_cost_cache_round_trip_and_staleness(tmp_path: Path) -> None:
    cache = CostCache(tmp_path / "cost.json", max_age=100.0)
    cost = DeviceCost(BatchCost((0.02, 0.025, 0.03)), 0.4, measured_at=1000.0)
    cache.put("k", cost)
    assert cache.get("k", now=1050.0) == cost
    assert cache.get("k", now=1101.0) is None, "older than max_age: measured again"
    assert cache.get("other", now=1050.0) is None
    cache.put("k", None)  # forgotten
    assert cache.get("k", now=1050.0) is None
    (tmp_path / "cost.json").write_text("{not json")
    assert cache.get("k") is None  # an unreadable file is an empty cache
    cache.put("k", cost)
    assert cache.get("k", now=1050.0) == cost


def test_cost_key_changes_with_model_files_threads_and_build(tmp_path: Path) -> None:
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"a" * 10)
    draft.write_bytes(b"b" * 10)
    base = cost_key(target, draft, 2, "build 1", [0])
    assert base == cost_key(target, draft, 2, "build 1", [0])
    assert base != cost_key(target, draft, 4, "build 1", [0]), "thread count"
    assert base != cost_key(target, draft, 2, "build 2", [0]), "llama.cpp build"
    assert base != cost_key(target, None, 2, "build 1", [0]), "draft model"
    assert base != cost_key(target, draft, 2, "build 1", [99]), "layers offloaded"
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert base != cost_key(target, draft, 2, "build 1", [0]), "a replaced model file"
    target.write_bytes(b"a" * 11)
    assert base != cost_key(target, draft, 2, "build 1", [0])


class _Seq:
    """A sequence whose decodes advance a fake clock: `cost` a token, times the machine's speed of the moment."""

    def __init__(self, clock: list[float], slow: Callable[[], bool], cost: float) -> None:
        self.clock, self.slow, self.cost, self.tokens = clock, slow, cost, []

    def sync(self, context, logits=False) -> None:
        self.tokens = list(context)

    def extend(self, tokens, logits="last") -> None:
        self.clock[0] += self.cost * len(tokens) * (3.0 if self.slow() else 1.0)
        self.tokens += list(tokens)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]


def test_the_draft_ratio_is_timed_in_turns_with_the_target(monkeypatch) -> None:
    """A machine slow for its first 8 decodes, then quick (a busy core that goes): the draft, exactly as dear as
    the target, reads as dear. Timed one after the other, the target's minimum came from the slow stretch and
    the draft's from the quick one: a third of the target (a draft that can never pay, priced as if it could)."""
    clock, decodes = [0.0], [0]

    def slow() -> bool:
        decodes[0] += 1
        return decodes[0] <= 8

    monkeypatch.setattr(device_cost.time, "perf_counter", lambda: clock[0])
    target, draft = _Seq(clock, slow, 0.02), _Seq(clock, slow, 0.02)
    assert measure_draft_ratio(target, draft, [1, 2, 3], repeats=7) == pytest.approx(1.0)
    assert target.tokens == draft.tokens == [1, 2, 3], "both caches end up holding the context"
    decodes[0] = 0
    one_after_the_other = [min(device_cost.measure_batch_cost(seq, [1, 2, 3], 1, repeats=7).seconds)
                           for seq in (target, draft)]
    assert one_after_the_other[1] / one_after_the_other[0] == pytest.approx(1 / 3), "what it replaces"


def test_a_draft_identical_to_the_target_measures_about_as_dear(tiny) -> None:
    """Real llama.cpp: the target's own file as its draft costs about what the target does (loose bounds: a
    single-token decode of the tiny model takes a fraction of a millisecond, host work included)."""
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.target, n_ctx=512, threads=1, cost_cache=Path("")))
    try:
        context = engine.tokenize("the cat sat on the mat and the dog sat on the log")
        ratio = measure_draft_ratio(engine.target, engine.draft, context, repeats=15)
        assert 0.6 < ratio < 1.6, ratio
        assert engine.target.tokens == engine.draft.tokens == context
    finally:
        engine.close()


def test_engine_measures_once_then_reads_the_disk_cache(tiny, tmp_path: Path) -> None:
    path = tmp_path / "device-cost.json"
    config = EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1, cost_cache=path)
    first = Engine(config)
    try:
        first.target.sync(first.tokenize("the cat sat"), logits=False)
        measured = first.device_cost(k_max=4, repeats=1)
        assert measured is not None and len(measured.batch.seconds) == 4 and measured.draft > 0
        assert path.exists()
    finally:
        first.close()
    second = Engine(config)
    try:
        assert second.target.tokens == []
        assert second.device_cost() == measured, "a new session reads it back without measuring"
        assert second.device_cost(remeasure=True) is None, "measuring anew needs a context to measure after"
    finally:
        second.close()




def test_under_load_a_row_is_priced_by_the_time_it_adds_to_the_whole_batch(tiny) -> None:
    """Alone, a batch of 2 costs 1.1 plain steps and a one-token lookup accepted 40% of the time pays. Beside 3
    other sequences with 3 rows in all, the same row makes the batch T(5)/T(4) = 1.385 times longer for all 4
    of them: it costs 1 + 4 x 0.385 plain steps of this sequence and does not pay. Alone again, the decision
    is the lone one exactly."""
    from backends.steps import BatchLoad

    curve = BatchCost(tuple(0.01 * (1 + 0.1 * (k - 1) if k <= 4 else 1.3 + 0.5 * (k - 4)) for k in range(1, 17)))
    engine = _engine(tiny, None, DeviceCost(curve, 0.0))
    try:
        gen = _prefilled(engine)
        rate = 1 / 0.01
        alone = gen.costs.relative(2)
        assert alone == pytest.approx(1.1)
        assert best_chain_length([0.4], rate, 0.01, gen.costs.relative)[0] == 1, "alone: the lookup pays"
        gen.slot.load = BatchLoad(sequences=4, rows=4)  # this one's plain row + 3
        assert gen.costs.relative(2) == pytest.approx(1 + 4 * (1.8 / 1.3 - 1))
        assert best_chain_length([0.4], rate, 0.01, gen.costs.relative)[0] == 0, "under load: plain"
        assert best_chain_length([0.95] * 4, rate, 0.01, gen.costs.relative)[0] == 0, "even a likely chain on a steep curve"
        flat_engine = _engine(tiny, None, DeviceCost(flat(), 0.0))
        try:
            flat_gen = _prefilled(flat_engine)
            flat_gen.slot.load = BatchLoad(sequences=4, rows=4)
            assert best_chain_length([0.4], rate, 0.01, flat_gen.costs.relative)[0] == 1, "rows are free: it pays"
        finally:
            flat_engine.close()
        # The others verify 36 rows: the 4 rows this one's 2 add cost what they cost (the slope, 0.5 x T(1) a
        # row), against the batch's plain tick T(4) = 1.3, not against the 40-row tick the others made.
        gen.slot.load = BatchLoad(sequences=4, rows=40)
        slope = (curve.relative(43) - curve.relative(40)) / 4 if len(curve.seconds) >= 43 else 0.5
        assert gen.costs.relative(2) == pytest.approx(1 + 4 * slope / 1.3)
        gen.slot.load = BatchLoad(sequences=1, rows=1, running=4)  # 3 joined since: the first tick of a burst
        assert gen.costs.batch() == (4, 3)
        assert gen.costs.relative(2) == pytest.approx(1 + 4 * (1.8 / 1.3 - 1)), "priced as beside them"
        gen.slot.load = BatchLoad()
        assert gen.costs.relative(2) == alone
    finally:
        engine.close()


def test_under_load_a_row_past_a_jump_of_the_curve_costs_the_jump(tiny) -> None:
    """The batch cost curve an H200 measured with the 135M SmolLM2 (docs/results.md, "A GPU"; timed at the
    launch then, a jump all the same): flat to 8 rows, then 83% dearer at 9, where llama.cpp's kernels for small
    batches stop. Beside 7 others, one more row makes the tick T(9)/T(8) times longer for all 8 sequences: priced
    so, a lookup even a sure one does not pay. Averaged by the slope over LOAD_SLOPE_SPAN rows it cost a quarter
    of that, and 8 clients verified such rows at 0.83-0.87x plain."""
    from backends.steps import BatchLoad

    rel = (1.00, 1.52, 1.52, 1.85, 1.89, 1.98, 2.00, 2.05, 3.76, 3.88, 3.91, 3.97, 3.99, 3.99, 3.99, 4.06)
    engine = _engine(tiny, None, DeviceCost(BatchCost(tuple(0.0014 * r for r in rel)), 0.0))
    try:
        gen = _prefilled(engine)
        gen.slot.load = BatchLoad(sequences=8, rows=8)
        assert gen.costs.relative(2) == pytest.approx(1 + 8 * (3.76 / 2.05 - 1))
        rate = 1 / 0.0014
        assert best_chain_length([0.99], rate, 0.0014, gen.costs.relative)[0] == 0, "one more row: plain"
        assert best_chain_length([0.99] * 8, rate, 0.0014, gen.costs.relative)[0] == 0, "nor a long sure chain"
        gen.slot.load = BatchLoad(sequences=4, rows=4)  # below the jump: 4 more rows add 11% to the tick
        assert gen.costs.relative(5) == pytest.approx(1 + 4 * (2.05 / 1.85 - 1))
    finally:
        engine.close()


def test_a_block_drafters_later_tokens_are_priced_by_their_rows_alone(tiny) -> None:
    """A draft as dear as a target step and rows that cost nothing (a flat curve): a draft model's next token
    cannot pay for its own decode, a block drafter's (backends.dflash: one decode for the whole chain) can; and
    a chain priced before any draft step pays the block's decode once, not per token."""
    from backends.strategies.auto.choose import DraftPays

    engine = _engine(tiny, tiny.draft, DeviceCost(flat(), 1.0))
    try:
        gen = _prefilled(engine)
        for _ in range(50):
            gen.state.draft_by_conf.update(9, True)  # drafts at confidence >= 0.9 are nearly always accepted
        one_by_one, block = DraftPays(gen.state, gen.costs, 6), DraftPays(gen.state, gen.costs, 6, block=True)
        assert one_by_one.keep(0, 0.95) and block.keep(0, 0.95)
        assert not one_by_one.more(0, 0.95), "each further token would cost a whole step to draft"
        assert block.more(0, 0.95), "the block drafted it already"
    finally:
        engine.close()
    # Drafts accepted 90% of the time, a draft decode 0.95 of a step, rows free: one by one not even the first
    # pays; as a block the whole chain does, for one decode.
    k_each, _, _ = best_chain_length([0.9] * 6, 1.0, 1.0, lambda k: 1.0, per_token=0.95)
    k_block, _, seconds = best_chain_length([0.9] * 6, 1.0, 1.0, lambda k: 1.0, once=0.95)
    assert (k_each, k_block) == (0, 6) and seconds == pytest.approx(1.95)
