"""What the `auto` tests share: engines on a synthetic device, and a generation asked for its decisions."""

from __future__ import annotations

from pathlib import Path

from backends.config import AutoConfig, StrategyOptions
from backends.device_cost import BatchCost, DeviceCost
from backends.engine import Engine, EngineConfig
from backends.events import Event
from backends.realised import Realised
from backends.sampling import GenParams
from backends.slot_pool import SlotPool
from backends.steps import run_now
from backends.strategies.auto import AutoDecoding
from backends.strategies.auto.generation import Generation
from backends.strategies.auto.state import AutoState


TINY_PROMPTS = ["the cat sat on the mat", "once upon a time there was", "def hello world return print"]
NO_EXPLORING = StrategyOptions(auto=AutoConfig(explore_budget=0.0))


def flat(k_max: int = 16) -> BatchCost:
    return BatchCost(tuple(0.01 for _ in range(k_max)))


def steep(k_max: int = 16) -> BatchCost:
    return BatchCost(tuple(0.01 * k for k in range(1, k_max + 1)))


class Unchecked(Realised):
    """A realised record that never holds speculation back. On the tests' tiny models a decode takes a few hundred
    microseconds and the host's work around it dwarfs what a chain saves, so the realised check (backends.realised),
    which times every tick alone as under load, rightly holds `auto` to plain decoding within a few dozen ticks:
    tests of what `auto` decides, and of its drafters' paths, run without it."""

    def allows(self, sequences: int) -> bool:
        return True


def recorded(engine: Engine, record: Realised) -> Engine:
    """`engine` with `record` as its realised record: every scheduler's on it, a generation's alone included
    (backends.slot.Learnt.realised_for hands it out)."""
    engine.learnt._realised = record
    return engine


def unchecked(engine: Engine) -> Engine:
    """`engine` with its realised record never holding back."""
    return recorded(engine, Unchecked())


def synthetic_engine(tiny_files, draft: Path | None, cost: DeviceCost | None, n_seq: int = 8) -> Engine:
    """An engine on a synthetic device: `cost` is what Engine.device_cost hands out, and auto keeps its times
    (it learns acceptance only) and is not held back by what its ticks realise (`unchecked`; a test of the check
    passes a record of its own to `pool_run`), so its decisions do not depend on how busy the test machine is."""
    engine = Engine(EngineConfig(target=tiny_files.target, draft=draft, n_ctx=1024, threads=1, n_seq_max=n_seq,
                                 cost_cache=Path("")))
    engine._cost = cost
    if cost is not None:
        engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
        unchecked(engine)
    return engine


def prefilled(engine: Engine, options: StrategyOptions = StrategyOptions(), prompt: list[int] | None = None,
               max_tokens: int = 64) -> Generation:
    """One generation of auto on the engine's first slot, its prompt decoded, to ask its decisions directly; the
    draft holds the prompt too, as it does (alone) once the first step handed its tokens on."""
    prompt = engine.tokenize(TINY_PROMPTS[0]) if prompt is None else prompt
    gen = Generation(AutoDecoding(engine.slots[0], options), prompt, GenParams(max_tokens=max_tokens))
    run_now(gen.prefill())
    if gen.draft is not None:
        run_now(gen.draft.syncing(prompt[:-1], logits=False))
    return gen


def pool_run(engine: Engine, jobs: list[tuple[str, list[int]]], params: GenParams,
             options: StrategyOptions = StrategyOptions(memory=False), realised: Realised | None = None
             ) -> tuple[SlotPool, list[list[Event]]]:
    """Admit each (strategy, prompt) to a new slot pool on `engine` and step it until all are done (with
    `realised` as its scheduler's record): the pool, and each job's events."""
    pool = SlotPool(engine)
    if realised is not None:
        pool.scheduler.load.realised = realised
    events: list[list[Event]] = [[] for _ in jobs]
    for i, (strategy, prompt) in enumerate(jobs):
        pool.admit(strategy, options, prompt, params, events[i].append)
    while len(pool):
        pool.step()
    return pool, events
