"""Running a strategy to the end and checking the event stream's invariants on the way."""

from __future__ import annotations

import numpy as np

from backends.engine import Engine
from backends.config import StrategyOptions
from backends.events import REJECTED, Done, Prefilled, StepEnd, Token
from backends.sampling import GenParams

# llama.cpp's arithmetic is not batch-invariant: the same row's logits move by up to 0.014 on the tiny models
# when it shares a batch with three other sequences (measured: alone vs slot 0 of a 4-slot batch, 4 prompts x
# 9 positions). A greedy choice whose top-2 gap is under twice that may flip under load.
BATCH_NOISE = 0.03


def remember_continuations(engine: Engine, prefix: list[int], seed: int, count: int = 40, length: int = 6) -> None:
    """Fill the engine's speculation memory with `count` earlier texts: `prefix` followed by random tokens
    (a memory with many continuations of a prompt ending in `prefix`, for trees of them)."""
    memory = engine.memory()
    assert memory is not None
    rng = np.random.default_rng(seed)
    for _ in range(count):
        memory.add(prefix + rng.integers(3, engine.target_model.n_vocab, size=length).tolist())


def run_to_done(engine: Engine, strategy: str, prompt: list[int], params: GenParams,
                options: StrategyOptions = StrategyOptions()) -> Done:
    """Generate, assert the event order (Prefilled, Token..., Done) and output invariant, return the Done."""
    events = list(engine.strategy(strategy, options).generate(prompt, params))
    assert isinstance(events[0], Prefilled)
    assert isinstance(events[-1], Done)
    assert sum(isinstance(e, Done) for e in events) == 1
    body = events[1:-1]
    assert not body or isinstance(body[-1], StepEnd), "every step ends with StepEnd"
    done = events[-1]
    assert done.reason != "error", done.error
    out_tokens = [e for e in body if isinstance(e, Token) and e.kind != REJECTED]
    assert tuple(e.id for e in out_tokens) == done.tokens
    assert "".join(e.text for e in out_tokens) + done.tail == done.text
    steps = [e for e in body if isinstance(e, StepEnd)]
    assert len(steps) == done.stats.target_forwards
    return done


def top2_gap(engine: Engine, context: list[int]) -> float:
    """The target's top-2 logit gap after `context`, computed alone (the first slot's caches are emptied)."""
    seq = engine.target
    seq.reset()
    seq.sync(context)
    top2 = np.sort(seq.logits())[-2:]
    seq.reset()
    return float(top2[1] - top2[0])


def min_greedy_gap(engine: Engine, prompt: list[int], n: int) -> float:
    """The smallest top-2 gap along the target's greedy path of n tokens: above BATCH_NOISE, batching cannot
    change the greedy text."""
    out = run_to_done(engine, "ar", prompt, GenParams(max_tokens=n)).tokens
    return min(top2_gap(engine, prompt + list(out[:i])) for i in range(len(out)))


def divergences_from_alone(alone: Engine, jobs: list[tuple[str, list[int], GenParams]],
                           got: list[list]) -> list[tuple[str, int, float]]:
    """Each greedy request's output under load (its events' Done) against `ar` on `alone`, the same prompt by
    itself: (strategy, output token, the top-2 logit gap alone there) for every request that parts from it.
    Every request must have ended by its length or an end token."""
    divergences = []
    for (strategy, prompt, params), events in zip(jobs, got):
        done = events[-1]
        assert isinstance(done, Done) and done.reason in ("length", "eos"), done
        want = run_to_done(alone, "ar", prompt, params).tokens
        if done.tokens != want:
            i = next(i for i, (a, b) in enumerate(zip(done.tokens + (-1,), want + (-1,))) if a != b)
            divergences.append((strategy, i, top2_gap(alone, prompt + list(want[:i]))))
            print(f"divergence: {strategy} at output token {i}, top-2 logit gap alone {divergences[-1][2]:.5f}")
    return divergences
