"""`suffix`: speculation from a memory of earlier outputs and from the request itself (SuffixDecoding).

Oliaro et al. 2024, "SuffixDecoding" (arXiv 2411.04975): the continuations
that followed earlier occurrences of the current suffix, in earlier requests
(backends.memory.SpeculationMemory, kept on disk) and in this one (prompt lookup's
matches, all of them, not only the latest), are merged into a token tree
whose nodes carry the share of occurrences through them. The tree's size
follows the match: SuffixDecoding's rule, at most `factor` x the match length
nodes (a long match is worth a deep tree, a one-token match a small one),
and only nodes at least `min_prob` of the occurrences go through.

The tree is verified in one target batch (backends.strategies.branches.
verify_tree, SpecInfer's rule), so output is the target's exactly, greedy or
sampled. Under a grammar, nodes whose path the grammar refuses are cut
before they cost a row. What the memory proposed and the target accepted is
counted for `specchat cache stats`; the generation itself is added to the
memory by the engine (backends.engine.Engine.strategy), for every strategy.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Iterator, Sequence

from backends.config import SuffixConfig
from backends.kv import KvSequence
from backends.memory import Continuations, SpeculationMemory, merge_continuations
from backends.run import Run
from backends.sampling import GenParams
from backends.steps import Steps
from backends.strategies.base import StepMachine, drive, never
from backends.strategies.branches import verify_tree
from backends.strategies.chain import chain_step, forced_step
from backends.strategies.lookup import NgramIndex
from backends.token_tree import TokenTree

OWN_WEIGHT = 2.0  # a continuation found in the request itself weighs this much more per matched token
OWN_OCCURRENCES = 16  # the request's most recent occurrences looked at


def own_continuations(index: NgramIndex, context: Sequence[int], depth: int) -> tuple[list[tuple[list[int], float]], int]:
    """Continuations of the longest suffix (up to the index's n) found earlier in `context`, weighed, and the
    match length."""
    n, starts = index.earlier(context, OWN_OCCURRENCES)
    return [(list(context[s + n: s + n + depth]), OWN_WEIGHT * n) for s in starts], n


def shaped(found: Continuations, config: SuffixConfig, max_nodes: int) -> TokenTree:
    """The nodes worth verifying: at least min_prob of the occurrences, at most factor x match nodes (a parent
    carries at least its children's share and comes first among equals, so the kept set is a tree)."""
    tree = found.tree
    budget = min(max_nodes, max(1, math.ceil(config.factor * max(found.match, 1))))
    keep = [i for i in range(len(tree)) if tree.weights[i] >= config.min_prob]
    return tree.subset(sorted(keep, key=lambda i: (-tree.weights[i], i))[:budget])


def prune_by_grammar(run: Run, found: Continuations) -> Continuations:
    """The nodes whose path the grammar admits (a refused node takes its subtree with it); all of them when
    drafts go unmasked (as Run.valid_prefix)."""
    tree = found.tree
    if run.constraint is None or not len(tree) or not run.params.mask_drafts:
        return found
    ok = [False] * len(tree)
    for i, parent in enumerate(tree.parents):
        if parent >= 0 and not ok[parent]:
            continue
        path = tree.path(i)
        ok[i] = len(run.valid_prefix(path)) == len(path)
    return replace(found, tree=tree.subset(i for i in range(len(tree)) if ok[i]))


class SuffixSpeculation(StepMachine):
    name = "suffix"

    def __init__(self, target: KvSequence, memory: SpeculationMemory | None, config: SuffixConfig = SuffixConfig()) -> None:
        self.target = target
        self.memory = memory  # None: the request's own matches only (no memory, or not for this request)
        self.config = config

    def continuations(self, run: Run, index: NgramIndex, depth: int) -> Continuations:
        own, own_match = own_continuations(index, run.context, depth)
        max_nodes = max(self.config.max_nodes * 4, 16)
        if self.memory is not None:
            found = self.memory.continuations(run.context, depth, max_nodes, own)
            found = replace(found, match=max(found.match, own_match))
        else:
            found = merge_continuations([s for s, _w in own], [w for _s, w in own], max_nodes, own_match) if own \
                else Continuations()
        return prune_by_grammar(run, found)

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        target = self.target
        run = Run(self.name, target.model, params, prompt, target.n_ctx)
        index = NgramIndex(1, 3)
        max_nodes = min(self.config.max_nodes, target.n_seq_max - 1, target.batch_capacity - 1)
        totals = {"tree_nodes": 0, "memory_steps": 0}

        def step() -> Iterator[object]:
            if (yield from forced_step(run, target)):
                return
            depth = min(self.config.depth, run.room() - 1)
            found = self.continuations(run, index, depth) if depth > 0 else Continuations()
            tree = shaped(found, self.config, max_nodes)
            if not len(tree) or len(run.context) + len(tree) + 1 > run.n_ctx:
                yield from chain_step(run, target, [], None)
                return
            v = yield from verify_tree(run, target, tree, "memory", "memory")
            totals["tree_nodes"] += v.nodes
            totals["memory_steps"] += 1
            if self.memory is not None:
                self.memory.record(v.nodes, v.accepted)

        run.report(lambda: {"mean_tree_nodes": round(totals["tree_nodes"] / max(totals["memory_steps"], 1), 3),
                            "memory_steps": totals["memory_steps"]})

        return drive(run, lambda: target.syncing(prompt[:-1], logits=False), step, should_stop)
