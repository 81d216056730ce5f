"""`tree`: token-tree speculation with a draft model.

The tree follows EAGLE-2's dynamic draft tree (Li et al. 2024, "EAGLE-2:
Faster Inference of Language Models with Dynamic Draft Trees", section 4):
at every depth the `top_k` nodes with the highest cumulative draft
probability are expanded with their `top_k` most likely children, then all
nodes are reranked and the best `nodes` (M) are verified. Cumulative
probability only falls along a path, so the kept set is a tree.

Verification is SpecInfer's (Miao et al. 2024): the whole tree goes to the
target in one batch, every root-to-leaf path under its own sequence id (a node
belongs to the ids of all paths through it, as lookahead shares its input
token), and the target walks it from the root: greedy, it follows the child
equal to its argmax; sampling, it tries the node's children with the one-hot
multi-candidate rule (the children are deterministic top-k picks), which
keeps the target's distribution exactly. The accepted path's cells become
sequence 0; every other branch's cells are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from backends.events import Event
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import GenParams
from backends.strategies.base import drive, never
from backends.strategies.branches import keep_branch, pick_among
from backends.strategies.chain import chain_step


@dataclass(frozen=True)
class TreeConfig:
    depth: int = 4  # D: longest path
    top_k: int = 2  # children per expanded node, and nodes expanded per depth
    nodes: int = 8  # M: nodes verified per step

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.nodes < 1:
            raise ValueError("tree depth, top-k and nodes must be at least 1")

    @property
    def draft_seqs(self) -> int:
        return 1 + self.top_k * self.depth

    @property
    def target_seqs(self) -> int:
        return 1 + self.nodes


@dataclass
class _Node:
    token: int
    parent: int  # index in the node list, -1 for a child of the root
    depth: int  # 1 for children of the root
    logp: float  # cumulative draft log-probability


def _top_log_probs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k likeliest tokens under softmax(logits) with their log-probabilities, best first.

    float32 over the vocabulary (this runs for every expanded node), float64 for the sum.
    """
    top = float(logits.max())
    log_z = top + float(np.log(np.exp(logits - top).sum(dtype=np.float64)))
    ids = np.argpartition(logits, -k)[-k:]
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    return [(int(i), float(logits[i]) - log_z) for i in ids]


