"""Speculative sampling keeps the target's output distribution (Leviathan et al. 2023, Theorem 1).

On a 16-token vocabulary, the exact law of the first two output tokens is
computed from the target's own logits (llama.cpp, fed each prefix); the
empirical law over many seeds of each strategy must fit it under a chi-square
test at significance 1e-4.
"""

from __future__ import annotations

import pytest

from backends.engine import Engine
from backends.config import StrategyOptions
from backends.sampling import GenParams
from backends.strategies.lookahead import LookaheadConfig
from backends.strategies.lookup import LookupConfig
from backends.strategies.sps import SpsConfig
from engine_helpers import run_to_done
from stats_helpers import ALPHA, assert_target_law, outcome, target_law

RUNS = 4000
PROMPT = [1, 4, 6, 8]  # <s> ▁a ▁b ▁c
BASE = [1] + [4, 6, 8, 10, 12] * 3
OPTIONS = StrategyOptions(
    sps=SpsConfig(draft_max=3, p_min=0.0, adaptive=False),
    lookahead=LookaheadConfig(4, 3, 4, seed_pool_from_prompt=True),
    lookup=LookupConfig(draft_max=3, ngram_max=2),
)
PARAMS = {
    "plain": GenParams(max_tokens=2, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "truncated": GenParams(max_tokens=2, temperature=0.8, top_k=6, top_p=0.9, min_p=0.02),
}


def _empirical(engine: Engine, strategy: str, prompt: list[int], params: GenParams, runs: int):
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(runs):
        done = run_to_done(engine, strategy, prompt, GenParams(**{**params.__dict__, "seed": seed}), OPTIONS)
        key = outcome(engine, done)
        counts[key] = counts.get(key, 0) + 1
        accepted += done.stats.accepted
    return counts, accepted


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
@pytest.mark.parametrize("strategy", ["sps", "ar"])
def test_output_law_is_the_targets(small_engine: Engine, strategy: str, params: GenParams) -> None:
    law = target_law(small_engine, PROMPT, params)
    counts, _ = _empirical(small_engine, strategy, PROMPT, params, RUNS)
    assert_target_law(counts, law, alpha=ALPHA)


def _copying_prompt(engine: Engine) -> list[int]:
    """A prompt whose own n-grams predict the target well, so n-gram drafts are often right.

    BASE, the target's greedy continuation c of it, BASE again, then the start of c:
    the suffix was followed by c before (prompt lookup proposes it) and the
    prompt-seeded pool holds c's n-grams next to others (several candidates).
    """
    greedy = run_to_done(engine, "ar", BASE, GenParams(max_tokens=8))
    c = list(greedy.tokens)
    return BASE + c + BASE[1:] + c[:2]


@pytest.mark.parametrize("strategy", ["lookahead", "lookup"])
def test_deterministic_drafts_keep_the_target_law(small_engine: Engine, strategy: str) -> None:
    """One-hot (multi-candidate) verification at temperature 1 keeps the target's law."""
    params = PARAMS["plain"]
    prompt = _copying_prompt(small_engine)
    law = target_law(small_engine, prompt, params)
    counts, accepted = _empirical(small_engine, strategy, prompt, params, 3000)
    assert accepted > 600, "the test must exercise acceptance often"
    assert_target_law(counts, law, alpha=ALPHA)


def test_sps_sampling_accepts_some_and_rejects_some(small_engine: Engine) -> None:
    """The noisy draft is neither always right nor always wrong, so the test above exercises both branches."""
    params = GenParams(max_tokens=64, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)
    done = run_to_done(small_engine, "sps", PROMPT, params, OPTIONS)
    assert 0.1 < done.stats.acceptance_rate < 0.95


@pytest.mark.parametrize("strategy", ["lookahead", "lookup", "tree"])
def test_a_seeded_answer_is_ars_whatever_is_proposed_deterministically(small_engine: Engine, strategy: str) -> None:
    """The target draws each place's token with noise the seed fixes (backends.sampling.Noise), and a
    deterministic proposal is accepted iff it is that token: with the same seed, these strategies give `ar`'s
    answer token for token while accepting proposals (`tree`'s children are the draft's top picks, not
    samples). tests/test_suffix.py holds the same for the memory and `auto`."""
    options = OPTIONS
    prompt = _copying_prompt(small_engine)
    accepted = 0
    for seed in range(12):
        for params in PARAMS.values():
            params = GenParams(**{**params.__dict__, "max_tokens": 24, "seed": seed})
            plain = run_to_done(small_engine, "ar", prompt, params, options)
            done = run_to_done(small_engine, strategy, prompt, params, options)
            assert done.tokens == plain.tokens, (strategy, seed, params)
            accepted += done.stats.accepted
    assert accepted > 20, "the strategy must have had proposals accepted"
