"""The candidate tree of one `auto` step: the speculation memory's continuations and prompt lookup's, merged.

SuffixDecoding (arXiv 2411.04975) speculates a tree of what followed the
current suffix in earlier outputs and in the request itself; `auto` prices
each node instead of shaping the tree by a fixed rule: every node carries the
estimates it is learnt under (the memory's by match, share and position,
lookup's by match and position; a node both propose carries both, and counts
as the likelier), backends.strategies.auto.decide.best_subtree picks the
nodes worth their batch rows, and after verification every node the target
looked at (a child of the root or of an accepted node) teaches each of its
estimates whether it was accepted. Pure: no model, no decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from backends.suffix import Continuations

LOOKUP_SOURCE, MEMORY_SOURCE = "lookup", "memory"


@dataclass
class CandidateTree:
    """Token tree (parents first, -1: a child of the root) with, per node, the (source, key) estimates it is
    learnt under."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    keys: list[list[tuple[str, object]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add_path(self, tokens: Sequence[int], keys: Sequence[object], source: str) -> None:
        """Merge one proposal (a path from the root), its i-th token learnt under keys[i]."""
        parent = -1
        for tok, key in zip(tokens, keys):
            node = next((i for i in range(len(self.tokens)) if self.parents[i] == parent
                         and self.tokens[i] == tok), None)
            if node is None:
                node = len(self.tokens)
                self.tokens.append(int(tok))
                self.parents.append(parent)
                self.keys.append([])
            self.keys[node].append((source, key))
            parent = node

    def accept(self, p: Callable[[str, object], float]) -> list[float]:
        """Each node's chance of acceptance once its parent is accepted: its likeliest estimate's."""
        return [max(p(source, key) for source, key in keys) for keys in self.keys]

    def likeliest_path(self, accept: Sequence[float], limit: int) -> list[int]:
        """The path from the root through each node's likeliest child (by `accept`), up to `limit` nodes."""
        path: list[int] = []
        parent = -1
        while len(path) < limit:
            kids = [i for i in range(len(self.tokens)) if self.parents[i] == parent]
            if not kids:
                break
            parent = max(kids, key=lambda i: (accept[i], -i))
            path.append(parent)
        return path

    def subtree(self, nodes: Sequence[int]) -> tuple[list[int], list[int]]:
        """The tokens and parents (renumbered) of `nodes`, ascending, a tree containing its parents."""
        remap = {old: new for new, old in enumerate(nodes)}
        return [self.tokens[i] for i in nodes], [remap[self.parents[i]] if self.parents[i] >= 0 else -1
                                                 for i in nodes]


def candidate_tree(memory: Continuations, memory_keys: Sequence[object], lookup: Sequence[int],
                   lookup_keys: Sequence[object]) -> CandidateTree:
    """The memory's continuations (node i learnt under memory_keys[i]) with lookup's chain merged in."""
    tree = CandidateTree(list(memory.tokens), list(memory.parents),
                         [[(MEMORY_SOURCE, key)] for key in memory_keys])
    if lookup:
        tree.add_path(lookup, lookup_keys, LOOKUP_SOURCE)
    return tree


def looked_at(parents: Sequence[int], path: Sequence[int], finished: bool = False) -> list[tuple[int, bool]]:
    """The nodes (of a verified set, renumbered) whose parent the target accepted, each with whether it was
    accepted itself: the root's children, and the children of each node on the matched `path`, but not of
    its last node when the generation `finished` there (the target never looked past it)."""
    on_path = set(path)
    reached = {-1, *(path[:-1] if finished else path)}
    return [(i, i in on_path) for i, p in enumerate(parents) if p in reached]
