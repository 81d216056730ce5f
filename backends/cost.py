"""The device's cost model for speculation: what a batch of k tokens costs
relative to one, and the speedup that implies.

Speculation pays only when verifying k tokens costs little more than one
(Leviathan et al. 2023, section 3.4: the expected improvement factor is
(1 - alpha^(K+1)) / ((1 - alpha) (K c + T(K+1)/T(1))) for a draft of relative
cost c and per-token acceptance alpha). The curve is measured on the user's
device, with logits on every row as verification needs them.

For a token tree the same ratio holds with EAGLE-2's estimate of the expected
acceptance length (Li et al. 2024, section 4.2: 1 + the sum of the kept nodes'
cumulative draft probabilities) in the numerator and T(M+1)/T(1) for a tree of
M nodes (`best_tree_size`).
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

from backends.kv import KvSequence


@dataclass(frozen=True)
class BatchCost:
    """seconds[k-1]: median time to decode k tokens (logits on all) after a fixed context."""

    seconds: tuple[float, ...]

    def relative(self, k: float) -> float:
        """T(k)/T(1), linearly interpolated for fractional k (a mean batch size)."""
        if k <= 1:
            return 1.0
        k = min(k, len(self.seconds))
        lo = int(k)
        hi = min(lo + 1, len(self.seconds))
        t = self.seconds[lo - 1] + (self.seconds[hi - 1] - self.seconds[lo - 1]) * (k - lo)
        return t / self.seconds[0]

    def as_list(self) -> list[float]:
        return [round(self.relative(k), 4) for k in range(1, len(self.seconds) + 1)]


def measure_batch_cost(seq: KvSequence, context: Sequence[int], k_max: int = 32, repeats: int = 3) -> BatchCost:
    """Time batches of 1..k_max tokens decoded after `context` (the cache is restored after each)."""
    seq.sync(context, logits=False)
    base = len(seq.tokens)
    filler = list(context[-1:]) or [0]
    out = []
    for k in range(1, k_max + 1):
        times = []
        for _ in range(repeats):
            seq.truncate(base)
            t0 = time.perf_counter()
            seq.extend(filler * k, logits="all")
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    seq.truncate(base)
    return BatchCost(tuple(out))


@dataclass(frozen=True)
class DeviceCost:
    """The target's batch cost curve and one draft token's cost in target tokens (0 without a draft)."""

    batch: BatchCost
    draft: float


def measure_device_cost(
    target: KvSequence, draft: KvSequence | None, context: Sequence[int], k_max: int, repeats: int = 3
) -> DeviceCost:
    """Both caches end up holding `context` (what each held beyond it is gone)."""
    batch = measure_batch_cost(target, context, k_max, repeats)
    draft_cost = 0.0
    if draft is not None:
        draft_cost = measure_batch_cost(draft, context, 1, repeats=max(repeats, 5)).seconds[0] / batch.seconds[0]
    return DeviceCost(batch, draft_cost)


# One measurement per target context (an engine's strategies share it), with the draft it was paired with.
_MEASURED: "weakref.WeakKeyDictionary[KvSequence, tuple[weakref.ref[KvSequence], DeviceCost]]" = \
    weakref.WeakKeyDictionary()


def cached_device_cost(target: KvSequence, draft: KvSequence, k_max: int = 16, repeats: int = 2) -> DeviceCost | None:
    """The device's costs, measured on first use after what the target's cache holds, which it holds again after.

    Cheap by design (k up to 16, 2 repeats) because it runs inside the first
    generation. Measuring only appends cells to the target's sequence 0 and
    removes them, so the cache and its invariants are as before; the draft's
    cache is synced to the same tokens (a strategy's prefill leaves both at
    prompt[:-1], so that decodes nothing). None when the context has no room
    for a batch of 2 (too little to compare); the next call tries again.
    """
    hit = _MEASURED.get(target)
    if hit is not None and hit[0]() is draft:
        return hit[1]
    context = list(target.tokens)
    k_max = min(k_max, target.n_ctx - len(context), target.batch.capacity)
    if k_max < 2:
        return None
    cost = measure_device_cost(target, draft, context, k_max, repeats)
    _MEASURED[target] = (weakref.ref(draft), cost)
    return cost


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


def tree_speedup(path_probs: Sequence[float], m: int, draft_forwards: int, draft_cost: float,
                 cost: BatchCost) -> float:
    """Expected tokens per unit of target time for a tree of the first m nodes (see best_tree_size)."""
    return (1.0 + sum(path_probs[:m])) / (draft_forwards * draft_cost + cost.relative(m + 1))


def best_tree_size(path_probs: Sequence[float], draft_forwards: int, draft_cost: float, cost: BatchCost) -> int:
    """How many of the nodes, best first, to verify: the M that maximizes tree_speedup.

    `path_probs` are the nodes' cumulative draft probabilities in decreasing
    order (EAGLE-2's rerank), so every prefix is a tree and 1 + sum(prefix) is
    the expected number of tokens the step yields; the step costs the draft
    forwards already spent plus the target batch of M+1 rows. Maximizing the
    ratio is the marginal rule "add a node while its probability exceeds the
    extra batch time it costs, priced at the step's current tokens per unit
    time". M never exceeds the measured curve (no extrapolation); ties go to
    the smaller tree. A flat curve keeps every node, a steep one few or none.
    """
    m_max = min(len(path_probs), len(cost.seconds) - 1)
    return max(range(m_max + 1), key=lambda m: (tree_speedup(path_probs, m, draft_forwards, draft_cost, cost), -m))


def predicted_speedup(tokens_per_forward: float, drafts_per_forward: float, batch_per_forward: float,
                      draft_cost: float, cost: BatchCost) -> float:
    """Speedup if llama.cpp's decodes were the only cost, from a run's measured averages."""
    return tokens_per_forward / (drafts_per_forward * draft_cost + cost.relative(batch_per_forward))
