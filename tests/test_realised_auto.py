"""`auto`'s side of the realised check (backends.realised) on real llama.cpp: what its sequences report (the
draft's switches, the ticks of options still being learnt, the ticks they decided) and `auto` held to plain
decoding where the record says speculation does not pay."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.config import AutoConfig, StrategyOptions
from backends.device_cost import BatchCost, DeviceCost
from backends.engine import Engine, EngineConfig
from backends.events import Done, Prefilled, StepEnd, Token
from backends.kv import common_prefix
from backends.realised import Realised
from backends.sampling import GenParams
from backends.scheduler import Scheduler, run_alone
from backends.steps import PAUSE
from backends.strategies.auto import AutoDecoding
from backends.strategies.auto.choose import HELD_BACK, TRYING
from backends.strategies.auto.decide import DRAFT, SETTLE_STEPS
from backends.strategies.auto.generation import Generation
from backends.strategies.auto.state import AutoState
from backends.strategies.lookup import NgramIndex
from auto_helpers import Unchecked, pool_run, prefilled, recorded, run_now, synthetic_engine
from test_lossless import _copying_prompt
from test_realised import _ticks


def test_the_draft_taking_its_prompt_alone_is_left_out_of_the_tick_that_paid_it(tiny, monkeypatch) -> None:
    """Real llama.cpp, `auto` alone with a draft and a 300-token prompt: after the first token the draft takes
    the prompt (generation.Generation.step), in the next tick, which reports it as a switch; the tick's time
    includes it (the catch-up ran within that tick). Its target batch verified nothing (no lookups, and draft
    steps measured at half plain decoding's rate): it counts as neither kind, as the decode after the draft's
    prompt ran on caches that prompt took."""
    engine = synthetic_engine(tiny, tiny.draft, DeviceCost(BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16))),
                                                           0.2))  # a draft a fifth of the target's cost
    options = StrategyOptions(memory=False, auto=AutoConfig(lookup=False, lookahead=False, explore_budget=0.0))
    state = engine.auto_states["greedy"]
    state.draft_step_tokens.add(1.0)  # in plain steps: still to be tried early, so in use, but not taken
    state.draft_step_cost.add(2.0)
    switches: list[tuple[int, float]] = []
    ticks: dict[int, tuple[float, float, bool, str]] = {}  # tick: (its time, its catch-ups, verified, counted as)
    switching, add = Realised.switching, Realised.add

    def spy_switching(self: Realised, seconds: float) -> None:
        switches.append((self.tick, seconds))
        switching(self, seconds)

    def spy_add(self: Realised, sequences: int, speculated: bool, tokens: int, seconds: float,
                decode: float = 0.0, verified: bool = True) -> str:
        caught_up = self._switching
        kind = add(self, sequences, speculated, tokens, seconds, decode, verified=verified)
        ticks[self.tick] = (seconds, caught_up, verified, kind)
        return kind

    monkeypatch.setattr(Realised, "switching", spy_switching)
    monkeypatch.setattr(Realised, "add", spy_add)
    try:
        prompt = engine.tokenize(" ".join(["the cat sat on the mat and once upon a time there was"] * 40))[:300]
        # (an answer of 256 tokens repays the catch-up: choose.EAGER_SHARE, as in test_auto)
        pool, _ = pool_run(engine, [("auto", prompt)], GenParams(max_tokens=256, temperature=0.0, ignore_eos=True),
                           options)
        assert len(engine.slots[0].draft.tokens) >= len(prompt) - 1, "the draft took the prompt"
        assert switches, "reported as a switch"
        tick, seconds = switches[0]
        assert tick <= 3 and seconds > 0, switches
        assert ticks[tick][1] == seconds and ticks[tick][0] > seconds, "within the tick that reported it"
        assert not ticks[tick][2] and ticks[tick][3] == "switch", ticks[tick]
        assert pool.scheduler.load.realised.decided, "the ticks after it count"
    finally:
        engine.close()


def test_the_share_of_a_catch_up_that_a_hold_back_caused_is_the_checks_switch_the_rest_counts(tiny) -> None:
    """Real llama.cpp: the draft lags 301 tokens behind the context. Of its catch-up, the share decoded while the
    realised check held speculation back is left out of the tick (`switching`); the share decoded by `auto`'s own
    plain and lookup steps recurs where it alternates, and counts."""
    engine = synthetic_engine(tiny, tiny.draft, DeviceCost(BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16))),
                                                           0.001))  # a draft decode priced at 10 us: all catch-up
    try:
        for held, share in ((0, 0.0), (150, 0.5), (400, 1.0)):
            gen = prefilled(engine, max_tokens=256)
            gen.slot.load.realised = realised = Realised()
            gen.run.context.extend([gen.run.context[-1]] * 300)  # decoded while the draft stood by
            gen.held_tokens = held
            run_now(gen.draft_chain(2, explore=False))
            assert gen.catch_up > 0 and gen.held_tokens == 0
            assert realised._switching == pytest.approx(share * gen.catch_up), held
            engine.slots[0].reset()
    finally:
        engine.close()


def _free_rows(tiny) -> tuple[Engine, StrategyOptions, GenParams]:
    """An engine whose cost model makes every row look free (so `auto` verifies any lookup it finds), `auto`
    with lookup alone and no exploration, and 40 greedy tokens."""
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=512, threads=1, n_seq_max=8, cost_cache=Path("")))
    engine._cost = DeviceCost(BatchCost(tuple(0.01 for _ in range(16))), 0.0)
    options = StrategyOptions(memory=False, auto=AutoConfig(draft=False, lookahead=False, explore_budget=0.0))
    return engine, options, GenParams(max_tokens=40, temperature=0.0)


def test_auto_decodes_plainly_where_speculation_was_found_not_to_pay(tiny) -> None:
    """A cost model that makes every row look free, and a copying prompt: auto verifies lookups at once. With
    the record saying speculating ticks delivered less at this batch size, every step is plain; the output
    is the same."""
    engine, options, params = _free_rows(tiny)
    try:
        prompt = _copying_prompt(engine)

        def choices(realised: Realised | None) -> tuple[set[str], tuple[int, ...]]:
            engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
            _, (events,) = pool_run(engine, [("auto", prompt)], params, options, realised)
            return {e.choice for e in events if isinstance(e, StepEnd)}, events[-1].tokens  # type: ignore[attr-defined]

        free, tokens = choices(None)
        assert "lookup" in free, f"with no record, the cost model speculates: {free}"
        losing = Realised()
        _ticks(losing, 20, 1, False, 1, 0.01)
        _ticks(losing, 20, 1, True, 1, 0.02)
        looked_up: list[int] = []
        propose = NgramIndex.propose_with_match
        NgramIndex.propose_with_match = lambda self, *a: looked_up.append(1) or propose(self, *a)  # type: ignore
        try:
            held, held_tokens = choices(losing)
        finally:
            NgramIndex.propose_with_match = propose  # type: ignore[method-assign]
        assert held == {"plain"}, held
        assert held_tokens == tokens
        assert not looked_up, "held back, a step looks no proposals up"
        assert losing.plain[1].last_tick > 40 and losing.speculated[1].last_tick == 39, \
            "held back, nobody decides: its ticks are plain evidence"
    finally:
        engine.close()


def test_a_held_back_step_keeps_the_exploration_schedule_and_learns_its_time_alone(tiny) -> None:
    """Held back, a step is `ar`'s (Generation._held_back) yet still counts for the exploration schedule (each
    option's steps since it was taken), is counted as plain, and alone teaches the plain step's time and the
    rate reached, as the general path's plain steps do; every step after the first says why it was plain."""
    engine, options, params = _free_rows(tiny)
    try:
        prompt = _copying_prompt(engine)
        state = AutoState(learn_timing=True)
        engine.auto_states = {"greedy": state, "sampled": AutoState(learn_timing=True)}
        losing = Realised()
        _ticks(losing, 20, 1, False, 1, 0.01)
        _ticks(losing, 20, 1, True, 1, 0.02)
        _, (events,) = pool_run(engine, [("auto", prompt)], params, options, losing)
        ends = [e for e in events if isinstance(e, StepEnd)]
        assert len(ends) == 40 and {e.choice for e in ends} == {"plain"}
        assert {e.why for e in ends[1:]} == {HELD_BACK}, "every step after the first was held back"
        assert state.taken == {"plain": 40}, state.taken
        assert state.since["lookup"] == 40 and state.since["draft"] == 40, state.since
        assert state.t_plain.n >= 40 and state.tokens.n == 40 and state.seconds.n == 40, \
            (state.t_plain.n, state.tokens.n, state.seconds.n)
        assert state.t_plain.value is not None and state.t_plain.value < 0.005, \
            "learnt from the steps, down from the device cost's seed of 10 ms a step"
        assert state.seconds.value is not None and 0 < state.seconds.value < 0.005
    finally:
        engine.close()


def test_ticks_whose_rows_auto_decided_count_with_speculation_even_when_it_chose_plain(tiny) -> None:
    """Real llama.cpp, two `auto` sequences in one batch, a cost model where no chain can pay (a row costs a
    token's time) and no exploration: every step decodes plainly, yet every tick after the first token is
    speculation's evidence (its lookups and pricing are speculation's cost), none plain decoding's."""
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=512, threads=1, n_seq_max=8, n_parallel=2,
                                 cost_cache=Path("")))
    engine._cost = DeviceCost(BatchCost(tuple(0.01 * k for k in range(1, 17))), 0.0)
    options = StrategyOptions(memory=False, auto=AutoConfig(draft=False, lookahead=False, explore_budget=0.0))
    params = GenParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    try:
        engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
        prompts = [_copying_prompt(engine), engine.tokenize("once upon a time there was")]
        # (a record that counts every tick and holds nothing back: what is judged here is how ticks are counted;
        # decided ticks judged against themselves could hold the rest back, which would make them plain evidence)
        pool, events = pool_run(engine, [("auto", p) for p in prompts], params, options, Unchecked())
        assert {e.choice for run in events for e in run if isinstance(e, StepEnd)} == {"plain"}  # type: ignore
        realised = pool.scheduler.load.realised
        assert not realised.plain, f"no plain evidence: {realised.plain}"
        assert realised.decided[2].count > 10, "each bounds the plain rate from below"
        ticks = realised.speculated[2]
        assert ticks.count > 10 and ticks.tokens == pytest.approx(2 * ticks.count, rel=1e-6), \
            "a token a sequence a tick: plain rows, counted with speculation's"
    finally:
        engine.close()




