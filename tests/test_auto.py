"""`auto`: its decision rule on synthetic costs, its cost cache, and its output on real llama.cpp.

The output must be the target's greedy output token for token at temperature
0, and have the target's law under sampling (chi-square at alpha 1e-4, as for
the fixed strategies), whatever mix of plain, lookup, draft and lookahead
steps it chooses.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from backends.config import AutoConfig, LookaheadConfig, LookupConfig, SpsConfig, StrategyOptions
from backends.device_cost import BatchCost, CostCache, DeviceCost
from backends.engine import Engine, EngineConfig
from backends.events import StepEnd
from backends.sampling import GenParams
from backends.strategies.auto import AutoDecoding
from backends.strategies.auto.choose import TRYING
from backends.strategies.auto.decide import BACKOFF_MAX, MIN_EXPLORE_INTERVAL, TRY_DRAFT_MAX, explore_interval
from backends.strategies.auto.state import AutoState, confidence_bin, lookup_acceptance, lookup_key
from auto_helpers import NO_EXPLORING, TINY_PROMPTS, flat, steep, synthetic_engine as _engine, unchecked
from engine_helpers import DEMO_NOISE, assert_greedy_agrees, remember_continuations, run_to_done
from stats_helpers import ALPHA, assert_target_law, outcome, target_law
from test_lossless import PARAMS, _copying_prompt

# Outcomes of the law tests: three tokens, since auto's first token comes from a plain step (FIRST_TOKEN).
OUTCOME = 3


# -- what auto learnt, kept between sessions --------------------------------------------------------------------------

def _learnt_state() -> AutoState:
    """A state with something learnt in every kind of estimate."""
    st = AutoState()
    for i in range(6):
        st.draft_by_conf.update(confidence_bin(0.85), i % 3 != 0)
        st.draft_by_pos.update(i % 2, i < 4)
        st.lookup.update(lookup_key(10, i % 2), True)
        st.t_plain.add(0.02 + 0.001 * i)
        st.draft_step_tokens.add(2.5)
    st.batch_scale.add(0.3, 0.6)
    st.taken.update(plain=40, draft=6, lookup=5)
    st.backoff["lookahead"] = 2
    st.since["draft"] = 17
    st.temperature = 0.8
    return st


def test_auto_state_round_trips_through_json_and_anything_malformed_starts_afresh() -> None:
    import json
    st = _learnt_state()
    back = AutoState.from_json(json.loads(json.dumps(st.to_json())))
    for key in (confidence_bin(0.85), confidence_bin(0.15)):
        assert back.draft_by_conf.p(key) == pytest.approx(st.draft_by_conf.p(key))
    assert back.draft_by_pos.p(1) == pytest.approx(st.draft_by_pos.p(1)) != pytest.approx(0.5)
    assert back.lookup.p((10, 1)) == pytest.approx(st.lookup.p((10, 1)))
    assert back.lookup.p((10, 1)) != pytest.approx(lookup_acceptance().p((10, 1)))
    assert (back.t_plain.value, back.t_plain.n) == (st.t_plain.value, st.t_plain.n)
    assert back.draft_step_tokens.value == 2.5 and back.lookahead_tokens.value is None
    assert back.batch_scale.factor() == pytest.approx(st.batch_scale.factor()) != 1.0
    assert back.taken == st.taken and back.backoff == st.backoff and back.temperature == 0.8
    assert back.since == {}, "steps since the last try are this session's"
    fresh = AutoState().to_json()
    good = st.to_json()
    for bad in (None, {}, {**good, "format": [0]}, {**good, "taken": ["draft"]}, {**good, "t_plain": [0.1]},
                {**good, "lookup": [[[10, 1], -1.0, 0.0]]}, {**good, "draft_by_pos": [["x", 1, 1]]},
                {**good, "t_plain": [float("nan"), 3]}, {**good, "batch_scale": [float("inf"), 1.0]}):
        got = AutoState.from_json(bad).to_json()  # type: ignore[arg-type]
        assert {k: v for k, v in got.items() if k != "saved_at"} == \
            {k: v for k, v in fresh.items() if k != "saved_at"}, bad


def test_a_new_session_starts_from_what_auto_learnt_in_the_last_on_the_same_files(tiny, tmp_path: Path) -> None:
    config = EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1,
                          cost_cache=tmp_path / "device-cost.json")
    params = GenParams(max_tokens=64)
    # A synthetic device, kept in the cost cache as a measured one would be, and auto's times not learnt live:
    # measured, a tiny draft costs 0.6-0.8 of a target step, and below about 0.7 auto takes it on its estimate
    # from the first step, with nothing to try; how busy the machine is must not decide whether this test fails.
    probe = Engine(config)
    try:
        CostCache(config.cost_cache).put(probe._cost_key, DeviceCost(
            BatchCost(tuple(0.01 * (1 + 0.5 * k) for k in range(16))), 0.9, measured_at=time.time()))
    finally:
        probe.close()

    def session(cfg: EngineConfig, afresh: bool = False) -> tuple[dict, list[int]]:
        """One engine's life: two auto runs; what it learnt, and how many steps of each run were tries."""
        engine = unchecked(Engine(cfg))  # what it tries must not hang on what the realised check saw of timing
        try:
            if afresh:
                engine.learn_afresh()
            AutoDecoding(engine.slots[0]).state_for(params).learn_timing = False  # loads what was kept, as a run does
            tries = []
            for text in TINY_PROMPTS[:2]:
                done = run_to_done(engine, "auto", engine.tokenize(text), params)
                tries.append(int(done.stats.extra["explored_steps"]))  # type: ignore[call-overload]
            state = engine.auto_states["greedy"]
            assert isinstance(state, AutoState)
            return state.to_json(), tries
        finally:
            engine.close()

    first, first_tries = session(config)
    assert first_tries[0] > 0, "a new machine tries the options early"
    assert (tmp_path / "learnt.json").exists()
    engine = Engine(config)
    try:
        auto = AutoDecoding(engine.slots[0])
        greedy = auto.state_for(params)
        assert greedy.taken == first["taken"] and greedy.draft_by_pos.counts() == first["draft_by_pos"]
        assert auto.state_for(replace(params, temperature=0.8)).taken == {}, "sampling learns its own"
    finally:
        engine.close()
    _, again_tries = session(config)
    assert again_tries[0] < first_tries[0], "the next session does not pay the first tries again"
    # Another thread count is another device: nothing kept applies. A bench starts afresh too (learn_afresh).
    for cfg, afresh in ((replace(config, threads=2), False), (config, True)):
        engine = Engine(cfg)
        try:
            if afresh:
                engine.learn_afresh()
            assert AutoDecoding(engine.slots[0]).state_for(params).taken == {}
        finally:
            engine.close()
    afresh, afresh_tries = session(config, afresh=True)
    assert afresh_tries[0] > 0
    engine = Engine(config)
    try:
        kept_now = engine.learnt.kept("auto.greedy")
        assert kept_now is not None and kept_now["taken"] == afresh["taken"], \
            "what a fresh start learnt is kept all the same"
    finally:
        engine.close()


