"""The device's cost model for speculation: what a batch of k tokens costs
relative to one, and the speedup that implies.

Speculation pays only when verifying k tokens costs little more than one
(Leviathan et al. 2023, section 3.4: the expected improvement factor is
(1 - alpha^(K+1)) / ((1 - alpha) (K c + T(K+1)/T(1))) for a draft of relative
cost c and per-token acceptance alpha). The curve is measured on the user's
device, with logits on every row as verification needs them.
"""

from __future__ import annotations

import statistics
import time
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