def test_an_options_first_steps_on_an_engine_are_exploration_and_later_ones_are_judged(tiny, monkeypatch) -> None:
    """Real llama.cpp, `auto` with a draft identical to the target (accepted at greedy) on a device where drafting
    pays: a draft step taken while the draft was taken fewer than SETTLE_STEPS times on the engine marks the tick
    its rows run in as exploration's (not counted by the check), later ones do not."""
    engine = synthetic_engine(tiny, tiny.same_draft, DeviceCost(BatchCost(tuple(0.01 * (1 + 0.05 * k)
                                                                                for k in range(16))), 0.1))
    options = StrategyOptions(memory=False, auto=AutoConfig(lookup=False, lookahead=False, explore_budget=0.0))
    state = engine.auto_states["greedy"]
    marked: list[int] = []  # the draft's steps taken before, at each mark
    learning = Realised.learning

    def spy(self: Realised) -> None:
        marked.append(state.taken.get(DRAFT, 0))
        learning(self)

    monkeypatch.setattr(Realised, "learning", spy)
    try:
        state.taken[DRAFT] = SETTLE_STEPS - 3
        params = GenParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        pool, (events,) = pool_run(engine, [("auto", engine.tokenize("the cat sat on the mat"))], params, options)
        drafted = sum(isinstance(e, StepEnd) and e.choice == "draft" for e in events)  # type: ignore[attr-defined]
        assert drafted >= 6, f"the draft pays here: {drafted} draft steps"
        assert marked == [SETTLE_STEPS - 3, SETTLE_STEPS - 2, SETTLE_STEPS - 1], marked
        counted = pool.scheduler.load.realised.speculated[1].count
        assert 0 < counted, "the later draft steps' ticks are judged"
    finally:
        engine.close()


