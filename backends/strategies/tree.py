"""`tree`: token-tree speculation with a draft model.

Two shapes of draft tree, one verifier. Both draft a token tree
(backends.token_tree: parents before children, depth by depth) weighted by
each node's cumulative draft log-probability; the same selection and the
same verification consume it.

- `dynamic` (default) follows EAGLE-2's dynamic draft tree (Li et al. 2024,
  "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
  section 4): at every depth the `top_k` nodes with the highest cumulative
  draft probability are expanded with their `top_k` most likely children.
- `static` follows llama.cpp's `examples/speculative/speculative.cpp` (its
  n_seq_dft branches, `--draft-p-split`): drafting goes depth by depth; every
  live branch is extended by its draft's top candidate, and each further
  candidate whose draft probability exceeds `p_split` starts a new branch (a
  copy of the parent branch's draft KV sequence) while there are fewer than
  `top_k` branches (llama.cpp's n_seq_dft). A branch stops when its top
  probability falls below `p_min` (common/speculative.cpp drafts while
  p >= p_min), all stop at `depth` or when `nodes` tokens are drafted
  (llama.cpp's n_draft bound on the target batch).

Selection (EAGLE-2's rerank): all drafted nodes are ordered by cumulative
probability and a prefix is verified. Cumulative probability only falls along
a path, so every prefix is a tree. Its length M is `nodes`, or with
`nodes="auto"` it is chosen at every step from the device's measured batch
cost curve (backends.pricing.best_subtree, the rule `auto` prices its
trees by): the M maximizing expected tokens (1 + the sum of the kept nodes'
cumulative draft probabilities, EAGLE-2's estimate of the acceptance length)
per unit of time (the step's draft forwards at the measured draft cost +
T(M+1)/T(1)), never more than the curve measured. Per step rather than once
per run because the tree's confidence varies from step to step: a confident
tree is worth a wide batch, a doubtful one is not; the curve itself is
measured once per engine, lazily, at the first generation.

Verification is SpecInfer's (Miao et al. 2024): the whole tree goes to the
target in one batch, every root-to-leaf path under its own sequence id (a node
belongs to the ids of all paths through it, as lookahead shares its input
token), and the target walks it from the root: greedy, it follows the child
equal to its argmax; sampling, it tries the node's children with the one-hot
multi-candidate rule (the children are deterministic picks in both shapes),
which keeps the target's distribution exactly. The accepted path's cells
become sequence 0; every other branch's cells are dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Sequence

import numpy as np

from backends.config import TreeConfig
from backends.device_cost import DeviceCost
from backends.kv import KvSequence
from backends.pricing import best_subtree
from backends.run import Run
from backends.sampling import GenParams
from backends.steps import Decode, Steps
from backends.strategies.base import StepMachine, drive, never
from backends.strategies.branches import verify_tree
from backends.strategies.chain import chain_step, forced_step
from backends.token_tree import TokenTree, TreeBuilder


@dataclass
class _Branch:
    """A static tree's live branch: its last node, the draft sequence holding its path, the draft's next logits."""

    leaf: int  # -1: the root
    seq: int
    logits: np.ndarray


def _top_log_probs(logits: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k likeliest tokens under softmax(logits) with their log-probabilities, best first.

    float32 over the vocabulary (this runs for every expanded node), float64 for the sum.
    """
    top = float(logits.max())
    log_z = top + float(np.log(np.exp(logits - top).sum(dtype=np.float64)))
    ids = np.argpartition(logits, -k)[-k:]
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    # A grammar's mask leaves fewer than k tokens possible at some places: the others are no candidates.
    return [(int(i), float(logits[i]) - log_z) for i in ids if logits[i] > -np.inf]


class _Scratch:
    """The draft cache's scratch sequences 1..: forked from a path's sequence, all dropped after drafting."""

    def __init__(self, seq: KvSequence) -> None:
        self.seq = seq
        self.used = 0

    def fork(self, src: int) -> int:
        self.used += 1
        self.seq.fork(src, self.used)
        return self.used

    def release(self) -> None:
        for seq in range(1, self.used + 1):
            self.seq.drop_seq(seq)


