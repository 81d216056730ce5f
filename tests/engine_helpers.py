"""Running a strategy to the end and checking the event stream's invariants on the way."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from app.bench.greedy import choice_gap, first_difference, greedy_gaps, top2_gap
from backends.engine import Engine
from backends.config import StrategyOptions
from backends.events import REJECTED, Done, Prefilled, StepEnd, Token
from backends.grammar import Grammar
from backends.sampling import GenParams

# llama.cpp's arithmetic is not batch-invariant: the same row's logits move by up to 0.014 on the tiny models
# when it shares a batch with three other sequences (measured: alone vs slot 0 of a 4-slot batch, 4 prompts x
# 9 positions). A greedy choice whose top-2 gap is under twice that may flip under load.
BATCH_NOISE = 0.03
# The same on the demo models, F32 both: a row decoded alone against the same row in one batch with the rest of
# a 48- or 64-token answer, the largest logit difference was 0.044 on Gemma 3 270M and 0.051 on SmolLM2-135M-Instruct
# (tests/perf/greedy_margins.py --noise, 5 prompts). Twice the larger.
DEMO_NOISE = 0.1


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


def split_output(events: list) -> tuple[list[Token], Done]:
    """A thinking model's events, checked: one Prefilled first, a Done last, the output's tokens handed on, and the
    answer's and the reasoning's pieces each making their whole. Returns the output's tokens and the Done."""
    done = events[-1]
    assert isinstance(done, Done) and isinstance(events[0], Prefilled)
    assert sum(isinstance(e, Prefilled) for e in events) == 1
    tokens = [e for e in events if isinstance(e, Token) and e.kind != REJECTED]
    assert [t.id for t in tokens] == list(done.tokens), "the output is the tokens handed on"
    assert "".join(t.text for t in tokens) + done.tail == done.text, "the answer's pieces make the whole"
    assert "".join(t.reasoning for t in tokens) == done.reasoning, "the reasoning's pieces make the whole"
    return tokens, done


def near_tie(gaps: Sequence[float], noise: float = BATCH_NOISE) -> int:
    """How many of an answer's first tokens are chosen by more than `noise` (the index of the first near-tie,
    where another batch shape may rightly choose otherwise; the whole answer when there is none)."""
    return next((i for i, gap in enumerate(gaps) if gap <= noise), len(gaps))


def min_greedy_gap(engine: Engine, prompt: list[int], n: int) -> float:
    """The smallest top-2 gap along the target's greedy path of n tokens: above BATCH_NOISE, batching cannot
    change the greedy text."""
    out = run_to_done(engine, "ar", prompt, GenParams(max_tokens=n)).tokens
    return min(greedy_gaps(engine, prompt, out))


def assert_greedy_agrees(engine: Engine, prompt: list[int], want: Sequence[int], got: Sequence[int],
                         what: str = "", noise: float = BATCH_NOISE, grammar: Grammar | None = None) -> None:
    """`got` is `want` (a greedy answer to `prompt`) token for token, or parts from it only at a near-tie: where
    `want`'s token wins by less than `noise` (among what `grammar` allows, for an answer under one), another
    batch shape (a verification batch, a batch shared with other sequences) may rightly choose another token,
    and what follows is another answer. A token changed anywhere else fails, as does an answer cut short or run
    on where `want`'s choice was no close call. `what` names the run in the message."""
    want, got = tuple(want), tuple(got)
    if got == want:
        return
    i = first_difference(want, got)
    assert i is not None
    gap = choice_gap(engine, list(prompt), want, i, grammar)
    assert gap < noise, (f"{what}: parts from the greedy answer at output token {i} of {len(want)} "
                         f"({want[i:i + 1]} vs {got[i:i + 1]}), where its choice wins by {gap:.5f}")
    print(f"{what}: parts from the greedy answer at a near-tie, output token {i} (its choice wins by {gap:.5f})")


def assert_strategy_greedy(engine: Engine, strategy: str, prompt: list[int], want: Sequence[int], got: Sequence[int],
                           what: str = "", noise: float = BATCH_NOISE) -> None:
    """A strategy's greedy answer `got` against `ar`'s `want`: token for token, but for `auto`, whose batches follow
    live timings, so it may part from it only at a near-tie (assert_greedy_agrees, within `noise`)."""
    if strategy == "auto":
        assert_greedy_agrees(engine, prompt, want, got, f"auto {what}", noise)
    else:
        assert tuple(got) == tuple(want), f"{strategy} {what} differs from ar"


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
            i = first_difference(done.tokens, want)
            divergences.append((strategy, i, top2_gap(alone, prompt + list(want[:i]))))
            print(f"divergence: {strategy} at output token {i}, top-2 logit gap alone {divergences[-1][2]:.5f}")
    return divergences