def test_a_try_of_an_option_is_exploration_not_evidence(tiny, monkeypatch) -> None:
    """Real llama.cpp, `auto` with a draft long settled whose steps were measured at half plain decoding's rate, and
    a try of it due: the try's tick is exploration's (a try is of an option the estimates call worse: it loses by
    design), as the ticks of an option still being learnt are, and no other step marks its tick."""
    engine = synthetic_engine(tiny, tiny.draft, DeviceCost(BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16))),
                                                           0.2))
    options = StrategyOptions(memory=False, auto=AutoConfig(lookup=False, lookahead=False, explore_budget=0.2))
    state = engine.auto_states["greedy"]
    state.taken[DRAFT] = 10 * SETTLE_STEPS
    state.since[DRAFT] = 1 << 20  # a try is due
    state.draft_step_tokens.add(1.0)
    state.draft_step_cost.add(2.0)
    marks: list[int] = []
    learning = Realised.learning
    monkeypatch.setattr(Realised, "learning", lambda self: marks.append(self.tick) or learning(self))
    try:
        params = GenParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        _, (events,) = pool_run(engine, [("auto", engine.tokenize("the cat sat on the mat"))], params, options)
        steps = [e for e in events if isinstance(e, StepEnd)]
        tries = sum((e.why or "").endswith(TRYING) for e in steps)
        assert tries >= 1 and any(e.choice == "plain" for e in steps), [e.why for e in steps]
        assert len(marks) == tries, (marks, tries)
    finally:
        engine.close()


