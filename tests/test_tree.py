"""Token-tree speculation: greedy equality with `ar`, losslessness with sampling, the tree's shape.

Both shapes (EAGLE-2's dynamic tree, llama.cpp speculative.cpp's static
branch splitting) and both budgets (a fixed M, M chosen per step from the
batch cost curve, backends.pricing.best_subtree, the rule `auto` prices
its trees by).
"""

from __future__ import annotations

import math
import random

import pytest

from backends.config import AUTO, AUTO_K_MAX, StrategyOptions, TreeConfig
from backends.device_cost import BatchCost, DeviceCost
from backends.engine import Engine, EngineConfig
from backends.pricing import best_subtree
from backends.sampling import GenParams
from backends.strategies.tree import TreeSpeculation
from backends.token_tree import TokenTree, TreeBuilder
from engine_helpers import BATCH_NOISE, DEMO_NOISE, assert_greedy_agrees, run_to_done
from stats_helpers import ALPHA, assert_target_law, outcome, target_law
from test_greedy_equality import DEMO_PROMPTS, TINY_PROMPTS, _explain_mismatch

BUDGETS = [TreeConfig(1, 1, 1), TreeConfig(3, 2, 4), TreeConfig(4, 2, 8), TreeConfig(5, 3, 12)]
# Static shapes (p_min 0 and a low p_split so that they branch on the tiny pair) and auto budgets.
STATIC = [TreeConfig(4, 2, 8, "static", 0.05, 0.0), TreeConfig(5, 4, 12, "static", 0.02, 0.0),
          TreeConfig(6, 3, 10, "static", 0.1, 0.3), TreeConfig(3, 1, 3, "static", 0.0, 0.0)]
AUTO_BUDGETS = [TreeConfig(4, 2, AUTO), TreeConfig(5, 3, AUTO), TreeConfig(6, 4, AUTO, "static", 0.05, 0.0)]


def _label(c: TreeConfig) -> str:
    static = f"-static-ps{c.p_split}-pm{c.p_min}" if c.shape == "static" else ""
    return f"D{c.depth}k{c.top_k}M{c.nodes}{static}"


def _equal_to_ar(engine: Engine, text: str, n: int, config: TreeConfig, noise: float = BATCH_NOISE):
    """The tree's greedy output is ar's. A fixed budget's batches are the same in every run: token for token. An
    auto budget's follow the curve measured at run time, so its batches differ from run to run: a verification
    batch may rightly take the other token where a greedy choice is a near-tie (on the demo prompts, 0.013 at
    the first's 6th token, 0.006 at the second's 26th: tests/perf/greedy_margins.py), and only there."""
    prompt = engine.tokenize(text)
    ref = run_to_done(engine, "ar", prompt, GenParams(max_tokens=n))
    got = run_to_done(engine, "tree", prompt, GenParams(max_tokens=n), StrategyOptions(tree=config))
    if config.auto:
        assert_greedy_agrees(engine, prompt, ref.tokens, got.tokens, f"tree {_label(config)}", noise)
    else:
        assert got.tokens == ref.tokens, _explain_mismatch(engine, prompt, ref.tokens, got.tokens)
    return got


@pytest.mark.parametrize("config", BUDGETS + STATIC + AUTO_BUDGETS, ids=_label)
@pytest.mark.parametrize("text", TINY_PROMPTS)
def test_tree_equals_ar_tiny(tiny_engine: Engine, text: str, config: TreeConfig) -> None:
    done = _equal_to_ar(tiny_engine, text, 48, config)
    assert done.stats.extra["mean_tree_nodes"] <= config.max_nodes
    assert done.stats.extra["mean_tree_leaves"] <= config.target_seqs - 1


# Every fixed dynamic budget on every demo prompt; the static shape and the auto budget on two (32 tokens).
DEMO_CASES = [(t, c) for t in DEMO_PROMPTS for c in BUDGETS[1:]] + [
    (t, c) for t in DEMO_PROMPTS[:2] for c in (TreeConfig(6, 4, 12, "static"), TreeConfig(4, 2, AUTO))]