class TreeSpeculation(StepMachine):
    name = "tree"

    def __init__(self, target: KvSequence, draft: KvSequence, config: TreeConfig = TreeConfig(),
                 device_cost: Callable[[], DeviceCost | None] = lambda: None) -> None:
        for seq, need, role in ((target, config.target_seqs, "target"), (draft, config.draft_seqs, "draft")):
            if seq.n_seq_max < need:
                raise ValueError(f"tree speculation needs a {role} context with {need} sequences")
        self.target = target
        self.draft = draft
        self.config = config
        self.draft_forwards = 0  # draft decode calls, for the cost model (backends.pricing)
        self.device_cost = device_cost  # the engine's measured costs (backends.engine.Engine.device_cost)
        self.cost: DeviceCost | None = None  # taken at the first generation when nodes="auto"

    # -- drafting: each shape returns every drafted node, parents first ------

    def _root_logits(self, run: Run, depth: int) -> Generator[Decode, list[int], np.ndarray]:
        self.draft.plan(depth)  # a block drafter decodes the whole depth at once (backends.dflash)
        yield from self.draft.syncing(run.context)
        self.draft_forwards += 1
        return run.logits(self.draft, drafter=True)

    def _decode(self, base: int, drafted: TreeBuilder,
                entries: list[tuple[int, int]]) -> Generator[Decode, list[int], list[int]]:
        """Decode nodes (index, draft sequence) in one draft batch, each after its path; returns their rows."""
        rows = yield from self.draft.decoding((drafted.tokens[i], base + drafted.depths[i] - 1, (seq,), True)
                                              for i, seq in entries)
        self.draft_forwards += 1
        return rows

    def _draft_dynamic(self, run: Run, max_depth: int) -> Generator[Decode, list[int], TokenTree]:
        """EAGLE-2's expansion: the top_k best nodes of each depth get their top_k children."""
        k = self.config.top_k
        context = run.context
        drafted = TreeBuilder()  # weights: cumulative draft log-probabilities
        root = yield from self._root_logits(run, max_depth + 1)
        layer = [drafted.add(t, -1, lp) for t, lp in _top_log_probs(root, k)]
        scratch = _Scratch(self.draft)
        seq_of = {-1: 0}  # node -> draft sequence holding its path
        for depth in range(1, max_depth):
            expand = sorted(layer, key=lambda i: -drafted.weights[i])[:k]
            for i in expand:
                seq_of[i] = scratch.fork(seq_of[drafted.parents[i]])
            rows = yield from self._decode(len(context), drafted, [(i, seq_of[i]) for i in expand])
            layer = []
            for i, row in zip(expand, rows):
                for t, lp in _top_log_probs(run.logits(self.draft, row, drafted.path(i), drafter=True), k):
                    layer.append(drafted.add(t, i, drafted.weights[i] + lp))
        scratch.release()
        return drafted.build()

    def _draft_static(self, run: Run, max_depth: int) -> Generator[Decode, list[int], TokenTree]:
        """llama.cpp's speculative.cpp: extend every branch by its top candidate, split off likely others."""
        cfg = self.config
        scratch = _Scratch(self.draft)
        context = run.context
        live = [_Branch(-1, 0, (yield from self._root_logits(run, max_depth + 1)))]
        n_branches = 1
        drafted = TreeBuilder()  # weights: cumulative draft log-probabilities
        for depth in range(1, max_depth + 1):
            grown: list[tuple[int, int]] = []  # (new node, draft sequence of its branch)
            for br in live:
                cands = _top_log_probs(br.logits, cfg.top_k)
                if math.exp(cands[0][1]) < cfg.p_min:
                    continue  # this branch stops drafting
                base_logp = drafted.weights[br.leaf] if br.leaf >= 0 else 0.0
                for j, (t, lp) in enumerate(cands):
                    if len(drafted) >= cfg.drafted_nodes:
                        break
                    if j > 0:
                        if n_branches >= cfg.top_k or math.exp(lp) <= cfg.p_split:
                            break
                        n_branches += 1
                    # The top candidate continues the branch in its sequence (sequence 0 stays the
                    # committed text, so the root's gets a fork); a split forks the parent's path.
                    seq = br.seq if j == 0 and br.seq != 0 else scratch.fork(br.seq)
                    grown.append((drafted.add(t, br.leaf, base_logp + lp), seq))
            if not grown or depth == max_depth or len(drafted) >= cfg.drafted_nodes:
                break
            rows = yield from self._decode(len(context), drafted, grown)
            live = [_Branch(i, seq, run.logits(self.draft, row, drafted.path(i), drafter=True))
                    for (i, seq), row in zip(grown, rows)]
        scratch.release()
        return drafted.build()

    # -- selection: the same for both shapes -------------------------------

    def _select(self, drafted: TokenTree, draft_forwards: int) -> TokenTree:
        """The best M nodes by cumulative probability (ties towards shallower ones; a node whose parent is left
        out goes too). Both shapes draft depth by depth, so the kept nodes stay in depth order."""
        order = sorted(range(len(drafted)), key=lambda i: (-drafted.weights[i], drafted.depth[i]))
        m = self._auto_budget(drafted, draft_forwards) if self.config.auto else int(self.config.nodes)
        return drafted.subset(order[:m])

    def _auto_budget(self, drafted: TokenTree, draft_forwards: int) -> int:
        """M from the device's cost curve: the size of the subtree worth most tokens per unit of target time
        (backends.pricing.best_subtree at the tree's own rate), within the curve measured, then within
        the config's bound."""
        if self.cost is None:  # no room to measure: verify what a fixed default would
            return min(TreeConfig.nodes, self.config.max_nodes)  # type: ignore[type-var]
        batch, drafting = self.cost.batch, draft_forwards * self.cost.draft  # drafting is spent either way
        priced = best_subtree(drafted, [math.exp(w) for w in drafted.weights],
                              lambda n: drafting + batch.relative(n + 1), max_nodes=len(batch.seconds) - 1)
        return min(len(priced.nodes), self.config.max_nodes)

    def _draft_tree(self, run: Run, max_depth: int) -> Generator[Decode, list[int], tuple[TokenTree, int]]:
        """The verified tree of this step, and how many nodes were drafted to choose it from."""
        before = self.draft_forwards
        draft = self._draft_static if self.config.shape == "static" else self._draft_dynamic
        drafted = yield from draft(run, max_depth)
        return self._select(drafted, self.draft_forwards - before), len(drafted)

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        target = self.target
        run = Run(self.name, target.model, params, prompt, min(target.n_ctx, self.draft.n_ctx))
        totals = {"tree_nodes": 0, "tree_depth": 0, "tree_leaves": 0, "batch_tokens": 0, "drafted_nodes": 0}
        self.draft_forwards = 0

        def prefill() -> Generator[Decode, list[int], int]:
            yield from self.draft.syncing(prompt[:-1], logits=False)
            cached = yield from target.syncing(prompt[:-1], logits=False)
            if self.config.auto and self.cost is None:
                # After a real context, on this device; appends cells and removes them (backends.device_cost).
                self.cost = self.device_cost()
            return cached

        def tree_step() -> Iterator[object]:
            depth = self.draft.max_depth(min(self.config.depth, run.room() - 1))  # chained MTP heads
            tree, drafted = yield from self._draft_tree(run, depth)
            v = yield from verify_tree(run, target, tree, self.draft.label, "tree")
            totals["batch_tokens"] += v.nodes + 1
            totals["tree_nodes"] += v.nodes
            totals["drafted_nodes"] += drafted
            totals["tree_leaves"] += v.leaves
            totals["tree_depth"] += v.depth

        def step() -> Iterator[object]:
            # A step needs a cell for every drafted node (target and draft caches), not only the depth.
            if (yield from forced_step(run, target)):
                pass
            elif run.room() < 2 or len(run.context) + max(self.config.drafted_nodes, self.config.depth) + 1 > run.n_ctx:
                totals["batch_tokens"] += 1
                yield from chain_step(run, target, [], None)
            else:
                yield from tree_step()

        def figures() -> dict[str, object]:
            steps = max(run.forwards, 1)
            return dict(
                batch_tokens=totals["batch_tokens"],
                draft_forwards=self.draft_forwards,
                mean_tree_nodes=round(totals["tree_nodes"] / steps, 3),  # M, chosen per step with nodes="auto"
                mean_drafted_nodes=round(totals["drafted_nodes"] / steps, 3),
                mean_tree_depth=round(totals["tree_depth"] / steps, 3),
                mean_tree_leaves=round(totals["tree_leaves"] / steps, 3),  # root-to-leaf paths: branches
                mean_accepted_path=round(run.accepted / steps, 3),
            )

        run.report(figures)

        return drive(run, prefill, step, should_stop)
