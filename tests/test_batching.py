"""Many sequences in one batch (backends.scheduler, backends.slot_pool) on real llama.cpp.

- At temperature 0 every request of a mixed batch (every strategy) gives the
  text it gives alone, or diverges only where the target's top two logits
  (computed alone) are closer than llama.cpp's batch noise: its arithmetic is
  not batch-invariant (a row's sums depend on the batch's shape), so a near-tie
  may flip. Every divergence is printed with its logit gap.
- Sampling under load keeps the target's law (chi-square, alpha as in
  stats_helpers), for sps and tree with other sequences in each batch.
- A long prompt is decoded in chunks between the running sequences' steps:
  each running sequence gets a token in every step while it prefills.
- A cancelled or failing request ends alone; the slots' caches leak no cells.
"""

from __future__ import annotations

import pytest

from backends.config import AutoConfig, LookaheadConfig, LookupConfig, SpsConfig, StrategyOptions, TreeConfig
from backends.device_cost import DeviceCost
from backends.engine import Engine, EngineConfig
from backends.errors import PromptError
from backends.events import Done, Event, StepEnd, Token
from backends.sampling import GenParams
from backends.slot_pool import SlotPool
from backends.strategies.auto.choose import TRYING
from backends.strategies.auto.state import AutoState
from auto_helpers import steep
from engine_helpers import BATCH_NOISE, divergences_from_alone
from stats_helpers import ALPHA, assert_target_law, outcome, target_law
from test_lossless import PROMPT, PARAMS

STRATEGIES = ["ar", "sps", "lookup", "lookahead", "tree", "auto", "sps", "ar"]
OPTIONS = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0), lookahead=LookaheadConfig(3, 3, 3),
                          lookup=LookupConfig(draft_max=4), tree=TreeConfig(3, 2, 6))
TEXTS = ["the cat sat on the mat", "once upon a time there was", "def hello world return print",
         "the big red dog ran to the house", "a b c a b c a b", "hello world hello world hello",
         "print the cat", "once the dog sat"]


def _engine(files, parallel: int, n_ctx: int = 512, draft=None) -> Engine:
    return Engine(EngineConfig(target=files.target, draft=draft or files.draft, n_ctx=n_ctx, threads=1,
                               n_seq_max=16, n_parallel=parallel, cost_cache=None))


@pytest.fixture(scope="module")
def pooled(tiny) -> Engine:
    engine = _engine(tiny, 4)
    yield engine
    engine.close()


def _collect(pool: SlotPool, jobs: list[tuple[str, list[int], GenParams]],
             options: StrategyOptions = OPTIONS) -> list[list[Event]]:
    """Run every job through the pool, admitted in order as slots free; each job's events."""
    events: list[list[Event]] = [[] for _ in jobs]
    queue = list(range(len(jobs)))
    while queue or len(pool):
        while queue and pool.free:
            i = queue.pop(0)
            strategy, prompt, params = jobs[i]
            pool.admit(strategy, options, prompt, params, events[i].append)
        pool.step()
    return events


def _leaks(engine: Engine) -> list[str]:
    """Cells a slot holds beyond its record: the main branch exactly its tokens, and no scratch sequence a
    position past it (lookahead's and tree's scratch sequences share the main branch's cells between steps:
    the same cells under several ids; a draft or window cell left behind would lie past the main branch)."""
    out = []
    for n, slot in enumerate(engine.slots):
        for seq in (slot.target, slot.draft):
            if seq is None:
                continue
            if seq.cells() != len(seq.tokens):
                out.append(f"slot {n}: main sequence ends at {seq.cells()} for {len(seq.tokens)} tokens")
            for s in range(1, seq.n_seq_max):
                if seq.ctx.pos_max(seq.base + s) >= len(seq.tokens):
                    out.append(f"slot {n}: scratch sequence {s} holds cells past the main branch")
    return out


def test_a_mixed_batch_gives_each_request_its_text_alone(tiny, pooled: Engine) -> None:
    params = GenParams(max_tokens=40, temperature=0.0)
    prompts = [pooled.tokenize(t) for t in TEXTS]
    jobs = [(s, p, params) for s, p in zip(STRATEGIES, prompts)]
    got = _collect(SlotPool(pooled), jobs)
    alone_engine = _engine(tiny, 1)
    try:
        divergences = divergences_from_alone(alone_engine, jobs, got)
        assert all(gap < BATCH_NOISE for _, _, gap in divergences), divergences
        assert len(divergences) <= 2, f"more near-ties than batch noise explains: {divergences}"
        assert sum(e.drafted for ev in got for e in ev if isinstance(e, StepEnd)) > 0, "speculation ran"
    finally:
        alone_engine.close()
    assert not _leaks(pooled), _leaks(pooled)


def test_a_long_prompt_is_decoded_in_chunks_between_the_running_steps(tiny) -> None:
    engine = _engine(tiny, 4, n_ctx=2048)
    try:
        pool = SlotPool(engine)
        chunk = engine.target_lane.chunk
        running: list[list[Event]] = [[], []]
        for i, events in enumerate(running):
            pool.admit("ar", OPTIONS, engine.tokenize(TEXTS[i]), GenParams(max_tokens=400), events.append)
        for _ in range(3):
            pool.step()
        long_prompt = engine.tokenize(" ".join(TEXTS * 40))[:1500]
        assert len(long_prompt) > 4 * chunk
        late: list[Event] = []
        pool.admit("ar", OPTIONS, long_prompt, GenParams(max_tokens=4), late.append)
        before = [sum(isinstance(e, StepEnd) for e in ev) for ev in running]
        steps = 0
        while not late:  # until the long prompt's Prefilled
            pool.step()
            steps += 1
        after = [sum(isinstance(e, StepEnd) for e in ev) for ev in running]
        assert steps >= len(long_prompt) // chunk, "the prompt went in chunks, one per step"
        assert all(a - b >= steps - 1 for a, b in zip(after, before)), \
            f"each running sequence got a token in every step of the prefill: {before} -> {after} in {steps}"
        pool.run()
    finally:
        engine.close()