# -- real runs --------------------------------------------------------------------------------------------------------

def test_auto_speculates_on_a_cheap_device_and_not_on_a_dear_one(tiny) -> None:
    """Identical draft (accepts all), a flat curve and a cheap draft: long drafts. A steep curve and dear draft: none."""
    cheap = _engine(tiny, tiny.same_draft, DeviceCost(flat(), 0.05))
    dear = _engine(tiny, tiny.same_draft, DeviceCost(steep(), 1.0))
    try:
        prompt = cheap.tokenize(TINY_PROMPTS[1])
        ref = run_to_done(cheap, "ar", prompt, GenParams(max_tokens=64))
        for _ in range(2):  # the second turn uses what the first learnt
            fast = run_to_done(cheap, "auto", prompt, GenParams(max_tokens=64), NO_EXPLORING)
        assert fast.tokens == ref.tokens
        assert fast.stats.steps_by_choice.get("draft", 0) > 0
        assert fast.stats.mean_accepted_per_forward > 4
        assert fast.stats.tokens_by_source.get("draft", 0) > 32
        slow = run_to_done(dear, "auto", prompt, GenParams(max_tokens=64), NO_EXPLORING)
        assert slow.tokens == ref.tokens
        assert set(slow.stats.steps_by_choice) <= {"plain", "lookup"}, slow.stats.steps_by_choice
        assert slow.stats.tokens_by_source.get("draft", 0) == 0
    finally:
        cheap.close()
        dear.close()


