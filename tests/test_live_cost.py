"""A lane's cost curve kept current from every decode (backends.live_cost, Lane.live), and `auto` priced with it
alone and under load (backends.strategies.auto.costs): the rule on synthetic readings, the readings of real
llama.cpp decodes, decisions that follow a machine that changed since its cost was measured, and what one
process learnt taken up by the next (backends.slot.Learnt)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from backends.config import AutoConfig, StrategyOptions
from backends.device_cost import BatchCost, CostCache, DeviceCost
from backends.engine import Engine, EngineConfig
from backends.live_cost import CLIP, KEPT_FOR, RATE, LiveCurve
from backends.sampling import GenParams
from backends.slot import Learnt
from backends.steps import BatchLoad
from backends.store import JsonStore
from backends.strategies.auto.decide import best_chain_length
from auto_helpers import TINY_PROMPTS, flat, prefilled, synthetic_engine
from engine_helpers import run_to_done

LINEAR = tuple(0.01 * (1 + 0.1 * (k - 1)) for k in range(1, 17))  # T(k) = T(1) (1 + 0.1 (k - 1))


def _seeded(seconds=LINEAR) -> LiveCurve:
    live = LiveCurve()
    live.seed(seconds)
    return live


# -- the rule, on synthetic readings ----------------------------------------------------------------------------------

def test_unseeded_a_curve_is_none_and_readings_are_not_taken() -> None:
    live = LiveCurve()
    live.observe(1, 0.01)
    assert live.curve() is None and live.observed == 0
    with pytest.raises(ValueError):
        live.seed([0.01, 0.0])


def test_a_machine_that_slows_down_is_followed_within_dozens_of_decodes() -> None:
    """Every batch size takes twice its measured time (another program took a core): within 40 decodes of
    sizes 1 and 5 the curve reads within 10% of twice the measurement at every size, those never decoded too,
    and its shape (T(k)/T(1)) stays the measured one. When the machine is back, it follows back."""
    live = _seeded()
    for i in range(40):
        k = 1 if i % 2 else 5
        live.observe(k, 2 * LINEAR[k - 1])
    curve = live.curve()
    for k in (1, 5, 9, 16):
        assert curve.seconds[k - 1] == pytest.approx(2 * LINEAR[k - 1], rel=0.1), k
    assert curve.relative(9) == pytest.approx(1.8, rel=0.05)
    for i in range(60):
        live.observe(1 if i % 2 else 5, LINEAR[0 if i % 2 else 4])
    assert live.curve().seconds[8] == pytest.approx(LINEAR[8], rel=0.1)


def test_a_stall_moves_the_curve_by_a_bounded_step() -> None:
    """One decode that took ten times its cost (a page fault, the collector) moves the level by at most
    RATE * CLIP in log seconds: the curve stays within 6% of what it was."""
    live = _seeded()
    for _ in range(30):
        live.observe(1, LINEAR[0])
    before = live.curve().seconds
    live.observe(1, 10 * LINEAR[0])
    after = live.curve().seconds
    bound = pytest.approx(1.0, abs=RATE * CLIP + 0.01)
    assert all(a / b == bound for a, b in zip(after, before))
    assert after[4] / before[4] > 1.0


def test_a_batch_size_dearer_than_measured_is_learnt_apart_from_the_level() -> None:
    """Decodes of 1 row take their measured time, decodes of 8 rows 1.5 times theirs (the curve was measured in
    a fast spell): the curve's T(8)/T(1) goes from 1.7 to ~2.55, T(1) stays, and the curve stays non-decreasing."""
    live = _seeded()
    for _ in range(300):
        live.observe(1, LINEAR[0])
        live.observe(8, 1.5 * LINEAR[7])
    curve = live.curve()
    assert curve.seconds[0] == pytest.approx(LINEAR[0], rel=0.1)
    assert curve.relative(8) == pytest.approx(1.5 * 1.7, rel=0.1)
    assert all(a <= b for a, b in zip(curve.seconds, curve.seconds[1:]))