def test_a_slot_that_served_another_conversation_has_its_draft_take_the_new_prompt_after_the_first_token(
        tiny, monkeypatch) -> None:
    """Real llama.cpp: the slot's draft holds a 200-token conversation, and a shorter new one comes. The draft
    lags by what it holds of the new context, not by its length (which made the new prompt look decoded: its
    catch-up was priced at nothing and paid by the first draft step, counted as drafting's cost); alone, it takes
    the new prompt once the first token was handed on, reported as a switch."""
    engine = synthetic_engine(tiny, tiny.draft, DeviceCost(BatchCost(tuple(0.01 * (1 + 0.1 * k) for k in range(16))),
                                                           0.2))
    switches: list[int] = []
    switching = Realised.switching
    monkeypatch.setattr(Realised, "switching", lambda self, s: switches.append(self.tick) or switching(self, s))
    params = GenParams(max_tokens=256, temperature=0.0, ignore_eos=True)  # (long enough to repay the catch-up)
    try:
        earlier = engine.tokenize(" ".join(["the cat sat on the mat and once upon a time there was"] * 20))[:200]
        pool_run(engine, [("auto", earlier)], params)
        draft = engine.slots[0].draft
        prompt = engine.tokenize("def hello world return print once upon a time")
        assert len(draft.tokens) > len(prompt) and (held := common_prefix(draft.tokens, prompt)) < 8
        gen = Generation(AutoDecoding(engine.slots[0], StrategyOptions()), prompt, params)
        run_now(gen.prefill())
        assert gen.chooser.lag() == len(prompt) - held, "it holds none of the new prompt but its first tokens"
        switches.clear()
        pool_run(engine, [("auto", prompt)], params, realised=Realised())  # (its ticks counted from 0)
        assert switches and switches[0] <= 3, f"the draft took the new prompt as a switch: {switches}"
        assert common_prefix(draft.tokens, prompt) >= len(prompt) - 1
    finally:
        engine.close()