def test_exploration_comes_early_for_a_new_option_then_within_its_budget() -> None:
    waits = [explore_interval(0.01, 0.2, 1, taken) for taken in range(6)]
    assert waits[0] == 8 and waits == sorted(waits), waits  # the first try soon, then ever rarer
    assert waits[-1] == MIN_EXPLORE_INTERVAL, "a known option: the steady floor"
    # An option a try of which loses 5 plain steps: 1% of the time means one try per 500 steps at least.
    assert explore_interval(0.01, 5.0, 1, 10) == 500
    assert explore_interval(0.01, 5.0, 1, 0) >= 5.0 / (0.01 * 16), "early tries stay within 16x the budget"
    assert explore_interval(0.0, 0.2, 1, 0) > 10**6, "no budget: never"


def test_tries_that_confirm_an_option_does_not_pay_back_off() -> None:
    steady = explore_interval(0.01, 5.0, 1, 10)
    waits = [explore_interval(0.01, 5.0, 1, 10, backoff) for backoff in range(BACKOFF_MAX + 3)]
    assert waits[:BACKOFF_MAX + 1] == [steady << b for b in range(BACKOFF_MAX + 1)], waits
    assert waits[BACKOFF_MAX + 1:] == [steady << BACKOFF_MAX] * 2, "the back-off is capped"
    assert explore_interval(0.01, 0.2, 1, 0, 3) == explore_interval(0.01, 0.2, 1, 0), "early tries: their own schedule"


def test_lookahead_tries_back_off_within_a_generation_and_a_new_temperature_starts_over(tiny) -> None:
    """A lookahead step costs 8 plain steps on this device and yields at most 3 tokens: never chosen on its
    estimate, so each try leaves it worse and the wait before the next one doubles (128, 256, 512 steps)."""
    engine = _engine(tiny, None, DeviceCost(steep(), 0.0))
    try:
        state, sampled = engine.auto_states["greedy"], engine.auto_states["sampled"]
        state.taken.update({"lookahead": 4})  # past the early tries
        options = StrategyOptions(auto=AutoConfig(lookup=False, explore_budget=0.2))
        prompt = engine.tokenize(TINY_PROMPTS[0])
        events = engine.strategy("auto", options).generate(prompt, GenParams(max_tokens=1000))
        steps = [e.choice for e in events if isinstance(e, StepEnd)]
        tries = [i for i, c in enumerate(steps) if c == "lookahead"]
        assert len(steps) >= 900 and len(tries) == 3, (len(steps), tries)
        # The steps since a try are counted from the one after it, so each later gap is its wait + 1.
        gaps = [b - a for a, b in zip([0, *tries], tries)]
        assert gaps == [MIN_EXPLORE_INTERVAL, 2 * MIN_EXPLORE_INTERVAL + 1, 4 * MIN_EXPLORE_INTERVAL + 1], tries
        assert state.backoff == {"lookahead": 3}
        list(engine.strategy("auto", options).generate(prompt, GenParams(max_tokens=8, temperature=0.7, seed=1)))
        assert sampled.backoff == {} and sampled.temperature == 0.7, "tries made greedy say nothing of sampling"
        assert state.backoff == {"lookahead": 3}, "greedy keeps its own"
        sampled.backoff["lookahead"] = 2
        list(engine.strategy("auto", options).generate(prompt, GenParams(max_tokens=8, temperature=0.7, seed=2)))
        assert sampled.backoff == {"lookahead": 2}, "the same temperature keeps the back-off"
        list(engine.strategy("auto", options).generate(prompt, GenParams(max_tokens=8, temperature=1.0, seed=3)))
        assert sampled.backoff == {}, "another temperature starts it over"
    finally:
        engine.close()


def test_an_option_chosen_on_its_estimate_is_tried_on_the_steady_schedule_again(tiny) -> None:
    """A cheap identical draft on a flat curve is chosen from the first step: its back-off is dropped."""
    engine = _engine(tiny, tiny.same_draft, DeviceCost(flat(), 0.1))
    try:
        state = engine.auto_states["greedy"]
        state.taken.update({"draft": 4, "lookup": 4, "lookahead": 4})
        state.backoff.update({"draft": BACKOFF_MAX})
        state.temperature = 0.0
        prompt = engine.tokenize(TINY_PROMPTS[1])
        done = run_to_done(engine, "auto", prompt, GenParams(max_tokens=32), StrategyOptions(auto=AutoConfig(lookup=False)))
        assert done.stats.steps_by_choice.get("draft", 0) > 0, done.stats.steps_by_choice
        assert "draft" not in state.backoff, state.backoff
    finally:
        engine.close()