def test_the_curve_is_each_sizes_prediction_made_non_decreasing() -> None:
    """curve() builds every size's `seconds` inline (once a step): it must be exactly their prefix maxima, after
    readings of some sizes, many of one and none of others."""
    live = _seeded()
    for i in range(200):
        live.observe(1 + (i * 7) % 5, LINEAR[(i * 7) % 5] * (1.3 if i % 3 else 0.8))
    live.observe(12, 2.0 * LINEAR[11])
    expected, top = [], 0.0
    for k in range(1, len(LINEAR) + 1):
        top = max(top, live.seconds(k))
        expected.append(top)
    assert live.curve().seconds == tuple(expected)
    assert len(set(expected)) > 8, "the readings moved sizes apart"


def test_reseeding_keeps_what_was_learnt_for_the_same_curve_and_starts_over_for_a_new_one() -> None:
    live = _seeded()
    for _ in range(30):
        live.observe(2, 3 * LINEAR[1])
    learnt = live.curve()
    live.seed(LINEAR)
    assert live.curve() is learnt
    live.seed(tuple(2 * s for s in LINEAR))
    assert live.curve().seconds[0] == pytest.approx(2 * LINEAR[0]) and live.observed == 0
    live.observe(17, 1.0)  # beyond the seed's rows: nothing to compare it with
    assert live.observed == 0


# -- real decodes -----------------------------------------------------------------------------------------------------

def test_decodes_that_want_logits_on_every_row_are_readings_and_prompt_chunks_are_not(tiny) -> None:
    """A lane seeded with a curve a thousand times too slow reads real decodes: a prompt decoded with logits on
    its last row only is not taken; single tokens and verification-shaped batches are, and pull the curve
    toward what they took."""
    engine = synthetic_engine(tiny, None, None)
    try:
        seq = engine.target
        lane = seq.lane
        lane.live.seed(tuple(1000 * s for s in LINEAR))
        prompt = engine.tokenize("the cat sat on the mat and then")
        seq.sync(prompt, logits=False)
        assert lane.live.observed == 0 and lane.last_rows == len(prompt)
        for _ in range(10):
            seq.extend([prompt[-1]] * 4, logits="all")
            seq.truncate(len(prompt))
            seq.extend([prompt[-1]])
            seq.truncate(len(prompt))
        assert lane.live.observed == 20 and lane.last_rows == 1
        assert lane.live.curve().seconds[0] < 1000 * LINEAR[0] * 0.5, "the readings pulled it down"
    finally:
        engine.close()


# -- auto priced with it ----------------------------------------------------------------------------------------------

def test_auto_prices_with_the_live_curve_alone_and_under_load(tiny) -> None:
    """Measured flat (a batch of 16 costs one token), the device now takes T(k) = k T(1): a lookup of one
    token accepted 60% of the time pays on the measured curve and not on the live one, alone and beside
    3 other sequences. Where timing is not learnt (these tests' synthetic devices), the measured curve stands."""
    engine = synthetic_engine(tiny, None, DeviceCost(flat(), 0.0))
    try:
        gen = prefilled(engine)
        rate = 1 / 0.01
        assert best_chain_length([0.6], rate, 0.01, gen.costs.relative)[0] == 1, "as measured: it pays"
        live = engine.target.lane.live
        assert live.seeded, "auto seeded its lane from the measurement"
        for _ in range(200):
            for k in (1, 2, 4, 8, 16):
                live.observe(k, 0.01 * k)
        assert best_chain_length([0.6], rate, 0.01, gen.costs.relative)[0] == 1, "timing not learnt: as measured"
        gen.state.learn_timing = True
        assert gen.costs.relative(2) == pytest.approx(2.0, rel=0.15)
        assert best_chain_length([0.6], rate, 0.01, gen.costs.relative)[0] == 0, "live: plain"
        gen.slot.load = BatchLoad(sequences=4, rows=4)
        assert best_chain_length([0.6], rate, 0.01, gen.costs.relative)[0] == 0, "live, under load: plain"
    finally:
        engine.close()


