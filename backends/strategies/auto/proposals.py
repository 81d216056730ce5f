"""The candidate tree of one `auto` step: the speculation memory's continuations and prompt lookup's, merged.

SuffixDecoding (arXiv 2411.04975) speculates a tree of what followed the
current suffix in earlier outputs and in the request itself; `auto` prices
each node instead of shaping the tree by a fixed rule: every node carries the
estimates it is learnt under (the memory's by match, share and position,
lookup's by match and position; a node both propose carries both, and counts
as the likelier), backends.pricing.best_subtree picks the nodes worth
their batch rows (the rule `tree` sizes its draft trees by), and after
verification every node the target looked at (a child of the root or of an
accepted node) teaches each of its estimates whether it was accepted. The
tree itself is a backends.token_tree.TokenTree, as every proposer's is; the
estimate keys sit beside it. Pure: no model, no decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from backends.memory import Continuations
from backends.token_tree import EMPTY, TokenTree, TreeBuilder

LOOKUP_SOURCE, MEMORY_SOURCE = "lookup", "memory"


Keys = tuple[tuple[str, object], ...]  # a node's (source, key) estimates


@dataclass(frozen=True)
class CandidateTree:
    """A token tree (backends.token_tree; weights: the memory's share, 0 where only lookup proposes) with, per
    node, the (source, key) estimates it is learnt under."""

    tree: TokenTree = EMPTY
    keys: tuple[Keys, ...] = ()

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tree):
            raise ValueError(f"a candidate tree needs one set of keys per node: {len(self.tree)} nodes, "
                             f"{len(self.keys)} sets")

    def __len__(self) -> int:
        return len(self.tree)

    def with_path(self, tokens: Sequence[int], keys: Sequence[object], source: str) -> CandidateTree:
        """This tree with one proposal (a path from the root) merged in, its i-th token learnt under keys[i]."""
        grown = TreeBuilder(self.tree)
        learnt = list(self.keys)
        for node, key in zip(grown.add_path(tokens[:len(keys)]), keys):
            if node == len(learnt):
                learnt.append(())
            learnt[node] += ((source, key),)
        return CandidateTree(grown.build(), tuple(learnt))

    def accept(self, p: Callable[[str, object], float]) -> list[float]:
        """Each node's chance of acceptance once its parent is accepted: its likeliest estimate's."""
        return [max(p(source, key) for source, key in keys) for keys in self.keys]

    def likeliest_path(self, accept: Sequence[float], limit: int) -> list[int]:
        """The path from the root through each node's likeliest child (by `accept`), up to `limit` nodes."""
        return self.tree.likeliest_path(limit, accept)


def candidate_tree(memory: Continuations, memory_keys: Sequence[object], lookup: Sequence[int],
                   lookup_keys: Sequence[object]) -> CandidateTree:
    """The memory's continuations (node i learnt under memory_keys[i]) with lookup's chain merged in."""
    tree = CandidateTree(memory.tree, tuple(((MEMORY_SOURCE, key),) for key in memory_keys))
    return tree.with_path(lookup, lookup_keys, LOOKUP_SOURCE) if lookup else tree


def looked_at(parents: Sequence[int], path: Sequence[int], finished: bool = False) -> list[tuple[int, bool]]:
    """The nodes (of a verified set, renumbered) whose parent the target accepted, each with whether it was
    accepted itself: the root's children, and the children of each node on the matched `path`, but not of
    its last node when the generation `finished` there (the target never looked past it)."""
    on_path = set(path)
    reached = {-1, *(path[:-1] if finished else path)}
    return [(i, i in on_path) for i, p in enumerate(parents) if p in reached]
