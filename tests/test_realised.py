"""The check on what speculation delivers (backends.realised): its rule on synthetic ticks (pure logic), the
scheduler's record of real ticks on real llama.cpp, and `auto` held to plain decoding where the record says
speculation does not pay."""

from __future__ import annotations

from pathlib import Path

from backends.config import AutoConfig, StrategyOptions
from backends.device_cost import BatchCost, DeviceCost
from backends.engine import Engine, EngineConfig
from backends.events import Event, StepEnd
from backends.realised import MIN_SPECULATED, PLAIN_EVERY, STALE, Realised
from backends.sampling import GenParams
from backends.slot_pool import SlotPool
from backends.strategies.auto.state import AutoState
from test_lossless import _copying_prompt


def _ticks(realised: Realised, n: int, sequences: int, speculated: bool, tokens: int, seconds: float) -> None:
    for _ in range(n):
        realised.add(sequences, speculated, tokens, seconds)
        realised.tick += 1


def test_speculation_is_held_back_where_its_ticks_deliver_less_than_plain_ones() -> None:
    r = Realised()
    assert r.pays(2) is None and r.allows(2), "no evidence: the cost model decides"
    _ticks(r, 20, 2, False, 2, 0.02)  # 100 tok/s plain
    _ticks(r, 4, 2, True, 3, 0.04)  # 75 tok/s speculating, but too few ticks to judge
    assert r.pays(2) is None and r.allows(2)
    _ticks(r, 20, 2, True, 3, 0.04)
    assert r.pays(2) is False
    assert not r.allows(2), "held back at this batch size"
    assert r.allows(4) and r.pays(1) is None, "another batch size has its own evidence"
    _ticks(r, 20, 4, False, 4, 0.02)  # 200 tok/s plain at 4
    _ticks(r, 20, 4, True, 6, 0.02)  # 300 tok/s speculating at 4
    assert r.pays(4) is True and r.allows(4)


def test_held_back_speculation_is_probed_and_resumes_when_the_machine_changes() -> None:
    r = Realised()
    _ticks(r, 30, 1, False, 1, 0.02)
    _ticks(r, 30, 1, True, 1, 0.03)  # speculation loses
    assert r.pays(1) is False
    allowed = []
    for _ in range(3 * STALE):  # plain ticks only, as when every sequence is held back
        allowed.append(r.allows(1))
        r.add(1, False, 1, 0.02)
        r.tick += 1
    probes = [i for i, a in enumerate(allowed) if a]
    assert probes and len(probes) <= 3, f"a probe per {STALE} stale ticks at most: {probes}"
    # The machine changed: a probe's speculating tick now delivers twice the plain rate. Stale evidence
    # weighs a quarter, so after the probe speculation is free again until there is evidence to judge.
    r.add(1, True, 4, 0.02)
    r.tick += 1
    assert r.pays(1) is None and r.allows(1)
    _ticks(r, int(MIN_SPECULATED) + 2, 1, True, 4, 0.02)
    assert r.pays(1) is True


def test_where_everyone_speculates_a_bounded_share_of_ticks_is_plain() -> None:
    r = Realised()
    plain_ticks = 0
    for _ in range(20 * PLAIN_EVERY):
        speculate = r.allows(3)
        plain_ticks += not speculate
        r.add(3, speculate, 3 if speculate else 1, 0.02)
        r.tick += 1
    assert 10 <= plain_ticks <= 21, f"one plain tick per {PLAIN_EVERY} keeps the plain rate current: {plain_ticks}"
    assert r.pays(3) is True


def _pool_run(engine: Engine, jobs: list[tuple[str, list[int]]], params: GenParams,
              options: StrategyOptions = StrategyOptions(memory=False), realised: Realised | None = None
              ) -> tuple[SlotPool, list[list[Event]]]:
    pool = SlotPool(engine)
    if realised is not None:
        pool.scheduler.load.realised = realised
    events: list[list[Event]] = [[] for _ in jobs]
    for i, (strategy, prompt) in enumerate(jobs):
        pool.admit(strategy, options, prompt, params, events[i].append)
    while len(pool):
        pool.step()
    return pool, events


def test_the_scheduler_records_plain_and_speculating_ticks_but_not_prompt_chunks(tiny) -> None:
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1, n_seq_max=8,
                                 n_parallel=2, cost_cache=Path("")))
    try:
        prompts = [engine.tokenize("the cat sat on the mat"), engine.tokenize("once upon a time there was")]
        params = GenParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        pool, _ = _pool_run(engine, [("ar", p) for p in prompts], params)
        realised = pool.scheduler.load.realised
        counted = sum(r.count for r in realised.plain.values())
        assert not realised.speculated and counted > 0, "plain decoding: plain ticks only"
        assert set(realised.plain) <= {1, 2} and realised.plain[2].rate > 0
        assert realised.tick == pool.scheduler.ticks and round(counted) < pool.scheduler.ticks, \
            "the prompt's ticks are not counted"
        pool, _ = _pool_run(engine, [("sps", p) for p in prompts], params)
        realised = pool.scheduler.load.realised
        assert realised.speculated and realised.speculated[2].tokens > realised.speculated[2].count, \
            "sps speculates: more than a token per tick"
    finally:
        engine.close()


def test_auto_decodes_plainly_where_speculation_was_found_not_to_pay(tiny) -> None:
    """A cost model that makes every row look free, and a copying prompt: auto verifies lookups at once. With
    the record saying speculating ticks delivered less at this batch size, every step is plain; the output
    is the same."""
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=512, threads=1, n_seq_max=8, cost_cache=Path("")))
    engine._cost = DeviceCost(BatchCost(tuple(0.01 for _ in range(16))), 0.0)
    options = StrategyOptions(memory=False, auto=AutoConfig(draft=False, lookahead=False, explore_budget=0.0))
    params = GenParams(max_tokens=40, temperature=0.0)
    try:
        prompt = _copying_prompt(engine)

        def choices(realised: Realised | None) -> tuple[set[str], tuple[int, ...]]:
            engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
            _, (events,) = _pool_run(engine, [("auto", prompt)], params, options, realised)
            return {e.choice for e in events if isinstance(e, StepEnd)}, events[-1].tokens  # type: ignore[attr-defined]

        free, tokens = choices(None)
        assert "lookup" in free, f"with no record, the cost model speculates: {free}"
        losing = Realised()
        _ticks(losing, 20, 1, False, 1, 0.01)
        _ticks(losing, 20, 1, True, 1, 0.02)
        held, held_tokens = choices(losing)
        assert held == {"plain"}, held
        assert held_tokens == tokens
    finally:
        engine.close()