def test_auto_finds_a_draft_its_prior_calls_too_slow(tiny) -> None:
    """A draft costing 0.6 of a step on a curve rising 10% a row: at the prior acceptance (0.5) a draft step
    would lose, so without exploring auto stays plain; the identical draft really accepts everything, and the
    early tries find that out within the first tokens, after which auto drafts. (Without lookup: the tiny
    model's output repeats itself, and lookup would compete for the steps.)"""
    cost = DeviceCost(BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16))), 0.6)
    engine = _engine(tiny, tiny.same_draft, cost)
    blind = _engine(tiny, tiny.same_draft, cost)
    no_lookup = AutoConfig(lookup=False)
    try:
        prompt = engine.tokenize(TINY_PROMPTS[1])
        ref = run_to_done(engine, "ar", prompt, GenParams(max_tokens=64))
        stays = run_to_done(blind, "auto", prompt, GenParams(max_tokens=64),
                            StrategyOptions(auto=replace(no_lookup, explore_budget=0.0)))
        assert stays.tokens == ref.tokens and set(stays.stats.steps_by_choice) == {"plain"}
        events = list(engine.strategy("auto", StrategyOptions(auto=no_lookup)).generate(prompt,
                                                                                         GenParams(max_tokens=64)))
        done = events[-1]
        assert done.tokens == ref.tokens
        drafts = [e.why for e in events if isinstance(e, StepEnd) and e.choice == "draft"]
        assert sum(TRYING not in why for why in drafts) >= 3, drafts  # chosen, not only tried
        assert done.stats.tokens_by_source.get("draft", 0) >= 16, done.stats.tokens_by_source
    finally:
        engine.close()
        blind.close()


def test_a_stale_draft_is_retried_where_the_draft_is_caught_up_not_after_a_long_stretch(tiny) -> None:
    """Past the early tries, trying the draft counts the decodes it needs to catch up on what it missed; after a
    long stretch of plain steps that costs more than the exploration budget, so within one generation the draft
    is retried only at its start (at the first step or the next, once the draft took the prompt), not every
    MIN_EXPLORE_INTERVAL steps."""
    cost = DeviceCost(BatchCost(tuple(0.01 * (1 + 0.5 * k) for k in range(16))), 0.3)  # the draft never pays
    engine = _engine(tiny, tiny.draft, cost)
    try:
        state = engine.auto_states["greedy"]
        state.taken.update({"draft": 4, "lookup": 4, "lookahead": 4})  # past the early tries
        state.since["draft"] = 10 * MIN_EXPLORE_INTERVAL  # stale: due now
        prompt = engine.tokenize(TINY_PROMPTS[0])
        events = list(engine.strategy("auto").generate(prompt, GenParams(max_tokens=3 * MIN_EXPLORE_INTERVAL + 40)))
        position, tries = 0, []
        for e in events:
            if isinstance(e, StepEnd):
                if e.choice == "draft":
                    tries.append(position)
                position += e.accepted + 1
        assert position > 3 * MIN_EXPLORE_INTERVAL, "long enough that the old schedule would try it 3 more times"
        assert len(tries) == 1 and tries[0] <= 1, f"one retry, at the start: {tries}"
    finally:
        engine.close()