class TreeSpeculation:
    name = "tree"

    def __init__(self, target: KvSequence, draft: KvSequence, config: TreeConfig = TreeConfig()) -> None:
        for seq, need, role in ((target, config.target_seqs, "target"), (draft, config.draft_seqs, "draft")):
            if seq.ctx.config.n_seq_max < need:
                raise ValueError(f"tree speculation needs a {role} context with {need} sequences")
        self.target = target
        self.draft = draft
        self.config = config
        self.draft_forwards = 0  # draft decode calls, for the cost model (backends.cost)

    def _draft_tree(self, context: list[int], budget: int) -> list[_Node]:
        """EAGLE-2's expand-then-rerank, on the draft model; returns the kept nodes, parents first."""
        cfg, draft = self.config, self.draft
        draft.sync(context)
        base = len(context)
        nodes: list[_Node] = []
        layer = [len(nodes) + i for i in range(cfg.top_k)]
        nodes += [_Node(t, -1, 1, lp) for t, lp in _top_log_probs(draft.logits(), cfg.top_k)]
        self.draft_forwards += 1
        seq_of: dict[int, int] = {}
        next_seq = 1
        for depth in range(1, min(cfg.depth, budget)):
            expand = sorted(layer, key=lambda i: -nodes[i].logp)[: cfg.top_k]
            batch = draft.batch
            batch.clear()
            rows = []
            for i in expand:
                seq = next_seq
                next_seq += 1
                parent = nodes[i].parent
                draft.ctx.seq_cp(seq_of[parent] if parent >= 0 else 0, seq, -1, -1)
                seq_of[i] = seq
                rows.append(batch.add(nodes[i].token, base + depth - 1, (seq,), True))
            draft.ctx.decode(batch)
            self.draft_forwards += 1
            layer = []
            for i, row in zip(expand, rows):
                for t, lp in _top_log_probs(draft.ctx.logits(row), cfg.top_k):
                    layer.append(len(nodes))
                    nodes.append(_Node(t, i, depth + 1, nodes[i].logp + lp))
        for seq in range(1, next_seq):
            draft.ctx.seq_rm(seq, -1, -1)
        # Rerank: the best M by cumulative probability (ties broken towards shallower nodes).
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].logp, nodes[i].depth))[: cfg.nodes]
        kept = set(order)
        kept = {i for i in kept if all(a in kept for a in self._ancestors(nodes, i))}
        remap = {old: new for new, old in enumerate(sorted(kept, key=lambda i: (nodes[i].depth, i)))}
        out = []
        for old in sorted(kept, key=lambda i: (nodes[i].depth, i)):
            n = nodes[old]
            out.append(_Node(n.token, remap[n.parent] if n.parent >= 0 else -1, n.depth, n.logp))
        return out

    @staticmethod
    def _ancestors(nodes: list[_Node], i: int) -> list[int]:
        out = []
        while nodes[i].parent >= 0:
            i = nodes[i].parent
            out.append(i)
        return out

    def generate(
        self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never
    ) -> Iterator[Event]:
        target = self.target
        run = Run(self.name, target.ctx.model, params, prompt, min(target.n_ctx, self.draft.n_ctx))
        totals = {"tree_nodes": 0, "tree_depth": 0, "batch_tokens": 0}
        self.draft_forwards = 0

        def prefill() -> int:
            self.draft.sync(prompt[:-1], logits=False)
            return target.sync(prompt[:-1], logits=False)

        def tree_step() -> Iterator[Event]:
            n_past = len(run.context) - 1
            nodes = self._draft_tree(run.context, run.room() - 1)
            children: list[list[int]] = [[] for _ in range(len(nodes) + 1)]  # index 0 = the root
            for i, n in enumerate(nodes):
                children[n.parent + 1].append(i)
            leaves = [i for i in range(len(nodes)) if not children[i + 1]]
            paths: list[set[int]] = [set() for _ in nodes]  # target sequence ids through each node
            for leaf_no, leaf in enumerate(leaves, start=1):
                i = leaf
                while i >= 0:
                    paths[i].add(leaf_no)
                    i = nodes[i].parent
            target.share_with(len(leaves) + 1)
            batch = target.batch
            batch.clear()
            batch.add(run.pending, n_past, range(len(leaves) + 1), True)
            rows = [batch.add(n.token, n_past + n.depth, sorted(paths[i]), True) for i, n in enumerate(nodes)]
            target.ctx.decode(batch)
            totals["batch_tokens"] += len(batch)
            totals["tree_nodes"] += len(nodes)
            totals["tree_depth"] += max((n.depth for n in nodes), default=0)

            cur, row, n_matched, n_accepted = -1, 0, 0, 0
            while True:
                kids = children[cur + 1]
                offered = [nodes[k].token for k in kids]
                token, matched, counted = yield from pick_among(run, target.logits(row), offered)
                n_accepted += counted
                if run.reason is not None or not matched:
                    break
                n_matched += 1
                cur = next(k for k in kids if nodes[k].token == token)
                row = rows[cur]
            # Sequences 1.. are shared anew at the next step's start.
            best_seq = min(paths[cur]) if n_matched else 0
            keep_branch(target, run.context, min(n_past + 1 + n_matched, len(run.context)), best_seq)
            yield run.end_step(len(nodes), n_accepted)

        def step() -> Iterator[Event]:
            if run.room() < 2 or len(run.context) + self.config.depth + 1 > run.n_ctx:
                totals["batch_tokens"] += 1
                yield from chain_step(run, target, [], None)
            else:
                yield from tree_step()
            steps = max(run.forwards, 1)
            run.extra.update(
                batch_tokens=totals["batch_tokens"],
                draft_forwards=self.draft_forwards,
                mean_tree_nodes=round(totals["tree_nodes"] / steps, 3),
                mean_tree_depth=round(totals["tree_depth"] / steps, 3),
                mean_accepted_path=round(run.accepted / steps, 3),
            )

        return drive(run, prefill, step, should_stop)
