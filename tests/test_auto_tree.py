"""`auto`'s candidate tree from the speculation memory and lookup: which nodes are worth verifying, and what
each verified node teaches (backends.pricing.best_subtree with a rate, backends.strategies.auto.
proposals). Pure logic, checked against hand-worked expectations; the tree on real llama.cpp is tested in
test_suffix.py (the target's law and ar's greedy output)."""

from __future__ import annotations

from typing import Callable, Sequence

import pytest

from backends.memory import Continuations
from backends.pricing import Priced, best_subtree, path_reach
from backends.strategies.auto.decide import best_chain_length
from backends.strategies.auto.proposals import CandidateTree, candidate_tree, looked_at
from backends.token_tree import EMPTY, TokenTree

RATE, T_PLAIN = 50.0, 0.02


def linear(k: float) -> float:
    return 1.0 + 0.1 * (k - 1)  # each extra row costs a tenth of a plain step


def priced(parents: Sequence[int], accept: Sequence[float], curve: Callable[[float], float] = linear,
           **bounds: int) -> Priced:
    """As `auto` prices its candidates: each node's reach from its chance once its parent is accepted, a step
    of n nodes costing t_plain * T(n+1)/T(1), at the rate its steps keep."""
    tree = TokenTree(tuple(range(len(parents))), tuple(parents))
    return best_subtree(tree, path_reach(tree, accept), lambda n: T_PLAIN * curve(n + 1), RATE, **bounds)


@pytest.mark.parametrize("accept", [[0.9, 0.8, 0.5, 0.3, 0.2], [0.3, 0.9, 0.9], [0.05]])
def test_on_a_chain_the_tree_rule_is_the_chain_rule(accept: list[float]) -> None:
    parents = list(range(-1, len(accept) - 1))
    for leaves in (1, 8):
        got = priced(parents, accept, max_leaves=leaves)
        k, tokens_c, seconds_c = best_chain_length(accept, RATE, T_PLAIN, linear)
        assert got.nodes == tuple(range(k)) and got.tokens == pytest.approx(tokens_c)
        assert got.cost == pytest.approx(seconds_c)


def test_siblings_are_verified_together_when_rows_are_cheap_and_within_the_path_bound() -> None:
    # Root -> a (0.5) or b (0.4); a -> c (0.9). Reaches: a 0.5, b 0.4, c 0.45.
    parents, accept = [-1, -1, 0], [0.5, 0.4, 0.9]
    shape = TokenTree((1, 2, 3), tuple(parents))
    got = priced(parents, accept, max_leaves=2)
    assert got.nodes == (0, 1, 2) and got.tokens == pytest.approx(1 + 0.5 + 0.4 + 0.45)
    assert not shape.is_chain(got.nodes)
    # One path only: the likeliest chain, a then c (0.95 expected extra tokens beat b's 0.4).
    got = priced(parents, accept, max_leaves=1)
    assert got.nodes == (0, 2) and shape.is_chain(got.nodes) and got.tokens == pytest.approx(1.95)
    # Rows as dear as plain steps: nothing pays.
    assert priced(parents, accept, float, max_leaves=2).nodes == ()


def test_siblings_chances_are_scaled_to_at_most_one_in_all() -> None:
    """Two children each estimated at 0.8 cannot both be accepted: they count 0.5 each."""
    assert path_reach(TokenTree((1, 2), (-1, -1)), [0.8, 0.8]) == [0.5, 0.5]
    got = priced([-1, -1], [0.8, 0.8], lambda k: 1.0, max_leaves=2)
    assert got.nodes == (0, 1) and got.tokens == pytest.approx(2.0)
    # Along a path the chances multiply: 0.5 then 0.5 of that.
    assert path_reach(TokenTree((1, 2), (-1, 0)), [0.5, 0.5]) == [0.5, 0.25]


def test_the_node_budget_bounds_the_tree() -> None:
    assert priced([-1, 0, 1, 2], [0.9] * 4, lambda k: 1.0, max_nodes=2).nodes == (0, 1)


def test_lookups_chain_merges_into_the_memorys_tree_and_keeps_both_estimates() -> None:
    memory = Continuations(TokenTree((5, 6, 7), (-1, 0, -1), (0.7, 0.7, 0.3)), match=4)
    tree = candidate_tree(memory, ["m0", "m1", "m2"], [5, 9], ["l0", "l1"])
    assert tree.tree.tokens == (5, 6, 7, 9) and tree.tree.parents == (-1, 0, -1, 0)
    assert tree.tree.weights == (0.7, 0.7, 0.3, 0.0), "the memory's shares; none where only lookup proposes"
    assert tree.keys[0] == (("memory", "m0"), ("lookup", "l0")) and tree.keys[3] == (("lookup", "l1"),)
    chance = {"m0": 0.6, "l0": 0.8, "m1": 0.5, "m2": 0.2, "l1": 0.4}
    assert tree.accept(lambda _s, key: chance[key]) == [0.8, 0.5, 0.2, 0.4]  # the likelier estimate counts
    assert tree.likeliest_path([0.8, 0.5, 0.2, 0.4], 5) == [0, 1]
    assert tree.tree.subset([0, 2, 3]) == TokenTree((5, 7, 9), (-1, -1, 0), (0.7, 0.3, 0.0))
    with pytest.raises(ValueError):
        CandidateTree(memory.tree, ((("memory", "m0"),),))  # one set of keys for three nodes


def test_the_target_looks_at_the_roots_children_and_those_of_each_accepted_node() -> None:
    # 0 -> {1, 2}, 1 -> 3, and 4 a second child of the root.
    parents = [-1, 0, 0, 1, -1]
    assert looked_at(parents, [0, 1]) == [(0, True), (1, True), (2, False), (3, False), (4, False)]
    assert looked_at(parents, []) == [(0, False), (4, False)]
    # The generation ended on node 1: what follows it was never looked at.
    assert looked_at(parents, [0, 1], finished=True) == [(0, True), (1, True), (2, False), (4, False)]


def test_an_empty_tree_proposes_nothing() -> None:
    assert best_subtree(EMPTY, [], lambda n: T_PLAIN * linear(n + 1), RATE) == Priced((), 1.0, T_PLAIN)
    assert len(CandidateTree()) == 0