@pytest.mark.parametrize("taken, drafted", [(0, 5), (4, TRY_DRAFT_MAX)], ids=["early-try", "steady-try"])
def test_a_try_of_the_draft_drafts_a_chain_whatever_the_estimates_say(tiny, taken: int, drafted: int) -> None:
    """Estimates that call every draft token a loss would stop a normal draft step after one token, and a try
    drafting one token cannot pay (a draft decode and a batch row for at most one more token): the try would
    confirm the estimate it is there to test. So a try drafts as sps does, while the confidence stays at or above
    p_min: up to sps's K while the draft is judged by its prior (the early tries), then up to TRY_DRAFT_MAX
    tokens, a cheaper test. The identical draft's tokens are all verified and accepted, and learnt from."""
    assert TRY_DRAFT_MAX < 5, "the case must tell the two lengths apart"
    cost = DeviceCost(BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16))), 0.6)
    engine = _engine(tiny, tiny.same_draft, cost)
    try:
        state = engine.auto_states["greedy"]
        for b in range(10):  # "the draft is refused whatever its confidence", as if it had been seen so
            for _ in range(50):
                state.draft_by_conf.update(b, False)
        before = [state.draft_by_conf.p(b) for b in range(10)]
        state.taken.update({"draft": taken, "lookup": 4, "lookahead": 4})
        state.since["draft"] = 10 * MIN_EXPLORE_INTERVAL  # stale: due now, at the start, when the draft is synced
        options = StrategyOptions(sps=SpsConfig(draft_max=5, p_min=0.0), auto=AutoConfig(lookup=False))
        prompt = engine.tokenize(TINY_PROMPTS[1])
        # 64 tokens: an answer long enough to afford the draft's catch-up on the prompt (choose.EAGER_SHARE)
        events = list(engine.strategy("auto", options).generate(prompt, GenParams(max_tokens=64)))
        tries = [e for e in events if isinstance(e, StepEnd) and e.choice == "draft"]
        assert tries and (tries[0].drafted, tries[0].accepted) == (drafted, drafted), tries
        after = [state.draft_by_conf.p(b) for b in range(10)]
        assert any(a > b for a, b in zip(after, before)), "the try is learnt from"
    finally:
        engine.close()


def test_auto_without_a_draft_uses_lookup_on_copying_text(tiny) -> None:
    engine = _engine(tiny, None, DeviceCost(flat(), 0.0))
    try:
        text = "one two three four five six seven eight nine ten " * 3
        prompt = engine.tokenize(text)
        ref = run_to_done(engine, "ar", prompt, GenParams(max_tokens=48))
        done = run_to_done(engine, "auto", prompt, GenParams(max_tokens=48))
        assert done.tokens == ref.tokens
        assert done.stats.steps_by_choice.get("lookup", 0) > 0
    finally:
        engine.close()


@pytest.mark.parametrize("text", TINY_PROMPTS)
@pytest.mark.parametrize("curve", ["flat", "steep", "measured"])
def test_auto_equals_ar_tiny(tiny, text: str, curve: str) -> None:
    """On the measured curve auto's steps (and so its batches) follow this machine's live timings: where a
    greedy choice is a near-tie (the second prompt's 22nd token wins by 0.019, tests/perf/greedy_margins.py),
    a verification batch may rightly take the other token, and only there (engine_helpers.assert_greedy_agrees)."""
    cost = {"flat": DeviceCost(flat(), 0.2), "steep": DeviceCost(steep(), 0.5), "measured": None}[curve]
    engine = _engine(tiny, tiny.draft, cost)
    try:
        prompt = engine.tokenize(text)
        ref = run_to_done(engine, "ar", prompt, GenParams(max_tokens=48))
        options = StrategyOptions(auto=AutoConfig(explore_budget=0.2), lookahead=LookaheadConfig(2, 3, 2))
        for _ in range(3):
            got = run_to_done(engine, "auto", prompt, GenParams(max_tokens=48), options)
            assert_greedy_agrees(engine, prompt, ref.tokens, got.tokens, f"auto on {curve}")
            if got.tokens == ref.tokens:
                assert got.text == ref.text
    finally:
        engine.close()