@pytest.mark.demo
@pytest.mark.parametrize(("text", "config"), DEMO_CASES, ids=lambda v: _label(v) if isinstance(v, TreeConfig) else None)
def test_tree_equals_ar_demo(demo_engine: Engine, text: str, config: TreeConfig) -> None:
    done = _equal_to_ar(demo_engine, text, 32, config, DEMO_NOISE)
    assert done.stats.accepted > 0


@pytest.mark.parametrize("config", [TreeConfig(2, 6, 12), TreeConfig(3, 6, 12, "static", 0.05, 0.0)], ids=_label)
def test_tree_keeps_the_target_law(small_engine: Engine, config: TreeConfig) -> None:
    """Children are deterministic picks in both shapes (the top-k; the top candidates above p_split):
    the target's draw at each place (backends.verify) keeps its law exactly."""
    from test_lossless import PARAMS, PROMPT

    params = PARAMS["plain"]
    law = target_law(small_engine, PROMPT, params)
    counts: dict[tuple[int, ...], int] = {}
    accepted = leaves = 0.0
    for seed in range(3000):
        done = run_to_done(small_engine, "tree", PROMPT, GenParams(**{**params.__dict__, "seed": seed}),
                           StrategyOptions(tree=config))
        key = outcome(small_engine, done)
        counts[key] = counts.get(key, 0) + 1
        accepted += done.stats.accepted
        leaves += done.stats.extra["mean_tree_leaves"]
    assert accepted > 600, "the test must exercise acceptance often"
    assert leaves / 3000 > 1.5, "the test must exercise siblings"
    assert_target_law(counts, law, alpha=ALPHA)


def test_wider_tree_accepts_more_per_forward(tiny_engine: Engine) -> None:
    prompt = tiny_engine.tokenize(TINY_PROMPTS[1])
    chain = run_to_done(tiny_engine, "tree", prompt, GenParams(max_tokens=64), StrategyOptions(tree=TreeConfig(4, 1, 4)))
    wide = run_to_done(tiny_engine, "tree", prompt, GenParams(max_tokens=64), StrategyOptions(tree=TreeConfig(4, 3, 12)))
    assert wide.tokens == chain.tokens
    assert wide.stats.mean_accepted_per_forward > chain.stats.mean_accepted_per_forward


def test_static_tree_splits_only_above_p_split(tiny_engine: Engine) -> None:
    prompt = tiny_engine.tokenize(TINY_PROMPTS[1])
    params = GenParams(max_tokens=48)

    def run(p_split: float):
        return run_to_done(tiny_engine, "tree", prompt, params,
                           StrategyOptions(tree=TreeConfig(4, 4, 16, "static", p_split, 0.0)))

    chain, split = run(1.0), run(0.02)
    # Means over all forwards; the last may be a plain one (no room for a tree), hence <= 1.
    assert 0.9 < chain.stats.extra["mean_tree_leaves"] <= 1.0, "p_split = 1 never splits: a chain"
    assert chain.stats.extra["mean_tree_nodes"] == chain.stats.extra["mean_tree_depth"] > 0
    assert split.stats.extra["mean_tree_leaves"] > 1.0
    assert split.stats.extra["mean_tree_nodes"] > chain.stats.extra["mean_tree_nodes"]
    assert split.tokens == chain.tokens
    # p_min stops branches: with p_min near 1 nothing is drafted.
    timid = run_to_done(tiny_engine, "tree", prompt, params,
                        StrategyOptions(tree=TreeConfig(4, 4, 16, "static", 0.02, 0.99)))
    assert timid.stats.drafted == 0 and timid.tokens == chain.tokens


