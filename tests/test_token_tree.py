"""The one token tree every proposer builds (backends.token_tree): validation, subsets renumbered, paths,
depths, children and leaves, the likeliest path, and growing a tree node by node. Pure logic, checked
against hand-worked trees; the strategies that draft and verify trees are tested on real llama.cpp in
test_tree.py and test_suffix.py."""

from __future__ import annotations

import pytest

from backends.token_tree import EMPTY, TokenTree, TreeBuilder


def sample() -> TokenTree:
    """    root
          /    \\
        0:10    1:11
        /  \\      \\
     2:12  3:13    5:15
       |
     4:14
    """
    return TokenTree((10, 11, 12, 13, 14, 15), (-1, -1, 0, 0, 2, 1), (0.5, 0.3, 0.4, 0.1, 0.2, 0.25))


def test_a_tree_is_validated_parents_first() -> None:
    with pytest.raises(ValueError, match="parents come first"):
        TokenTree((1, 2), (1, -1))  # node 0's parent after it
    with pytest.raises(ValueError, match="parents come first"):
        TokenTree((1, 2), (-1, 1))  # node 1 its own parent
    with pytest.raises(ValueError, match="parents come first"):
        TokenTree((1,), (-2,))
    with pytest.raises(ValueError, match="one parent and one weight per token"):
        TokenTree((1, 2), (-1,))
    with pytest.raises(ValueError, match="one parent and one weight per token"):
        TokenTree((1, 2), (-1, 0), (0.5,))
    with pytest.raises(ValueError, match="not negative"):
        TokenTree((1, -1), (-1, 0))


def test_lists_become_tuples_and_weights_default_to_zero() -> None:
    tree = TokenTree([7, 8], [-1, 0])
    assert tree.tokens == (7, 8) and tree.parents == (-1, 0) and tree.weights == (0.0, 0.0)
    assert tree == TokenTree((7, 8), (-1, 0), (0.0, 0.0))
    assert len(tree) == 2 and len(EMPTY) == 0 and EMPTY == TokenTree()


def test_children_depth_and_leaves() -> None:
    tree = sample()
    assert tree.children() == (0, 1) and tree.children(0) == (2, 3) and tree.children(2) == (4,)
    assert tree.children(4) == ()
    assert tree.depth == (1, 1, 2, 2, 3, 2)
    assert tree.leaves == (3, 4, 5)
    assert EMPTY.children() == () and EMPTY.depth == () and EMPTY.leaves == ()


def test_path_walks_from_the_root() -> None:
    tree = sample()
    assert tree.lineage(4) == [0, 2, 4] and tree.path(4) == [10, 12, 14]
    assert tree.path(5) == [11, 15] and tree.path(0) == [10] and tree.path(-1) == []


def test_subset_renumbers_and_drops_what_lost_its_parent() -> None:
    tree = sample()
    assert tree.subset([0, 1, 3, 5]) == TokenTree((10, 11, 13, 15), (-1, -1, 0, 1), (0.5, 0.3, 0.1, 0.25))
    # Node 5's parent (1) is left out: it goes too. The order of `keep` does not matter.
    assert tree.subset([5, 4, 0, 2]) == TokenTree((10, 12, 14), (-1, 0, 1), (0.5, 0.4, 0.2))
    assert tree.subset([2, 4]) == EMPTY  # without node 0 nothing below it stands
    assert tree.subset(range(len(tree))) == tree and tree.subset([]) == EMPTY


def test_likeliest_path_follows_each_nodes_best_child() -> None:
    tree = sample()
    assert tree.likeliest_path(5) == [0, 2, 4]  # by the weights
    assert tree.likeliest_path(2) == [0, 2] and tree.likeliest_path(0) == []
    assert tree.likeliest_path(5, by=[0.1, 0.9, 0.0, 0.0, 0.0, 0.5]) == [1, 5]
    assert tree.likeliest_path(5, by=[0.3] * 6) == [0, 2, 4], "the first of equals"
    assert EMPTY.likeliest_path(3) == []


def test_is_chain() -> None:
    tree = sample()
    assert tree.is_chain([0, 2, 4]) and tree.is_chain([1, 5]) and tree.is_chain([0]) and tree.is_chain([])
    assert not tree.is_chain([0, 1]), "two children of the root"
    assert not tree.is_chain([0, 4]), "a gap"
    assert not tree.is_chain([2]), "not from the root"


def test_the_builder_merges_paths_and_sums_their_weights() -> None:
    b = TreeBuilder()
    assert b.add_path([1, 2, 3], 3.0) == [0, 1, 2]
    assert b.add_path([1, 2, 4], 2.0) == [0, 1, 3]
    assert b.add_path([5], 1.0) == [4]
    assert b.depths == [1, 2, 3, 3, 1] and b.path(3) == [1, 2, 4]
    assert b.build() == TokenTree((1, 2, 3, 4, 5), (-1, 0, 1, 1, -1), (5.0, 5.0, 3.0, 2.0, 1.0))
    with pytest.raises(ValueError):
        b.add(9, 5)  # no node 5 yet


def test_the_builder_grows_a_tree_from_the_first_of_equal_siblings() -> None:
    base = TokenTree((4, 4, 6), (-1, -1, 1), (0.5, 0.5, 0.5))  # two root children with the same token
    b = TreeBuilder(base)
    assert b.add_path([4, 6]) == [0, 3], "the first 4, which has no 6 below it yet"
    assert b.build() == TokenTree((4, 4, 6, 6), (-1, -1, 1, 0), (0.5, 0.5, 0.5, 0.0))
    assert b.add(7, 3, -0.25) == 4 and b.depths[4] == 3


def test_depth_first_puts_the_likeliest_path_first_and_parents_before_children() -> None:
    """The order a verification batch lists the nodes in (backends.strategies.branches.verify_tree): depth first,
    each node's likeliest child first, so that the cells of an accepted likeliest path come next to each other."""
    tree = sample()
    assert tree.depth_first == (0, 2, 4, 3, 1, 5)
    assert list(tree.depth_first[:3]) == tree.likeliest_path(5)
    equal = TokenTree((10, 11, 12, 13), (-1, -1, 1, 1), (0.3, 0.3, 0.2, 0.2))
    assert equal.depth_first == (0, 1, 2, 3), "the first of equals"
    assert TokenTree((10, 11, 12), (-1, -1, 1), (0.1, 0.9, 0.5)).depth_first == (1, 2, 0)
    assert EMPTY.depth_first == ()