@pytest.mark.parametrize("proposers, mixed", [
    ({"lookup": False}, {"draft": 40, "plain": 40}),
    # On this copying prompt lookup takes most steps; the draft's law is checked in depth by the case above.
    ({}, {"lookup": 40, "draft": 20, "plain": 40}),
], ids=["draft-plain", "all"])
def test_auto_keeps_the_target_law(tiny, proposers: dict[str, bool], mixed: dict[str, int]) -> None:
    """Mixed steps (draft chains with rejection sampling, lookup one-hot, plain) at temperature 1.

    The outcome is the first three tokens: the first comes from a plain step (the first token as soon as
    plain decoding gives it), the next two from steps that speculate; too few for a lookahead step (it needs
    room for its n-grams); auto's lookahead steps are LookaheadWindow.step, whose law tests/test_lossless.py
    checks.
    """
    small = replace(tiny, target=tiny.small_target)
    engine = _engine(small, tiny.small_draft, DeviceCost(flat(), 0.0), n_seq=32)
    try:
        params = replace(PARAMS["plain"], max_tokens=OUTCOME)
        prompt = _copying_prompt(engine)
        law = target_law(engine, prompt, params, OUTCOME)
        options = StrategyOptions(auto=AutoConfig(explore_budget=0.2, **proposers),
                                  lookup=LookupConfig(draft_max=3, ngram_max=2),
                                  lookahead=LookaheadConfig(4, 3, 4, seed_pool_from_prompt=True))
        counts: dict[tuple[int, ...], int] = {}
        choices: Counter[str] = Counter()
        for seed in range(3000):
            engine.auto_states["sampled"].backoff.clear()  # tries on the steady schedule: the draft's steps stay mixed in
            done = run_to_done(engine, "auto", prompt, replace(params, seed=seed), options)
            key = outcome(engine, done, OUTCOME)
            counts[key] = counts.get(key, 0) + 1
            choices.update(done.stats.steps_by_choice)
        assert all(choices[c] > least for c, least in mixed.items()), f"the test must mix steps: {choices}"
        assert sum(choices[c] for c in mixed if c != "plain") > 1000, choices
        assert_target_law(counts, law, alpha=ALPHA)
    finally:
        engine.close()


@pytest.mark.demo
@pytest.mark.parametrize("text", ["Once upon a time, in a small village,", "def fibonacci(n):\n"])
def test_auto_equals_ar_demo(demo_engine: Engine, text: str) -> None:
    """auto's batches follow live timings, and the first prompt's 6th token wins by 0.013 only, less than
    Gemma's batch noise (tests/perf/greedy_margins.py): the answer is ar's, or parts from it at a near-tie."""
    prompt = demo_engine.tokenize(text)
    ref = run_to_done(demo_engine, "ar", prompt, GenParams(max_tokens=48))
    for _ in range(2):
        got = run_to_done(demo_engine, "auto", prompt, GenParams(max_tokens=48))
        assert_greedy_agrees(demo_engine, prompt, ref.tokens, got.tokens, "auto", DEMO_NOISE)


