"""`auto`'s candidate tree from the speculation memory and lookup: which nodes are worth verifying, and what
each verified node teaches (backends.strategies.auto.decide.best_subtree, .proposals). Pure logic, checked
against hand-worked expectations; the tree on real llama.cpp is tested in test_suffix.py (the target's law
and ar's greedy output)."""

from __future__ import annotations

import pytest

from backends.strategies.auto.decide import best_chain_length, best_subtree, is_chain
from backends.strategies.auto.proposals import CandidateTree, candidate_tree, looked_at
from backends.suffix import Continuations


def linear(k: float) -> float:
    return 1.0 + 0.1 * (k - 1)  # each extra row costs a tenth of a plain step


@pytest.mark.parametrize("accept", [[0.9, 0.8, 0.5, 0.3, 0.2], [0.3, 0.9, 0.9], [0.05]])
def test_on_a_chain_the_tree_rule_is_the_chain_rule(accept: list[float]) -> None:
    parents = list(range(-1, len(accept) - 1))
    for leaves in (1, 8):
        nodes, tokens, seconds = best_subtree(parents, accept, 50.0, 0.02, linear, leaves)
        k, tokens_c, seconds_c = best_chain_length(accept, 50.0, 0.02, linear)
        assert nodes == list(range(k)) and tokens == pytest.approx(tokens_c) and seconds == pytest.approx(seconds_c)


def test_siblings_are_verified_together_when_rows_are_cheap_and_within_the_path_bound() -> None:
    # Root -> a (0.5) or b (0.4); a -> c (0.9). Reaches: a 0.5, b 0.4, c 0.45.
    parents, accept = [-1, -1, 0], [0.5, 0.4, 0.9]
    nodes, tokens, _ = best_subtree(parents, accept, 50.0, 0.02, linear, max_leaves=2)
    assert nodes == [0, 1, 2] and tokens == pytest.approx(1 + 0.5 + 0.4 + 0.45)
    assert not is_chain(parents, nodes)
    # One path only: the likeliest chain, a then c (0.95 expected extra tokens beat b's 0.4).
    nodes, tokens, _ = best_subtree(parents, accept, 50.0, 0.02, linear, max_leaves=1)
    assert nodes == [0, 2] and is_chain(parents, nodes) and tokens == pytest.approx(1.95)
    # Rows as dear as plain steps: nothing pays.
    assert best_subtree(parents, accept, 50.0, 0.02, float, max_leaves=2)[0] == []


def test_siblings_chances_are_scaled_to_at_most_one_in_all() -> None:
    """Two children each estimated at 0.8 cannot both be accepted: they count 0.5 each."""
    nodes, tokens, _ = best_subtree([-1, -1], [0.8, 0.8], 50.0, 0.02, lambda k: 1.0, max_leaves=2)
    assert nodes == [0, 1] and tokens == pytest.approx(2.0)


def test_the_node_budget_bounds_the_tree() -> None:
    parents, accept = [-1, 0, 1, 2], [0.9] * 4
    assert best_subtree(parents, accept, 50.0, 0.02, lambda k: 1.0, max_nodes=2)[0] == [0, 1]


def test_lookups_chain_merges_into_the_memorys_tree_and_keeps_both_estimates() -> None:
    memory = Continuations([5, 6, 7], [-1, 0, -1], [0.7, 0.7, 0.3], match=4)
    tree = candidate_tree(memory, ["m0", "m1", "m2"], [5, 9], ["l0", "l1"])
    assert tree.tokens == [5, 6, 7, 9] and tree.parents == [-1, 0, -1, 0]
    assert tree.keys[0] == [("memory", "m0"), ("lookup", "l0")] and tree.keys[3] == [("lookup", "l1")]
    chance = {"m0": 0.6, "l0": 0.8, "m1": 0.5, "m2": 0.2, "l1": 0.4}
    assert tree.accept(lambda _s, key: chance[key]) == [0.8, 0.5, 0.2, 0.4]  # the likelier estimate counts
    assert tree.likeliest_path([0.8, 0.5, 0.2, 0.4], 5) == [0, 1]
    assert tree.subtree([0, 2, 3]) == ([5, 7, 9], [-1, -1, 0])


def test_the_target_looks_at_the_roots_children_and_those_of_each_accepted_node() -> None:
    # 0 -> {1, 2}, 1 -> 3, and 4 a second child of the root.
    parents = [-1, 0, 0, 1, -1]
    assert looked_at(parents, [0, 1]) == [(0, True), (1, True), (2, False), (3, False), (4, False)]
    assert looked_at(parents, []) == [(0, False), (4, False)]
    # The generation ended on node 1: what follows it was never looked at.
    assert looked_at(parents, [0, 1], finished=True) == [(0, True), (1, True), (2, False), (4, False)]


def test_an_empty_tree_proposes_nothing() -> None:
    assert best_subtree([], [], 50.0, 0.02, linear) == ([], 1.0, 0.02)
    assert len(CandidateTree()) == 0
