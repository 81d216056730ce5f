"""One token tree for every strategy that proposes several continuations at once.

SpecInfer (Miao et al. 2024, "SpecInfer: Accelerating Large Language Model
Serving with Tree-based Speculative Inference and Verification") verifies a
tree of candidate tokens in one target batch, each root-to-leaf path under its
own sequence id (backends.strategies.branches.verify_tree). What proposes the
tree varies: EAGLE-2's dynamic draft tree (Li et al. 2024, section 4) keeps
the nodes of highest cumulative draft confidence (backends.strategies.tree);
SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) merges what followed
earlier occurrences of the context into a tree whose nodes carry the share of
occurrences through them (backends.memory, backends.strategies.suffix);
`auto` merges the memory's tree with prompt lookup's chain and prices each
node (backends.strategies.auto.proposals). All of them keep a subset of the
nodes, walk a node's path to the root, and ask for a node's children and the
tree's leaves; one type holds the tree so that each of those is written (and
tested) once, whoever drafted it.

A tree is three parallel arrays, parents first (a node's batch row comes
after its parent's, and one pass in index order sees every parent before its
children): `tokens[i]`, `parents[i]` (the index of node i's parent, always
below i; -1 for a child of the root, the pending token) and
`weights[i]`, one number per node whose meaning is the proposer's (the
memory's share of occurrences, the draft's cumulative log-probability).
What only one proposer needs (the memory's match length, `auto`'s estimate
keys) lives beside the tree in that proposer's own type. `TreeBuilder` grows
a tree a node at a time (drafting depth by depth, merging proposals).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence


def lineage(parents: Sequence[int], i: int) -> list[int]:
    """The nodes from the root's child down to node i, i included (none for i = -1, the root)."""
    out: list[int] = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


@dataclass(frozen=True)
class TokenTree:
    """Token tree, parents first: `parents[i]` < i (-1: a child of the root); `weights` default to 0."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.tokens)
        parents = tuple(int(p) for p in self.parents)
        weights = tuple(float(w) for w in self.weights) if len(self.weights) else (0.0,) * len(tokens)
        if len(parents) != len(tokens) or len(weights) != len(tokens):
            raise ValueError(f"a token tree needs one parent and one weight per token: {len(tokens)} tokens, "
                             f"{len(parents)} parents, {len(weights)} weights")
        for i, (t, p) in enumerate(zip(tokens, parents)):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent is {p}: parents come first (-1 for a child of the root)")
            if t < 0:
                raise ValueError(f"node {i}'s token is {t}: token ids are not negative")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "weights", weights)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]  # index 0: the root
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    def children(self, i: int = -1) -> tuple[int, ...]:
        """Node i's children, ascending (the root's for i = -1)."""
        return self._children[i + 1]

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """Each node's depth: 1 for a child of the root (its position after the pending token)."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(depth[p] + 1 if p >= 0 else 1)
        return tuple(depth)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        """The nodes without children, ascending: one root-to-leaf path each."""
        return tuple(i for i in range(len(self.tokens)) if not self._children[i + 1])

    def lineage(self, i: int) -> list[int]:
        """The nodes from the root's child down to node i."""
        return lineage(self.parents, i)

    def path(self, i: int) -> list[int]:
        """The tokens from the root down to node i, i included (what a row after node i follows)."""
        return [self.tokens[j] for j in lineage(self.parents, i)]

    def subset(self, keep: Iterable[int]) -> TokenTree:
        """The nodes of `keep` whose ancestors are all kept too (a node left out takes its subtree with it),
        renumbered in their order here, so parents still come first."""
        wanted = set(keep)
        new: dict[int, int] = {-1: -1}  # old index -> new index
        tokens: list[int] = []
        parents: list[int] = []
        weights: list[float] = []
        for i, p in enumerate(self.parents):
            if i in wanted and p in new:
                new[i] = len(tokens)
                tokens.append(self.tokens[i])
                parents.append(new[p])
                weights.append(self.weights[i])
        return TokenTree(tuple(tokens), tuple(parents), tuple(weights))

    def likeliest_path(self, limit: int, by: Sequence[float] | None = None) -> list[int]:
        """The nodes from the root through each node's likeliest child (by `by`, else the weights; the first
        of equals), up to `limit` nodes."""
        score = self.weights if by is None else by
        path: list[int] = []
        kids = self.children(-1)
        while kids and len(path) < limit:
            best = max(kids, key=lambda i: (score[i], -i))
            path.append(best)
            kids = self.children(best)
        return path

    @cached_property
    def depth_first(self) -> tuple[int, ...]:
        """Every node, depth first, each node's children likeliest first (by weight; the first of equals): parents
        still come first, and the likeliest path's nodes come before everything else. A verification batch in this
        order keeps the cells of an accepted likeliest path next to each other, the rejected ones after them
        (backends.strategies.branches.verify_tree)."""
        order: list[int] = []
        stack = [self._likeliest_first(-1)]
        while stack:
            if not stack[-1]:
                stack.pop()
                continue
            node = stack[-1].pop(0)
            order.append(node)
            stack.append(self._likeliest_first(node))
        return tuple(order)

    def _likeliest_first(self, i: int) -> list[int]:
        return sorted(self.children(i), key=lambda k: (-self.weights[k], k))

    def is_chain(self, nodes: Sequence[int]) -> bool:
        """Whether `nodes` (ascending) are one path from the root: verified as a chain, no branch ids."""
        return all(self.parents[n] == (nodes[k - 1] if k else -1) for k, n in enumerate(nodes))


EMPTY = TokenTree()


class TreeBuilder:
    """A TokenTree grown a node at a time: nodes are only appended, so parents come first.

    `depths` are kept as nodes come (a drafter places node i's row at its
    depth), and each (parent, token) is found again in one look-up, so that
    merging many proposals (`add_path`) costs their length, not the tree's
    size per token.
    """

    def __init__(self, base: TokenTree = EMPTY) -> None:
        self.tokens: list[int] = list(base.tokens)
        self.parents: list[int] = list(base.parents)
        self.weights: list[float] = list(base.weights)
        self.depths: list[int] = list(base.depth)
        self._child: dict[tuple[int, int], int] = {}
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            self._child.setdefault((p, t), i)  # the first of equal siblings, as a scan would find it

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, weight: float = 0.0) -> int:
        """Append a node under `parent` (-1: the root); its index."""
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"parent {parent} is not a node of this tree yet")
        i = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.weights.append(weight)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 1)
        self._child.setdefault((parent, int(token)), i)
        return i

    def add_path(self, path: Iterable[int], weight: float = 0.0) -> list[int]:
        """Merge a proposal (tokens from the root): follow the nodes it shares with the tree, append the rest,
        and add `weight` to every node on it; its nodes."""
        nodes: list[int] = []
        parent = -1
        for t in path:
            node = self._child.get((parent, int(t)))
            if node is None:
                node = self.add(t, parent)
            self.weights[node] += weight
            nodes.append(node)
            parent = node
        return nodes

    def path(self, i: int) -> list[int]:
        """The tokens from the root down to node i."""
        return [self.tokens[j] for j in lineage(self.parents, i)]

    def build(self) -> TokenTree:
        return TokenTree(tuple(self.tokens), tuple(self.parents), tuple(self.weights))