def test_run_needs_no_draft_by_default(tiny) -> None:
    """`specchat run "..." -m model.gguf` just works: the default is auto, which needs no draft model."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "app", "run", "the cat sat", "-m", str(tiny.target), "-t", "1",
                        "-n", "24", "--temp", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    done = lines[-1]
    assert done["stats"]["strategy"] == "auto" and len(done["tokens"]) == 24
    steps = [e for e in lines if e["type"] == "step"]
    assert steps and all(e["choice"] in ("plain", "lookup", "lookahead") for e in steps)
    assert sum(done["stats"]["steps_by_choice"].values()) == len(steps)


def test_auto_keeps_the_target_law_on_the_memorys_trees(tiny, tmp_path: Path) -> None:
    """A memory holding many continuations of the prompt, and rows that cost nothing: auto verifies trees of
    them (several paths per step) at temperature 1, and the law of the first three tokens is the target's
    (chi-square, alpha ALPHA; the first token comes from a plain step)."""
    engine = Engine(EngineConfig(target=tiny.small_target, n_ctx=256, threads=1, n_seq_max=32, cost_cache=Path(""),
                                 memory_dir=tmp_path / "memory"))
    engine._cost = DeviceCost(flat(), 0.0)
    engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
    unchecked(engine)  # rows that cost nothing, whatever this machine's ticks say
    try:
        prompt = [1, 4, 6, 8]
        remember_continuations(engine, [4, 6, 8], seed=2)
        memory = engine.memory()
        assert memory is not None
        memory.frozen = True  # the generations do not add to it: the same trees all along
        params = replace(PARAMS["plain"], max_tokens=OUTCOME)
        law = target_law(engine, prompt, params, OUTCOME)
        options = StrategyOptions(auto=AutoConfig(draft=False, lookahead=False))
        counts: dict[tuple[int, ...], int] = {}
        trees = 0
        for seed in range(3000):
            done = run_to_done(engine, "auto", prompt, replace(params, seed=seed), options)
            key = outcome(engine, done, OUTCOME)
            counts[key] = counts.get(key, 0) + 1
            trees += int(done.stats.extra.get("memory_tree_steps", 0))
        assert trees > 1500, f"the memory's trees were verified ({trees} tree steps)"
        assert_target_law(counts, law, alpha=ALPHA)
    finally:
        engine.close()


def test_a_draft_that_cannot_pay_even_always_right_is_neither_tried_nor_kept_in_step(tiny) -> None:
    """A draft decode as dear as a target step (an F32 draft beside its F32 target): K drafts accepted every
    time give K + 1 tokens for K draft decodes and a batch of K + 1, never more than plain decoding. Such a
    draft is not an option at all: no try, no draft decode, and the draft's cache is not kept in step. Nor is
    one that, always right, would beat plain decoding by under DRAFT_MIN_BEST: 0.97 of a step on a GPU's flat
    curve, at best 1.03x. A cheaper draft on the same curve is tried (the test can fail)."""
    curve = BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16)))
    params = GenParams(max_tokens=96, temperature=0.0)
    for rows, draft_cost, used in ((curve, 1.0, False), (flat(), 0.97, False), (curve, 0.2, True)):
        engine = _engine(tiny, tiny.draft, DeviceCost(rows, draft_cost))
        try:
            done = run_to_done(engine, "auto", engine.tokenize(TINY_PROMPTS[1]), params)
            assert (done.stats.extra["draft_forwards"] > 0) == used, (draft_cost, done.stats.extra)
            assert ("draft" in done.stats.steps_by_choice) == used, done.stats.steps_by_choice
            assert (len(engine.slots[0].draft.tokens) > 0) == used, "kept in step only when it may pay"
        finally:
            engine.close()


def test_the_draft_takes_a_long_prompt_only_where_the_answer_can_repay_it(tiny) -> None:
    """Alone, the draft takes the prompt after the first tokens, so that its tries find it caught up; but a
    long prompt it does not hold, before a short answer, would stall that answer for tries it cannot repay:
    it then stays behind (choose.EAGER_SHARE). The same prompt before a long answer is taken (the test
    can fail either way). Priced: a plain step 10 ms, a draft decode 2 ms, a caught-up token 0.3 ms
    (CATCH_UP_PRIOR); 5% of 8 tokens' plain time is 4 ms, of 256 tokens' 128 ms."""
    curve = BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16)))
    for max_tokens, taken in ((8, False), (256, True)):
        engine = _engine(tiny, tiny.draft, DeviceCost(curve, 0.2))
        try:
            prompt = engine.tokenize(" ".join(TINY_PROMPTS * 40))[:300]  # a catch-up of 0.09 s, priced
            done = run_to_done(engine, "auto", prompt, GenParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))
            assert done.reason == "length", done
            held = len(engine.slots[0].draft.tokens)
            assert (held >= len(prompt) - 1) == taken, (max_tokens, held, len(prompt))
        finally:
            engine.close()


def test_an_early_try_of_the_draft_waits_for_an_answer_that_can_repay_its_catch_up(tiny) -> None:
    """An early try of the draft catches it up on what it missed, here a 60-token prompt it did not take (a short
    answer cannot afford it); before a short answer that catch-up is not paid for a try either (on the AMX VM at
    -t 1, such tries cost 0.33 s each, seven plain steps, and left `auto` at 0.94x `ar`). Before a long answer
    the draft takes the prompt and is tried. Priced as the test above: a caught-up token 0.3 ms, 60 of them
    18 ms, against 5% of 7 plain steps (3.5 ms) and of 255 (128 ms). Fails either way."""
    curve = BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16)))
    for max_tokens, tried in ((8, False), (256, True)):
        engine = _engine(tiny, tiny.draft, DeviceCost(curve, 0.2))
        try:
            engine.auto_states["greedy"].since["draft"] = 10 * MIN_EXPLORE_INTERVAL  # due now
            prompt = engine.tokenize(" ".join(TINY_PROMPTS * 10))[:60]
            done = run_to_done(engine, "auto", prompt, GenParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))
            assert done.reason == "length", done
            assert ("draft" in done.stats.steps_by_choice) == tried, (max_tokens, done.stats.steps_by_choice)
        finally:
            engine.close()