def test_tree_config_sequences_cover_both_shapes() -> None:
    static = TreeConfig(6, 4, 12, "static")
    assert static.draft_seqs == 5 and static.target_seqs == 5 and static.max_nodes == 12
    dynamic_auto = TreeConfig(5, 3, AUTO)
    assert dynamic_auto.max_nodes == AUTO_K_MAX - 1 and dynamic_auto.target_seqs == AUTO_K_MAX
    assert TreeConfig(2, 2, AUTO).max_nodes == 2 + 4
    for bad in (dict(nodes=0), dict(nodes="many"), dict(shape="round"), dict(p_split=1.5), dict(p_min=1.0)):
        with pytest.raises(ValueError):
            TreeConfig(**bad)


def _curve(per_token: float, k_max: int = AUTO_K_MAX) -> BatchCost:
    """T(k) = T(1) (1 + per_token (k - 1))."""
    return BatchCost(tuple(1.0 + per_token * (k - 1) for k in range(1, k_max + 1)))


def _tree_size(probs: list[float], draft_forwards: int, draft_cost: float, curve: BatchCost,
               config: TreeConfig = TreeConfig(4, 4, AUTO)) -> int:
    """M as the tree strategy chooses it for a drafted tree whose nodes' cumulative probabilities are `probs`
    (all children of the root, so any order of them is a tree)."""
    strategy = TreeSpeculation.__new__(TreeSpeculation)  # only the selection: no contexts
    strategy.config, strategy.cost = config, DeviceCost(curve, draft_cost)
    drafted = TokenTree(tuple(range(len(probs))), (-1,) * len(probs), tuple(math.log(p) for p in probs))
    return strategy._auto_budget(drafted, draft_forwards)


def test_auto_budget_follows_the_cost_curve() -> None:
    probs = [0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01]
    assert _tree_size(probs, 4, 0.1, _curve(0.0)) == len(probs), "a flat curve keeps every node"
    assert _tree_size(probs, 0, 0.0, _curve(1.0)) == 0, "batch cost linear in k, free draft: a tree never pays"
    # The step's draft time is spent either way, so it makes the first, likely nodes worth verifying.
    assert _tree_size(probs, 4, 0.1, _curve(1.0)) == 2
    moderate = _tree_size(probs, 4, 0.1, _curve(0.1))
    assert 2 <= moderate <= 6
    assert _tree_size(probs, 4, 0.1, _curve(0.05)) >= moderate
    # The kept count never exceeds what the curve measured, nor the config's bound; the ratio rule is exact.
    assert _tree_size([0.99] * 40, 1, 0.0, _curve(0.0, 8)) == 7
    assert _tree_size([0.99] * 40, 1, 0.0, _curve(0.0, 64)) == TreeConfig(4, 4, AUTO).max_nodes == AUTO_K_MAX - 1
    m = _tree_size(probs, 2, 0.3, _curve(0.2))
    ratio = [(1 + sum(probs[:i])) / (2 * 0.3 + 1 + 0.2 * i) for i in range(len(probs) + 1)]
    assert ratio[m] == max(ratio)


def _random_tree(rng: random.Random) -> tuple[TokenTree, list[float]]:
    """A draft-like tree, depth by depth, with each node's reach (the product of its path's chances)."""
    b, reach = TreeBuilder(), []
    layer = [-1]
    for _ in range(rng.randint(1, 5)):
        grown = []
        for parent in layer[:3]:
            left = 1.0
            for _ in range(rng.randint(1, 3)):
                p = left * rng.random()
                left -= p
                grown.append(b.add(rng.randrange(100), parent))
                reach.append(p * (reach[parent] if parent >= 0 else 1.0))
        layer = grown
    return b.build(), reach