def test_under_load_a_draft_decode_is_priced_by_its_share_of_the_draft_phase(tiny) -> None:
    """Beside 3 others, all 4 drafting: each waits for the draft phase, a batch of 4 draft rows. On live curves
    (target: a tick of 4 rows costs 0.013 s; draft: 4 rows 0.004 s), one sequence's draft decode costs the
    batch 4 x 0.004/4 = 0.004 s against the tick, in its plain steps: 0.004/0.013 of one, also where the
    others' rows make the tick longer. Seeded, it is what the measurement says, once per sequence of the batch."""
    draft_seconds = tuple(0.001 * (1 + 0.1 * (k - 1)) for k in range(1, 17))
    engine = synthetic_engine(tiny, tiny.draft, DeviceCost(BatchCost(LINEAR), 0.1))
    try:
        gen = prefilled(engine, StrategyOptions(auto=AutoConfig(lookup=False, lookahead=False)))
        costs = gen.costs
        t_plain = 0.01
        gen.slot.load = BatchLoad(sequences=4, rows=4)
        assert costs.t_draft(t_plain) == pytest.approx(4 * 0.001), "as measured, once per sequence"
        gen.state.learn_timing = True
        draft_lane, target_lane = gen.slot.draft.lane, gen.slot.target.lane
        assert draft_lane.live.curve().seconds[0] == pytest.approx(0.001)
        draft_lane.live.seed(draft_seconds)
        for _ in range(100):
            draft_lane.live.observe(4, 0.004)
            target_lane.live.observe(4, 0.013)
        draft_lane.last_rows = 4
        gen.slot.load = BatchLoad(sequences=4, rows=4)
        assert costs.t_draft(t_plain) == pytest.approx(t_plain * 4 * (0.004 / 4) / 0.013, rel=0.05)
        # The others verify 36 rows, a tick of 40 (0.04 s): the draft phase is still priced against the batch's
        # plain tick, one row per sequence (0.013 s), not against the tick their proposals slowed.
        for _ in range(100):
            target_lane.live.observe(40, 0.04)
        gen.slot.load = BatchLoad(sequences=4, rows=40)
        assert costs.t_draft(t_plain) == pytest.approx(t_plain * 4 * (0.004 / 4) / 0.013, rel=0.05)
        gen.slot.load = BatchLoad()
        assert costs.t_draft(t_plain) == pytest.approx(0.001), "alone: as learnt alone"
    finally:
        engine.close()


def test_a_draft_that_became_as_dear_as_the_target_is_dropped_on_the_live_ratio(tiny) -> None:
    """Measured at a tenth of a target decode, the draft now takes as long as one (its core is taken): a new
    generation neither tries nor keeps it, on the lanes' live curves."""
    engine = synthetic_engine(tiny, tiny.draft, DeviceCost(BatchCost(LINEAR), 0.1))
    try:
        assert prefilled(engine).draft is not None
        for mode in ("greedy", "sampled"):
            engine.auto_states[mode].learn_timing = True
        for _ in range(100):
            engine.draft.lane.live.observe(1, LINEAR[0])
            engine.target.lane.live.observe(1, LINEAR[0])
        assert prefilled(engine).draft is None
    finally:
        engine.close()


