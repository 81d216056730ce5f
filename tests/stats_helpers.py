"""Exact output laws computed from the target, and the chi-square check against them.

`assert_target_law` is the check of every test that a strategy samples the target's law (outcome counts of
seeded runs against `target_law`); `assert_fits` the same check on arrays (a sampling rule against an exact
distribution). Each test states its significance `alpha` (most use ALPHA: a correct rule fails a check with
that probability; one off by a few percent of mass fails almost surely at the tests' sample sizes)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.stats import chisquare

from backends.engine import Engine
from backends.events import Done
from backends.sampling import GenParams, probabilities

ALPHA = 1e-4


def target_law(engine: Engine, prompt: list[int], params: GenParams, n: int = 2) -> dict[tuple[int, ...], float]:
    """Exact probability of each outcome of the first `n` tokens; an end-of-generation token ends the outcome."""
    seq = engine.target

    def dist(prefix: tuple[int, ...]) -> np.ndarray:
        seq.sync(prompt + list(prefix))
        return probabilities(seq.logits().copy(), params)

    law: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], p: float) -> None:
        probs = dist(prefix)
        for t in np.flatnonzero(probs):
            out, q = prefix + (int(t),), p * probs[t]
            if len(out) == n or engine.target_model.is_eog(int(t)):
                law[out] = q
            else:
                extend(out, q)

    extend((), 1.0)
    return law


def outcome(engine: Engine, done: Done, n: int = 2) -> tuple[int, ...]:
    """The first `n` output tokens, with the end-of-generation token when generation ended before `n`."""
    out = done.tokens[:n]
    if len(out) < n and done.reason == "eos":
        return out + (engine.target_model.eos,)
    return out


def empirical(engine: Engine, strategy: str, prompt: list[int], params: GenParams, runs: int,
              options=None) -> tuple[dict[tuple[int, ...], int], int]:
    """Outcome counts of `runs` generations (seeds 0..runs-1) and the drafts accepted in all."""
    from backends.config import StrategyOptions
    from engine_helpers import run_to_done

    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(runs):
        done = run_to_done(engine, strategy, prompt, GenParams(**{**params.__dict__, "seed": seed}),
                           options or StrategyOptions())
        key = outcome(engine, done)
        counts[key] = counts.get(key, 0) + 1
        accepted += done.stats.accepted
    return counts, accepted


def assert_drafts_keep_the_law(engine: Engine, strategy: str, prompt: list[int], options, min_accepted: int,
                               who: str, runs: int = 3000) -> None:
    """A drafter's chains or trees, rejection-sampled at temperature 1 without truncation: the first two tokens'
    law over `runs` seeded answers is the target's (chi-square at ALPHA), with more than `min_accepted` drafts
    accepted in all, so that the accepting path is what is tested (`who`: the drafter, for the message)."""
    params = GenParams(max_tokens=2, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    law = target_law(engine, prompt, params)
    counts, accepted = empirical(engine, strategy, prompt, params, runs, options)
    assert accepted > min_accepted, f"{who}'s drafts must be accepted often enough to test the accepting path"
    assert_target_law(counts, law, alpha=ALPHA)


def assert_fits(counts: Sequence[float], probs: Sequence[float], *, alpha: float,
                what: str = "the counts do not fit the law") -> None:
    """The counts fit the probabilities (chi-square p-value above `alpha`; a count where the probability is 0
    fails at once)."""
    observed, expected = np.asarray(counts), np.asarray(probs, dtype=float)
    support = expected > 0
    assert observed[~support].sum() == 0, "an outcome with probability 0 was produced"
    n = observed.sum()
    p_value = float(chisquare(observed[support], expected[support] / expected[support].sum() * n).pvalue)
    assert p_value > alpha, f"{what} (chi-square p = {p_value:.2e}, alpha {alpha:g})"


def assert_target_law(counts: dict[tuple[int, ...], int], law: dict[tuple[int, ...], float], *, alpha: float,
                      what: str = "output law differs from the target's") -> None:
    """The outcome counts fit the law (`assert_fits`, rare outcomes merged so each cell expects >= 5)."""
    runs = sum(counts.values())
    impossible = [k for k in counts if k not in law]
    assert not impossible, f"outcomes with probability 0 under the target: {impossible}"
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for k in sorted(law, key=law.get, reverse=True):
        if law[k] * runs >= 5:
            observed.append(counts.get(k, 0))
            expected.append(law[k] * runs)
        else:
            rest_o += counts.get(k, 0)
            rest_e += law[k] * runs
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    assert_fits(observed, expected, alpha=alpha, what=what)
