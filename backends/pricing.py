"""What speculation is worth on a device's cost curve: a chain's speedup, and which subtree of a token tree
pays for its batch rows (one rule for `tree` and for `auto`).

A chain (Leviathan et al. 2023, section 3.4): K drafts each accepted with
probability alpha yield (1 - alpha^(K+1)) / (1 - alpha) tokens per target
pass, and the step costs K c + T(K+1)/T(1) target steps for a draft of
relative cost c (`chain_speedup`; `bench` shows what these predict).

A tree:

A node is accepted with the chance of its whole path (its `reach`), and
verifying a set of nodes yields 1 + the sum of their reaches tokens (at most
one node per position is accepted: EAGLE-2's estimate of the acceptance
length, Li et al. 2024, section 4.2). A node's reach is at most its parent's,
so taking nodes by decreasing reach (parents first among equals) builds a
tree at every size: EAGLE-2's rerank, and Sequoia's and SpecInfer's dynamic
trees likewise. Of those sizes, the one worth most wins.

Worth most is measured by tokens per unit of cost. With N(S) the expected
tokens of a set S and D(S) > 0 its cost (seconds, or target steps),
Dinkelbach's transform (Dinkelbach 1967, "On nonlinear fractional
programming") prices S at a rate r as N(S) - r D(S). Let r* be the best
ratio, max_S N(S)/D(S). Then for every S

    N(S) - r* D(S) = D(S) (N(S)/D(S) - r*) <= 0,

with equality exactly where N(S)/D(S) = r*: maximising Dinkelbach's value at
the optimum rate is maximising the ratio, and its maximum is 0. So one
function serves both strategies. `auto` prices at the throughput its steps
keep (`rate`: a step worth more than keeping the rate raises it, which is
Dinkelbach's iteration run over the generation) and adds other options
(a draft chain, lookahead) priced at the same rate. `tree` has no other
option to weigh against and prices its tree at the rate the tree itself
reaches (`rate=None`: the ratio is maximised directly, which is the same
choice, without the rounding of a rate computed first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from backends.device_cost import BatchCost
from backends.token_tree import TokenTree

UNBOUNDED = 1 << 30


@dataclass(frozen=True)
class Priced:
    """A set of nodes (ascending), its expected tokens and its cost."""

    nodes: tuple[int, ...]
    tokens: float
    cost: float

    def __post_init__(self) -> None:
        if self.cost < 0 or self.tokens < 0:
            raise ValueError(f"a step's tokens and cost are not negative, got {self.tokens} and {self.cost}")

    @property
    def ratio(self) -> float:
        return self.tokens / self.cost

    def value(self, rate: float) -> float:
        """Dinkelbach's worth at `rate`: positive against a step that merely keeps the rate."""
        return self.tokens - rate * self.cost


def path_reach(tree: TokenTree, accept: Sequence[float]) -> list[float]:
    """Each node's chance of being accepted, from `accept[i]`, its chance once its parent is accepted: the
    product along its path. At most one child of a node is accepted (greedy: the argmax; sampling: one
    winner of the multi-candidate rule), so siblings whose chances add up to more than 1 are scaled down to
    sum to 1."""
    sums: dict[int, float] = {}
    for i, p in enumerate(tree.parents):
        sums[p] = sums.get(p, 0.0) + accept[i]
    reach = [0.0] * len(tree)
    for i, p in enumerate(tree.parents):
        reach[i] = accept[i] / max(sums[p], 1.0) * (reach[p] if p >= 0 else 1.0)
    return reach


def best_subtree(tree: TokenTree, reach: Sequence[float], cost: Callable[[int], float], rate: float | None = None,
                 max_leaves: int = UNBOUNDED, max_nodes: int = UNBOUNDED) -> Priced:
    """The nodes of `tree` worth verifying in one batch, with their expected tokens and cost.

    `reach[i]` is node i's chance of acceptance (`path_reach`; a drafter's
    cumulative probability), `cost(n)` what a step verifying n nodes costs
    (cost(0): a plain step). The sets tried take the nodes by decreasing
    reach, ties by index; one is the best of its size when reach falls along
    every path. `max_leaves` bounds the root-to-leaf paths (one sequence id
    each; 1: the best chain), `max_nodes` the nodes. With a `rate`, the set
    of highest Dinkelbach worth tokens - rate x cost wins; without, the set
    of highest tokens / cost (the module docstring: the same choice at the
    optimum rate). Ties go to the smaller set.
    """
    plain = cost(0)
    if rate is None and plain <= 0:
        raise ValueError("tokens per unit of cost need a positive cost")

    def worth(tokens: float, spent: float) -> float:
        return tokens / spent if rate is None else tokens - rate * spent

    chosen: set[int] = set()
    kids = [0] * len(tree)
    # Expected tokens, summed as each rule always summed them, so that their choices stay bit for bit: with a
    # rate (auto) a running 1 + r1 + r2 ..., without (tree) the reaches first, then the 1.
    leaves, added, running = 0, 0.0, 1.0
    best = Priced((), 1.0, plain)
    best_worth = worth(best.tokens, best.cost)
    for i in sorted(range(len(tree)), key=lambda j: (-reach[j], j)):
        if len(chosen) >= max_nodes:
            break
        p = tree.parents[i]
        if p >= 0 and p not in chosen:
            continue  # its parent was left out for the leaf bound
        grows = p < 0 or kids[p] > 0  # a new path, else it extends its parent's
        if grows and leaves >= max_leaves:
            continue
        chosen.add(i)
        leaves += grows
        if p >= 0:
            kids[p] += 1
        added += reach[i]
        running += reach[i]
        tokens, spent = (1.0 + added) if rate is None else running, cost(len(chosen))
        if worth(tokens, spent) > best_worth:
            best, best_worth = Priced(tuple(sorted(chosen)), tokens, spent), worth(tokens, spent)
    return best


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per forward for a chain of k drafts each accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def chain_speedup(alpha: float, k: int, draft_cost: float, cost: BatchCost) -> float:
    return expected_tokens(alpha, k) / (k * draft_cost + cost.relative(k + 1))


def best_chain_speedup(alpha: float, draft_cost: float, cost: BatchCost, k_max: int = 16) -> tuple[float, int]:
    """The best speedup any fixed K can reach, and that K."""
    return max((chain_speedup(alpha, k, draft_cost, cost), k) for k in range(1, min(k_max, len(cost.seconds) - 1) + 1))


def predicted_speedup(tokens_per_forward: float, drafts_per_forward: float, batch_per_forward: float,
                      draft_cost: float, cost: BatchCost) -> float:
    """Speedup if llama.cpp's decodes were the only cost, from a run's measured averages."""
    return tokens_per_forward / (drafts_per_forward * draft_cost + cost.relative(batch_per_forward))
