"""Token-tree speculation: greedy equality with `ar`, losslessness with sampling, the tree's shape."""

from __future__ import annotations

import pytest

from backends.engine import Engine, StrategyOptions
from backends.sampling import GenParams
from backends.strategies.tree import TreeConfig
from engine_helpers import run_to_done
from stats_helpers import ALPHA, fits_law, outcome, target_law
from test_greedy_equality import DEMO_PROMPTS, TINY_PROMPTS, _explain_mismatch

BUDGETS = [TreeConfig(1, 1, 1), TreeConfig(3, 2, 4), TreeConfig(4, 2, 8), TreeConfig(5, 3, 12)]


def _equal_to_ar(engine: Engine, text: str, n: int, config: TreeConfig):
    prompt = engine.tokenize(text)
    ref = run_to_done(engine, "ar", prompt, GenParams(max_tokens=n))
    got = run_to_done(engine, "tree", prompt, GenParams(max_tokens=n), StrategyOptions(tree=config))
    assert got.tokens == ref.tokens, _explain_mismatch(engine, prompt, ref.tokens, got.tokens)
    return got


@pytest.mark.parametrize("config", BUDGETS, ids=lambda c: f"D{c.depth}k{c.top_k}M{c.nodes}")
@pytest.mark.parametrize("text", TINY_PROMPTS)
def test_tree_equals_ar_tiny(tiny_engine: Engine, text: str, config: TreeConfig) -> None:
    done = _equal_to_ar(tiny_engine, text, 48, config)
    assert done.stats.extra["mean_tree_nodes"] <= config.nodes


@pytest.mark.demo
@pytest.mark.parametrize("config", BUDGETS[1:], ids=lambda c: f"D{c.depth}k{c.top_k}M{c.nodes}")
@pytest.mark.parametrize("text", DEMO_PROMPTS)
def test_tree_equals_ar_demo(demo_engine: Engine, text: str, config: TreeConfig) -> None:
    done = _equal_to_ar(demo_engine, text, 32, config)
    assert done.stats.accepted > 0


def test_tree_keeps_the_target_law(small_engine: Engine) -> None:
    """Children are deterministic top-k picks: SpecInfer's one-hot rule keeps the target's law exactly."""
    from test_lossless import PARAMS, PROMPT

    params = PARAMS["plain"]
    law = target_law(small_engine, PROMPT, params)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for seed in range(3000):
        done = run_to_done(small_engine, "tree", PROMPT, GenParams(**{**params.__dict__, "seed": seed}),
                           StrategyOptions(tree=TreeConfig(2, 6, 12)))
        key = outcome(small_engine, done)
        counts[key] = counts.get(key, 0) + 1
        accepted += done.stats.accepted
    assert accepted > 600, "the test must exercise acceptance often"
    p_value = fits_law(counts, law)
    assert p_value > ALPHA, f"output law differs from the target's (chi-square p = {p_value:.2e})"


def test_wider_tree_accepts_more_per_forward(tiny_engine: Engine) -> None:
    prompt = tiny_engine.tokenize(TINY_PROMPTS[1])
    chain = run_to_done(tiny_engine, "tree", prompt, GenParams(max_tokens=64), StrategyOptions(tree=TreeConfig(4, 1, 4)))
    wide = run_to_done(tiny_engine, "tree", prompt, GenParams(max_tokens=64), StrategyOptions(tree=TreeConfig(4, 3, 12)))
    assert wide.tokens == chain.tokens
    assert wide.stats.mean_accepted_per_forward > chain.stats.mean_accepted_per_forward
