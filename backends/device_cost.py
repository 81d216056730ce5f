"""The device's measured cost for speculation: what a batch of k tokens costs relative to one, and a draft
token against a target step; measured once per model files, threads and build, and kept on disk.

Speculation pays only when verifying k tokens costs little more than one,
and how much more is a property of the device (a batch of 5 costs 1.3x one
token on a memory-bound CPU model, several times more where compute
bounds it). So the curve is measured on the user's device, with logits on
every row as verification needs them, and cached (`CostCache`) so that a new
session does not pay the measurement again. What it implies for a chain or
a tree is backends.pricing's.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from backends.store import MONTH, JsonStore

# How the cost is measured; part of the cache key. 2: the draft's cost timed in turns with the target's.
METHOD = 2

if TYPE_CHECKING:
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


def monotone(seconds: Sequence[float]) -> tuple[float, ...]:
    """The curve made non-decreasing by suffix minima: a bigger batch never costs less than a smaller one,
    so a time above a later one is noise (another process took the core), not the batch's cost."""
    out = list(seconds)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)


def _filler(context: Sequence[int]) -> list[int]:
    """The token a measurement decodes after `context` (its last; its value does not change the cost)."""
    return list(context[-1:]) or [0]


def _timed_decode(seq: KvSequence, tokens: list[int], base: int) -> float:
    """Seconds of one decode of `tokens` (logits on every row, as verification wants them) after the first
    `base` cached tokens; the cache is cut back to them first."""
    seq.truncate(base)
    t0 = time.perf_counter()
    seq.extend(tokens, logits="all")
    return time.perf_counter() - t0


def measure_batch_cost(seq: KvSequence, context: Sequence[int], k_max: int = 32, repeats: int = 3) -> BatchCost:
    """Time batches of 1..k_max tokens decoded after `context` (the cache is restored after each).

    Each k keeps its fastest repeat (interruptions only ever add time) and the
    curve is made non-decreasing (`monotone`), so a busy machine during the
    measurement does not leave spikes that would steer decisions for weeks.
    """
    seq.sync(context, logits=False)
    base = len(seq.tokens)
    filler = _filler(context)
    out = [min(_timed_decode(seq, filler * k, base) for _ in range(repeats)) for k in range(1, k_max + 1)]
    seq.truncate(base)
    return BatchCost(monotone(out))


@dataclass(frozen=True)
class DeviceCost:
    """The target's batch cost curve and one draft token's cost in target tokens (0 without a draft)."""

    batch: BatchCost
    draft: float
    measured_at: float = 0.0  # time.time() of the measurement

    def as_json(self) -> dict[str, object]:
        return {"seconds": list(self.batch.seconds), "draft": self.draft, "measured_at": self.measured_at}

    @classmethod
    def from_json(cls, data: dict) -> "DeviceCost":
        seconds = tuple(float(x) for x in data["seconds"])
        if len(seconds) < 2 or min(seconds) <= 0:
            raise ValueError("a cost curve needs at least two positive times")
        return cls(BatchCost(seconds), float(data["draft"]), float(data.get("measured_at", 0.0)))


def measure_draft_ratio(target: KvSequence, draft: KvSequence, context: Sequence[int], repeats: int = 7) -> float:
    """A draft decode of one token against a target decode of one, timed in turns after `context`: each lane's
    fastest of `repeats` over the same stretch of time. Timed one lane after the other, the two minima came
    from different moments of a machine whose speed moves: a draft file identical to the target's read 0.70
    of it on a quiet 2-core VM, enough for a draft that can never pay to look as if it could."""
    filler = _filler(context)
    lanes = (target, draft)
    bases = []
    for seq in lanes:
        seq.sync(context, logits=False)
        bases.append(len(seq.tokens))
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, seq in enumerate(lanes):
            best[i] = min(best[i], _timed_decode(seq, filler, bases[i]))
    for seq, base in zip(lanes, bases):
        seq.truncate(base)
    return best[1] / best[0]


def measure_device_cost(
    target: KvSequence, draft: KvSequence | None, context: Sequence[int], k_max: int, repeats: int = 3
) -> DeviceCost:
    """Both caches end up holding `context` (what each held beyond it is gone)."""
    batch = measure_batch_cost(target, context, k_max, repeats)
    draft_cost = 0.0 if draft is None else measure_draft_ratio(target, draft, context, repeats=max(repeats, 5) + 2)
    return DeviceCost(batch, draft_cost, time.time())


def file_identity(path: Path | None) -> list[object]:
    """What changes when a model file is replaced: its path, size and modification time."""
    if path is None:
        return []
    path = Path(path)  # (a caller's str)
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def cost_key(target: Path, draft: Path | None, threads: int, build: str, placement: object) -> str:
    """One measurement per (model files, threads, llama.cpp build, where the layers run) and way of measuring
    (METHOD: a measurement taken another way is taken again)."""
    ident = json.dumps([file_identity(target), file_identity(draft), threads, build, placement, METHOD],
                       default=str)
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


class CostCache:
    """Device costs measured before (a backends.store.JsonStore), so a new session's first turn pays no
    calibration; an entry older than `max_age` seconds is measured again."""

    def __init__(self, path: Path | None, max_age: float = MONTH) -> None:
        self.store = JsonStore(path, max_age, stamp="measured_at")

    def get(self, key: str, now: float | None = None) -> DeviceCost | None:
        entry = self.store.get(key, now)
        if entry is None:
            return None
        try:
            return DeviceCost.from_json(entry)
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, cost: DeviceCost | None) -> None:
        """Store `cost` under `key` (None: forget the entry)."""
        self.store.put(key, None if cost is None else cost.as_json())
