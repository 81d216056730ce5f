"""Speculative sampling keeps the target's output distribution (Leviathan et al. 2023, Theorem 1).

On a 16-token vocabulary, the exact law of the first two output tokens is
computed from the target's own logits (llama.cpp, fed each prefix); the
empirical law over many seeds of `sps` (and of `ar`) must fit it under a
chi-square test at significance 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from backends.engine import Engine
from backends.sampling import GenParams, probabilities
from backends.strategies.sps import SpsConfig

ALPHA = 1e-4
RUNS = 4000
PROMPT = [1, 4, 6, 8]  # <s> ▁a ▁b ▁c


def _target_law(engine: Engine, params: GenParams) -> dict[tuple[int, ...], float]:
    """Exact probability of each first-two-token outcome; an end-of-generation token ends the outcome."""
    seq = engine.target

    def dist(prefix: list[int]) -> np.ndarray:
        seq.sync(PROMPT + prefix)
        return probabilities(seq.logits().copy(), params)

    law: dict[tuple[int, ...], float] = {}
    p1 = dist([])
    for t1 in np.flatnonzero(p1):
        if engine.target_model.is_eog(int(t1)):
            law[(int(t1),)] = p1[t1]
            continue
        p2 = dist([int(t1)])
        for t2 in np.flatnonzero(p2):
            law[(int(t1), int(t2))] = p1[t1] * p2[t2]
    return law


def _outcome(engine: Engine, strategy: str, params: GenParams) -> tuple[int, ...]:
    done = None
    for ev in engine.strategy(strategy, SpsConfig(draft_max=3, p_min=0.0, adaptive=False)).generate(PROMPT, params):
        done = ev
    out = done.tokens[:2]
    if len(out) < 2 and done.reason == "eos":
        return out + (engine.target_model.eos,)
    return out


@pytest.mark.parametrize(
    "params",
    [
        GenParams(max_tokens=2, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
        GenParams(max_tokens=2, temperature=0.8, top_k=6, top_p=0.9, min_p=0.02),
    ],
    ids=["plain", "truncated"],
)
@pytest.mark.parametrize("strategy", ["sps", "ar"])
def test_output_law_is_the_targets(small_engine: Engine, strategy: str, params: GenParams) -> None:
    law = _target_law(small_engine, params)
    assert sum(law.values()) == pytest.approx(1.0)
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for seed in range(RUNS):
        out = _outcome(small_engine, strategy, GenParams(**{**params.__dict__, "seed": seed}))
        assert out in law, f"outcome {out} has probability 0 under the target"
        counts[out] = counts.get(out, 0) + 1
    # Merge rare outcomes so every chi-square cell expects at least 5.
    keys = sorted(law, key=law.get, reverse=True)
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for k in keys:
        if law[k] * RUNS >= 5:
            observed.append(counts.get(k, 0))
            expected.append(law[k] * RUNS)
        else:
            rest_o += counts.get(k, 0)
            rest_e += law[k] * RUNS
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    expected_arr = np.array(expected) * (RUNS / sum(expected))
    p_value = chisquare(observed, expected_arr).pvalue
    assert p_value > ALPHA, f"output law differs from the target's (chi-square p = {p_value:.2e})"


def test_sps_sampling_accepts_some_and_rejects_some(small_engine: Engine) -> None:
    """The noisy draft is neither always right nor always wrong, so the test above exercises both branches."""
    params = GenParams(max_tokens=64, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    stats = None
    for ev in small_engine.strategy("sps", SpsConfig(draft_max=3, p_min=0.0)).generate(PROMPT, params):
        stats = getattr(ev, "stats", None)
    assert 0.1 < stats.acceptance_rate < 0.95