def test_auto_alone_is_held_back_as_under_load_and_its_ticks_teach_the_engines_record(tiny) -> None:
    """Real llama.cpp, `auto` alone (Strategy.generate, as the chat app and `specchat run` drive it), rows that
    look free and a copying prompt. With the engine's record saying speculating ticks at one sequence delivered
    less, every step is plain and looks nothing up, and the generation's ticks go into that record, counted as
    plain; with a record that never holds back, the same generation verifies lookups. The text is `ar`'s."""
    engine, options, params = _free_rows(tiny)
    try:
        prompt = _copying_prompt(engine)
        want = list(engine.strategy("ar", options).generate(prompt, params))[-1].tokens  # type: ignore[attr-defined]

        def alone(record: Realised) -> tuple[set[str], tuple[int, ...], int]:
            engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
            recorded(engine, record)
            looked_up = []
            propose = NgramIndex.propose_with_match
            NgramIndex.propose_with_match = lambda self, *a: looked_up.append(1) or propose(self, *a)  # type: ignore
            try:
                events = list(engine.strategy("auto", options).generate(prompt, params))
            finally:
                NgramIndex.propose_with_match = propose  # type: ignore[method-assign]
            return {e.choice for e in events if isinstance(e, StepEnd)}, events[-1].tokens, len(looked_up)

        losing = Realised()
        _ticks(losing, 20, 1, False, 1, 0.01)
        _ticks(losing, 20, 1, True, 1, 0.02)
        held, tokens, looked_up = alone(losing)
        assert held == {"plain"} and looked_up == 0, (held, looked_up)
        assert tokens == want
        # (a tick a token, the first with the prompt's decode)
        assert losing.tick == 40 + len(want) and losing.plain[1].last_tick > 40, "counted, as plain evidence"
        assert losing.speculated[1].last_tick == 39
        free, tokens, looked_up = alone(Unchecked())
        assert "lookup" in free and looked_up > 0, free
        assert tokens == want
    finally:
        engine.close()


def test_a_machine_alone_hands_its_events_on_tick_by_tick_raises_what_it_raises_and_is_closed_when_left() -> None:
    """run_alone on step machines that pause (no decode: pure logic): every event in order, a tick's events
    handed on before the next tick runs, the machine's exception raised after its earlier events, and a
    machine left halfway closed (its `finally` runs)."""
    log: list[str] = []

    def machine(n: int, fail: bool = False):
        try:
            for i in range(n):
                log.append(f"step {i}")
                yield Prefilled(i, 0.0)  # any event
                yield PAUSE
            if fail:
                raise ValueError("broken")
        finally:
            log.append("closed")

    got = []
    for event in run_alone(machine(3), Scheduler()):
        got.append(event.n_tokens)  # type: ignore[attr-defined]
        log.append(f"got {event.n_tokens}")  # type: ignore[attr-defined]
    assert got == [0, 1, 2]
    # (a paused machine runs twice a tick, before and after the tick's decode: here none)
    assert log[:5] == ["step 0", "step 1", "got 0", "got 1", "step 2"], "a tick's events before the next tick"
    log.clear()
    events = run_alone(machine(2, fail=True), Scheduler())
    assert next(events).n_tokens == 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="broken"):
        list(events)
    log.clear()
    events = run_alone(machine(5), Scheduler())
    next(events)
    events.close()
    assert log[-1] == "closed" and "step 4" not in log


def test_a_new_machines_first_answer_hands_its_last_tokens_on_before_the_device_is_measured(tiny) -> None:
    """Real llama.cpp: `auto` alone decodes a new machine's first answer plainly and measures the device after it,
    before Done. A scheduler hands a tick's events on when the tick ends, so measured within the last tick, the
    answer's last tokens waited for the measurement (the chat app: 2 s of a stalled answer on SmolLM2). It pauses
    first: every token is with the consumer when the measuring starts, and Done comes after it."""
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=512, threads=1, n_seq_max=8, cost_cache=Path("")))
    try:
        slot = engine.slots[0]
        measure = slot.device_cost
        received: list[object] = []
        tokens_when_measured: list[int] = []

        def measured() -> DeviceCost | None:
            tokens_when_measured.append(sum(1 for e in received if isinstance(e, Token)))
            return measure()

        slot.device_cost = measured
        params = GenParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        options = StrategyOptions(memory=False)
        for event in engine.strategy("auto", options).generate(engine.tokenize("once upon a time there was"), params):
            received.append(event)
        done = received[-1]
        assert isinstance(done, Done) and done.reason == "length" and len(done.tokens) == 12
        assert tokens_when_measured == [12], tokens_when_measured
        ends = [e.last for e in received if isinstance(e, StepEnd)]
        assert ends[-1] and not any(ends[:-1]), "the step that ended the answer says so (StepEnd.last)"
        assert engine.known_device_cost() is not None, "measured, for the next answer"
    finally:
        engine.close()