def test_a_draft_lane_moves_with_the_target_lanes_level_and_learns_its_own_ratio_beyond_it() -> None:
    """A busy core slows the target's decodes by half while the draft stands by: its curve rises with the
    target's, the ratio stays as measured. Its own decodes, then twice as dear as that ratio says, are learnt
    on top and kept when the target's level moves again."""
    target, draft = _seeded(), _seeded(tuple(0.3 * s for s in LINEAR))
    draft.follows = target
    for _ in range(100):
        target.observe(1, 1.5 * LINEAR[0])
    assert target.curve().seconds[0] == pytest.approx(1.5 * LINEAR[0], rel=0.02)
    assert draft.curve().seconds[0] / target.curve().seconds[0] == pytest.approx(0.3, rel=0.02), "no readings"
    for _ in range(100):
        target.observe(1, 1.5 * LINEAR[0])
        draft.observe(1, 0.9 * LINEAR[0])
    assert draft.curve().seconds[0] / target.curve().seconds[0] == pytest.approx(0.6, rel=0.03)
    for _ in range(100):
        target.observe(1, LINEAR[0])  # the busy core goes
    assert draft.seconds(1) / target.seconds(1) == pytest.approx(0.6, rel=0.03)
    assert draft.curve().seconds[0] == pytest.approx(0.6 * LINEAR[0], rel=0.03)
    alone = _seeded(tuple(0.3 * s for s in LINEAR))
    for _ in range(100):
        alone.observe(1, 0.9 * LINEAR[0])
    assert alone.to_json()["offset"][0] == pytest.approx(1.099, abs=0.02), "following none: as before"


def test_the_engine_has_the_drafts_lane_follow_the_targets_and_its_ratio_hold_through_a_busy_spell(tiny) -> None:
    """Real engine: measured at a tenth, the draft is still a tenth of a target decode after the target's lane
    read twice its curve for a while (another program on a core); before, its curve kept the time it was
    last seen at, and the ratio fell to a twentieth."""
    engine = synthetic_engine(tiny, tiny.draft, DeviceCost(BatchCost(LINEAR), 0.1))
    try:
        assert engine.draft.lane.live.follows is engine.target.lane.live
        gen = prefilled(engine)
        gen.state.learn_timing = True
        for _ in range(100):
            engine.target.lane.live.observe(1, 2 * LINEAR[0])
        assert gen.costs.draft_ratio() == pytest.approx(0.1, rel=0.05)
    finally:
        engine.close()


# -- kept between processes -------------------------------------------------------------------------------------------

def _learnt_curve() -> LiveCurve:
    """Sizes 1 and 8 read dearer than measured, each its own way; the others follow the level."""
    live = _seeded()
    for _ in range(40):
        live.observe(1, 1.3 * LINEAR[0])
        live.observe(8, 2.0 * LINEAR[7])
    return live


def test_a_curve_round_trips_through_json_and_learning_goes_on_from_there() -> None:
    live = _learnt_curve()
    entry = json.loads(json.dumps(live.to_json()))
    assert len(json.dumps(entry)) < 400, "a few hundred bytes"
    again = _seeded()
    assert again.restore(entry) and again.observed == 0
    assert again.curve().seconds == pytest.approx(live.curve().seconds, rel=1e-3)
    assert again.level == pytest.approx(live.level, abs=1e-3)
    for curve in (live, again):  # the same readings move both alike: the weights came along too
        for _ in range(5):
            curve.observe(3, 3 * LINEAR[2])
    assert again.curve().seconds == pytest.approx(live.curve().seconds, rel=1e-3)


def test_a_stale_malformed_or_other_seeds_entry_is_ignored() -> None:
    entry = _learnt_curve().to_json()
    assert entry is not None and LiveCurve().to_json() is None
    now = entry["saved_at"]
    bad = [
        None, [], {}, "x", {**entry, "format": 0}, {**entry, "seed": "0" * 16},
        {**entry, "offset": entry["offset"][1:]},
        {**entry, "weight": [-1.0] * len(LINEAR)}, {**entry, "offset": ["a"] * len(LINEAR)},
        {**entry, "offset": [float("nan")] * len(LINEAR)}, {**entry, "saved_at": "yesterday"},
        {k: v for k, v in entry.items() if k != "weight"},
    ]
    for data in bad:
        live = _seeded()
        assert not live.restore(data, now), data
        assert live.curve().seconds == pytest.approx(LINEAR) and live.level == 0.0
    assert not _seeded().restore(entry, now + KEPT_FOR + 1), "older than a week"
    assert _seeded().restore(entry, now + KEPT_FOR - 1)
    other = LiveCurve()
    other.seed(tuple(2 * s for s in LINEAR))
    assert not other.restore(entry), "an offset means nothing against another measurement"