def test_dinkelbach_at_the_best_rate_is_the_best_ratio() -> None:
    """`tree` maximises tokens / cost, `auto` tokens - rate x cost: at the best ratio r* the two choose alike
    (every set is worth at most 0 there, the best ratio's sets exactly 0), above r* nothing is worth
    anything, below it the best set is worth more than nothing (Dinkelbach 1967)."""
    rng = random.Random(1)
    for _ in range(300):
        tree, reach = _random_tree(rng)
        per, fixed, leaves = rng.choice([0.0, 0.05, 0.3, 1.0]), rng.uniform(0.0, 1.0), rng.choice([1, 2, 100])

        def cost(n: int) -> float:
            return fixed + 1.0 + per * n

        by_ratio = best_subtree(tree, reach, cost, max_leaves=leaves)
        best = by_ratio.ratio
        at_best = best_subtree(tree, reach, cost, best, max_leaves=leaves)
        assert at_best.ratio == pytest.approx(best, rel=1e-12) and at_best.value(best) == pytest.approx(0, abs=1e-12)
        assert best_subtree(tree, reach, cost, best * 0.99, max_leaves=leaves).value(best * 0.99) > 0
        assert best_subtree(tree, reach, cost, best * 1.01, max_leaves=leaves).value(best * 1.01) < 0
        assert all(p.ratio <= best * (1 + 1e-12) for p in (best_subtree(tree, reach, cost, r, max_leaves=leaves)
                                                           for r in (best * 0.5, best * 2)))


def _auto_run(engine: Engine, cost: DeviceCost | None):
    strategy = engine.strategy("tree", StrategyOptions(tree=TreeConfig(4, 2, AUTO))).inner  # under Thinking
    assert isinstance(strategy, TreeSpeculation)
    strategy.cost = cost
    prompt = engine.tokenize(TINY_PROMPTS[0])
    events = list(strategy.generate(prompt, GenParams(max_tokens=40)))
    return strategy, events[-1]


def test_auto_budget_in_a_real_run(tiny_engine: Engine) -> None:
    """Measured lazily on the engine's target (once), greedy output unchanged; a synthetic curve steers M."""
    prompt = tiny_engine.tokenize(TINY_PROMPTS[0])
    ref = run_to_done(tiny_engine, "ar", prompt, GenParams(max_tokens=40))
    strategy, done = _auto_run(tiny_engine, None)
    assert strategy.cost is not None and len(strategy.cost.batch.seconds) == AUTO_K_MAX
    assert strategy.cost.draft > 0
    assert tiny_engine.device_cost() is strategy.cost, "measured once per engine"
    assert_greedy_agrees(tiny_engine, prompt, ref.tokens, done.tokens, "tree on the measured curve")
    assert 0 < done.stats.extra["mean_tree_nodes"] <= done.stats.extra["mean_drafted_nodes"]

    _, flat = _auto_run(tiny_engine, DeviceCost(_curve(0.0), 0.0))
    assert flat.stats.extra["mean_tree_nodes"] == flat.stats.extra["mean_drafted_nodes"], "free batches: keep all"
    _, steep = _auto_run(tiny_engine, DeviceCost(_curve(1.0), 0.0))
    assert steep.stats.extra["mean_tree_nodes"] == 0 and steep.stats.drafted == 0
    assert flat.tokens == steep.tokens == ref.tokens


def test_tree_near_the_end_of_the_context_does_not_fail(tiny) -> None:
    """A tree step needs a cache cell per drafted node, not per depth: near the end it must fall back in time."""
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.same_draft, n_ctx=256, threads=1, n_seq_max=32))
    try:
        assert engine.target.n_ctx == 256
        for n_prompt in range(240, 251, 2):
            prompt = (engine.tokenize("the cat sat on the mat " * 40))[:n_prompt]
            ref = run_to_done(engine, "ar", prompt, GenParams(max_tokens=64))
            got = run_to_done(engine, "tree", prompt, GenParams(max_tokens=64),
                              StrategyOptions(tree=TreeConfig(depth=2, top_k=4, nodes=8)))
            assert got.reason == ref.reason == "length" and got.tokens == ref.tokens
    finally:
        engine.close()