def test_a_cancelled_or_refused_request_ends_alone(tiny, pooled: Engine) -> None:
    pool = SlotPool(pooled)
    params = GenParams(max_tokens=30, temperature=0.0)
    cancel = {"now": False}
    events: list[list[Event]] = [[], [], []]
    pool.admit("sps", OPTIONS, pooled.tokenize(TEXTS[0]), params, events[0].append)
    pool.admit("lookahead", OPTIONS, pooled.tokenize(TEXTS[1]), GenParams(max_tokens=4000), events[1].append,
               should_stop=lambda: cancel["now"])
    pool.admit("auto", OPTIONS, pooled.tokenize(TEXTS[2]), params, events[2].append)
    with pytest.raises(PromptError):
        pool.admit("ar", OPTIONS, [1] * 600, params, lambda _e: None)  # longer than a slot's context
    for _ in range(5):
        pool.step()
    cancel["now"] = True
    pool.run()
    reasons = [ev[-1].reason for ev in events]  # type: ignore[union-attr]
    assert reasons[1] == "cancelled" and reasons[0] in ("length", "eos") and reasons[2] in ("length", "eos")
    assert sorted(pool.free) == [0, 1, 2, 3]
    assert not _leaks(pooled), _leaks(pooled)


@pytest.mark.parametrize("strategy", ["sps", "tree"])
def test_sampling_under_load_keeps_the_target_law(tiny, strategy: str) -> None:
    """Four sequences per batch, each sampling with its own seed: the first two tokens' law is the target's."""
    engine = Engine(EngineConfig(target=tiny.small_target, draft=tiny.small_draft, n_ctx=256, threads=1,
                                 n_seq_max=16, n_parallel=4, cost_cache=None))
    try:
        params = PARAMS["plain"]
        law = target_law(engine, PROMPT, params)
        options = StrategyOptions(sps=SpsConfig(draft_max=3, p_min=0.0, adaptive=False),
                                  tree=TreeConfig(2, 2, 4))
        runs = 2000
        jobs = [(strategy, PROMPT, GenParams(**{**params.__dict__, "seed": seed})) for seed in range(runs)]
        counts: dict[tuple[int, ...], int] = {}
        accepted = 0
        for events in _collect(SlotPool(engine), jobs, options):
            done = events[-1]
            assert isinstance(done, Done) and done.reason != "error", done
            key = outcome(engine, done)
            counts[key] = counts.get(key, 0) + 1
            accepted += done.stats.accepted
        assert accepted > runs // 10, "the drafts were accepted often enough to matter"
        assert_target_law(counts, law, alpha=ALPHA, what="output law under load differs from the target's")
    finally:
        engine.close()


def test_tokens_stream_per_request(tiny, pooled: Engine) -> None:
    """Each request's stream keeps the event contract: output = its non-rejected tokens, one Done at the end."""
    params = GenParams(max_tokens=24, temperature=0.7, seed=3)
    jobs = [(s, pooled.tokenize(t), params) for s, t in zip(STRATEGIES, TEXTS)]
    for events in _collect(SlotPool(pooled), jobs):
        done = events[-1]
        assert isinstance(done, Done) and sum(isinstance(e, Done) for e in events) == 1
        out = [e for e in events if isinstance(e, Token) and e.kind != "rejected"]
        assert tuple(e.id for e in out) == done.tokens
        assert "".join(e.text for e in out) + done.tail == done.text
        assert sum(isinstance(e, StepEnd) for e in events) == done.stats.target_forwards


def test_beside_other_sequences_auto_makes_no_early_tries(tiny) -> None:
    """Alone, a new engine tries the draft within its first steps (early tries on a larger budget: the draft
    holds the prompt by then). Beside others a try makes the whole batch wait for what it drafts and for the
    draft catching up on the conversation, so every try there is a steady one, paid in full from the 1% budget:
    none in three requests' first 120 steps. The device is synthetic (each row as dear as a step, a draft
    decode half a step), so the draft is tried, never chosen on its estimate, whatever the test machine's load."""
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=512, threads=1, n_seq_max=8,
                                 n_parallel=3, cost_cache=None))
    engine._cost = DeviceCost(steep(), 0.5)
    options = StrategyOptions(memory=False, auto=AutoConfig(lookahead=False))
    params = GenParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [engine.tokenize(t) for t in TEXTS[:3]]

    def tries(jobs: int) -> int:
        engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
        pool = SlotPool(engine)
        events: list[list[Event]] = [[] for _ in range(jobs)]
        for i in range(jobs):
            pool.admit("auto", options, prompts[i], params, events[i].append)
        while len(pool):
            pool.step()
        return sum(1 for e in sum(events, []) if isinstance(e, StepEnd) and e.why.endswith(TRYING))

    try:
        assert tries(1) > 0, "alone, a new engine tries the draft early"
        assert tries(3) == 0, "beside others, no early tries"
    finally:
        engine.close()