def test_learnt_keeps_each_lanes_curve_and_a_new_one_takes_it_up_when_seeded(tmp_path: Path) -> None:
    """Through the store (learnt.json): written only once something was observed, at most once a minute at a
    generation's end and always when the engine closes; taken up on the first seed with the same curve; read
    by none after `afresh`."""
    store = JsonStore(tmp_path / "learnt.json")
    lanes = {"target": SimpleNamespace(live=LiveCurve()), "draft": None}
    learnt = Learnt(store, lambda: "k", lanes)  # type: ignore[arg-type]
    learnt.flush(force=True)
    assert not store.path.exists(), "nothing learnt: nothing written"
    live = lanes["target"].live
    live.seed(LINEAR)
    for _ in range(40):
        live.observe(2, 2 * LINEAR[1])
    learnt.keep("auto.greedy", {"saved_at": time.time()})  # a generation's end
    assert set(json.loads(store.path.read_text())) == {"auto.greedy:k", "live:target:k"}
    live.observe(2, 2 * LINEAR[1])
    state = {"saved_at": time.time(), "steps": 1}
    learnt.keep("auto.greedy", lambda: dict(state))  # made when written: the latest state then
    state["steps"] = 2
    assert learnt.kept("live:target")["offset"] != live.to_json()["offset"], "not again within the minute"
    assert "steps" not in learnt.kept("auto.greedy"), "what strategies keep waits too"
    learnt.flush(force=True)  # the engine closes
    assert learnt.kept("live:target")["offset"] == live.to_json()["offset"]
    assert learnt.kept("auto.greedy")["steps"] == 2

    def new_lane(afresh: bool = False) -> LiveCurve:
        lane = SimpleNamespace(live=LiveCurve())
        later = Learnt(store, lambda: "k", {"target": lane})  # type: ignore[dict-item]
        if afresh:
            later.afresh()
        lane.live.seed(LINEAR)
        return lane.live

    assert new_lane().curve().seconds == pytest.approx(live.curve().seconds, rel=1e-3)
    assert new_lane(afresh=True).curve().seconds == pytest.approx(LINEAR), "a bench reads nothing"
    store.put("live:target:k", {"saved_at": time.time(), "format": 1, "seed": live.to_json()["seed"], "offset": 3})
    assert new_lane().curve().seconds == pytest.approx(LINEAR), "malformed: from the seed"


def test_a_second_engine_on_the_same_files_starts_from_the_first_ones_curve(tiny, tmp_path: Path) -> None:
    """Real llama.cpp: an engine's auto runs decode on lanes seeded with a curve a thousand times too slow,
    which its decodes pull down; the engine closes. The next engine on the same files (and device cost) starts
    its lanes from where the first left them, before any decode of its own; after `afresh`, from the seed."""
    config = EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1, n_seq_max=8,
                          cost_cache=tmp_path / "device-cost.json")
    slow = DeviceCost(BatchCost(tuple(1000 * s for s in LINEAR)), 0.5, measured_at=time.time())
    params = GenParams(max_tokens=24, temperature=0.0)
    first = Engine(config)
    try:
        CostCache(config.cost_cache).put(first._cost_key, slow)
        for text in TINY_PROMPTS[:2]:
            run_to_done(first, "auto", first.tokenize(text), params)
        live = first.target.lane.live
        assert live.observed > 0 and live.curve().seconds[0] < 0.5 * slow.batch.seconds[0]
        learnt = live.curve().seconds
    finally:
        first.close()
    assert first.learnt.kept("live:target") is not None

    def started(afresh: bool) -> tuple[float, ...]:
        engine = Engine(config)
        try:
            if afresh:
                engine.learn_afresh()
            prefilled(engine)  # auto seeds the lanes from the device cost; the prompt is no reading
            live = engine.target.lane.live
            assert live.observed == 0
            return live.curve().seconds
        finally:
            engine.close()

    assert started(afresh=False) == pytest.approx(learnt, rel=1e-3)
    assert started(afresh=True) == pytest.approx(slow.batch.seconds)
