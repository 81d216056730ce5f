"""Verifying several candidates at one position, and keeping the winning branch.

Shared by the strategies that verify many branches in one batch, each under
its own sequence id (`lookahead`'s n-grams, `tree`'s, `suffix`'s and `auto`'s
token trees, backends.token_tree.TokenTree: `verify_tree`). At each position
the target draws its token (greedy: argmax; sampling: its draw at that place,
backends.verify) and keeps the branch whose candidate it is, if any; after the
walk the caller keeps the accepted branch's cells as sequence 0 and drops the
others (backends.kv.KvSequence.keep_branch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Sequence

import numpy as np

from backends.events import ACCEPTED, TARGET, Event, Source
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import argmax, draw_dense, probabilities
from backends.steps import Decode
from backends.token_tree import TokenTree


def pick_among(run: Run, logits: np.ndarray, offered: Sequence[int],
               source: Source) -> Generator[Event, None, tuple[int, bool, bool]]:
    """Commit the target's token at a position offered `offered`; yields its events.

    Returns (token, matched: it was one of the candidates, counted: it was
    emitted as an accepted draft).
    """
    if run.params.greedy:
        token = argmax(logits)
    else:
        token = draw_dense(probabilities(logits, run.params), run.noise, run.place())
    matched = token in offered
    if offered and not matched:
        yield run.rejected(offered[0], source)
    ev = run.commit(token, ACCEPTED if matched else TARGET, correction=bool(offered) and not matched,
                    source=source, logits=logits)
    if ev is not None:
        yield ev
    return token, matched, ev is not None and matched


@dataclass(frozen=True)
class TreeVerdict:
    nodes: int  # verified (batch rows past the pending token)
    leaves: int  # root-to-leaf paths, one sequence id each
    depth: int
    matched: int  # nodes accepted along the path the target took
    accepted: int  # of which emitted as accepted drafts (a grammar's or a stop's end may cut the rest)
    path: tuple[int, ...] = ()  # the nodes the target's tokens matched, from the root (a stop may end it early)


def verify_tree(run: Run, target: KvSequence, tree: TokenTree, source: Source, choice: str,
                why: str = "") -> Generator[Event | Decode, list[int], TreeVerdict]:
    """SpecInfer's tree verification in one target batch: every root-to-leaf path under its own sequence id
    (a node belongs to the ids of all paths through it), then the target walks the tree from the root
    (greedy: the child equal to its argmax; sampling: the child equal to its draw, `pick_among`), and
    the accepted path's cells become sequence 0."""
    tokens, depth, leaves = tree.tokens, tree.depth, tree.leaves
    n_past = len(run.context) - 1
    paths: list[set[int]] = [set() for _ in tokens]  # target sequence ids through each node
    for leaf_no, leaf in enumerate(leaves, start=1):
        for i in tree.lineage(leaf):
            paths[i].add(leaf_no)
    target.share_with(len(leaves) + 1)
    # The batch depth first, the likeliest path first: llama.cpp gives a new token the lowest free cell and sums
    # attention in the cells' order, so a rejected node's cell freed among the kept ones puts the next tokens'
    # cells ahead of earlier positions', which moves a quantized model's logits (docs/results.md, "The KV cells'
    # order"). In this order, a step that accepts along the likeliest path leaves its rejected cells after the kept.
    order = tree.depth_first
    entries = [(run.pending, n_past, range(len(leaves) + 1), True)]
    entries += [(tokens[i], n_past + depth[i], sorted(paths[i]), True) for i in order]
    all_rows = yield from target.decoding(entries)
    rows = [0] * len(tokens)  # node i's batch row
    for k, i in enumerate(order):
        rows[i] = all_rows[1 + k]
    cur, row, n_matched, n_accepted = -1, all_rows[0], 0, 0
    path: list[int] = []
    while True:
        kids = tree.children(cur)
        offered = [tokens[k] for k in kids]
        token, matched, counted = yield from pick_among(run, run.logits(target, row), offered, source)
        n_accepted += counted
        if matched:
            path.append(next(k for k in kids if tokens[k] == token))
        if run.reason is not None or not matched:
            break
        n_matched += 1
        cur = path[-1]
        row = rows[cur]
    # Sequences 1.. are shared anew at the next tree's start.
    best_seq = min(paths[cur]) if n_matched else 0
    target.keep_branch(run.context, min(n_past + 1 + n_matched, len(run.context)), best_seq)
    yield run.end_step(len(tokens), n_accepted, choice, why)
    return TreeVerdict(len(tokens), len(leaves), max(depth, default=0), n_matched, n_accepted, tuple(path))
