"""A lane's batch cost curve T(rows), kept current from every decode the lane runs.

The device's cost is measured once per model files, threads and build
(backends.device_cost) and cached for a month. What a decode costs moves
after that: another program takes a core, the laptop throttles or leaves
battery saving, the context grows (attention reads every cell), the batch
holds other sequences' rows. vLLM's SmartSpec (arXiv 2406.14066) prices
speculation with a cost model refreshed from the running system; this is
that model for llama.cpp's lanes (backends.kv.Lane): every decode whose rows
all want logits (a plain step, a verification, a draft decode, a batch of
them: the shapes speculation is priced by; a prompt chunk is none of them)
is an observation (rows, seconds), and the measured curve only seeds it.

The model is the seed's shape moved by what is seen, in log seconds:
    log T(k) = log seed(k) + offset(k)
Each batch size's offset follows its own decodes, each reading's residual
clipped to +-CLIP before it moves it by RATE: one stall (a page fault, the
collector, a busy core for 50 ms) moves it by at most RATE * CLIP, while a
machine that really slows by half is followed within a few dozen decodes
(a second of decoding). The clipped update is an online median: outliers,
which only ever add time, pull it no more than any other reading. A batch
size seldom or never decoded takes the level, the mean offset of the sizes
decoded lately (weighted by their decayed counts), blended with its own as
far as it has readings of its own: a core taken by another program shows at
every batch size, and those not decoded lately follow the others.

A draft's lane moves with the target's (`follows`): its offsets are kept
relative to the target lane's level, since what slows one (another program
on a core, a longer context) slows the other. A draft seldom used otherwise
kept the time it was last seen at while the target's curve rose with a busy
core beside it, and a draft as costly as the target read 0.35-0.7 of it: a
draft that could never pay was priced as if it could, and drafted. What
the draft's own decodes show beyond that ratio is learnt as before.

Sequences are not a second axis: at equal rows, more sequences read more
cells (each row attends its own sequence's), which is what the level
follows as contexts grow; the curve is read as ratios T(a)/T(b) of one
moment (backends.strategies.auto.costs), in which the level cancels.

What a process learnt is kept for the next one on the same files and machine
(backends.slot.Learnt, under "live:target" and "live:draft"): each size's
offset and decayed count (the level is theirs), with the seed they move as a
fingerprint, since an offset means nothing against another measurement. A
new process adopts them when its lane is seeded with the same curve
(`earlier`), so under load it does not spend its first seconds relearning.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Callable, Sequence

from backends.device_cost import BatchCost

# A reading's log residual is clipped to +-CLIP (a factor of 1.65) before it moves its batch size's offset by RATE.
CLIP = 0.5
RATE = 0.15
# Per reading, every batch size's count of readings decays by this factor (about 50 recent readings count).
DECAY = 0.98
# A batch size's own offset counts as far as its decayed count of readings, against this weight of the level.
LEVEL_WEIGHT = 1.0
# What a process kept is taken by the next for a week at most. The offsets describe the machine as it was used
# (other programs, its power profile, the contexts it served): a state from the last days of use, a weekend
# between, starts closer than the seed, and learning follows a change within a few dozen decodes anyway; an
# older one is from a way of using the machine that has likely changed (the seed itself is kept a month).
KEPT_FOR = 7 * 24 * 3600.0
FORMAT = 2  # 2: a lane that follows another keeps offsets relative to its level
# An offset beyond this (a factor of e^10) is no reading of a machine: such an entry is malformed.
MAX_OFFSET = 10.0


class LiveCurve:
    """T(rows) in seconds for one lane: a seed curve moved by every observed decode; None until seeded."""

    def __init__(self) -> None:
        self._seed: tuple[float, ...] = ()
        self._log_seed: list[float] = []
        self.observed = 0  # readings taken (within the seed's rows)
        self._curve: BatchCost | None = None  # the last curve handed out, until the next reading (of either)
        self._curve_at = -1  # the followed lane's `changes` when it was built
        self.changes = 0  # readings, seeds and restores taken: what a lane following this one rebuilds on
        # The lane whose level this one moves with (a draft's: the target's; never itself), or None.
        self.follows: LiveCurve | None = None
        # What an earlier process kept of this lane (to_json), asked for whenever a new seed comes (Learnt).
        self.earlier: Callable[[], object] | None = None
        self._reset(0)

    def _reset(self, n: int) -> None:
        self.changes += 1
        self._offset = [0.0] * n
        self._weight = [0.0] * n  # decayed counts of readings, as of reading _at[k]
        self._at = [0] * n
        # The level's sums, sum(w_k * offset_k) and sum(w_k), decayed as the counts are.
        self._sum_wo = self._sum_w = 0.0
        self.observed = 0
        self._curve = None

    @property
    def seeded(self) -> bool:
        return bool(self._seed)

    @property
    def level(self) -> float:
        """The offset of the batch sizes decoded lately, in log seconds (0 before any reading)."""
        return self._sum_wo / self._sum_w if self._sum_w > 1e-9 else 0.0

    def seed(self, seconds: Sequence[float]) -> None:
        """Start from a measured curve (seconds for 1..n rows); the same curve again keeps what was learnt, a
        new one (a measurement after this one) starts over from it."""
        seconds = tuple(float(s) for s in seconds)
        if seconds == self._seed:
            return
        if not seconds or min(seconds) <= 0:
            raise ValueError("a seed curve needs positive times")
        self._seed = seconds
        self._log_seed = [math.log(s) for s in seconds]
        self._reset(len(seconds))
        if self.earlier is not None:
            self.restore(self.earlier())

    def _base(self) -> float:
        """The followed lane's level, which this one's offsets are relative to (0 following none)."""
        return self.follows.level if self.follows is not None else 0.0

    def _own(self, i: int) -> tuple[float, float]:
        """Batch size i+1's offset and its decayed count of readings now."""
        return self._offset[i], self._weight[i] * DECAY ** (self.observed - self._at[i])

    def offset(self, i: int) -> float:
        """Batch size i+1's offset: its own, blended with the level as far as it has few readings."""
        own, w = self._own(i)
        return (w * own + LEVEL_WEIGHT * self.level) / (w + LEVEL_WEIGHT)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode of `rows` rows, all with logits, took `seconds`. Beyond the seed's rows, or unseeded:
        nothing to compare it with, so it is not taken."""
        if not 1 <= rows <= len(self._seed) or seconds <= 0:
            return
        i = rows - 1
        own, w = self._own(i)
        before = own if w >= LEVEL_WEIGHT else self.offset(i)  # a size seldom decoded starts from the level's view
        r = max(-CLIP, min(CLIP, math.log(seconds) - self._log_seed[i] - self._base() - before))
        new = before + RATE * r
        self._sum_wo = (self._sum_wo - w * own) * DECAY + (w + 1.0) * DECAY * new
        self._sum_w = (self._sum_w - w) * DECAY + (w + 1.0) * DECAY
        self.observed += 1
        self._offset[i], self._weight[i], self._at[i] = new, (w + 1.0) * DECAY, self.observed
        self.changes += 1
        self._curve = None

    def seconds(self, rows: int) -> float:
        """The predicted seconds of a decode of `rows` rows (1 <= rows <= the seed's length)."""
        return math.exp(self._log_seed[rows - 1] + self._base() + self.offset(rows - 1))

    def curve(self) -> BatchCost | None:
        """The curve as now known, or None unseeded. Non-decreasing, by prefix maxima: a bigger batch never
        costs less than a smaller one, and a size read dearer than measured raises the sizes above it that were
        read less (the measured curve takes suffix minima instead: its readings are minima of a few repeats,
        where these are medians of many)."""
        if not self._seed:
            return None
        at = self.follows.changes if self.follows is not None else 0
        if self._curve is None or self._curve_at != at:  # rebuilt after each reading (of either): inlined `seconds`
            level, observed, base, out, top = self.level, self.observed, self._base(), [], 0.0
            for log_seed, own, weight, at_i in zip(self._log_seed, self._offset, self._weight, self._at):
                w = weight * DECAY ** (observed - at_i)
                top = max(top, math.exp(log_seed + base + (w * own + LEVEL_WEIGHT * level) / (w + LEVEL_WEIGHT)))
                out.append(top)
            self._curve, self._curve_at = BatchCost(tuple(out)), at
        return self._curve

    # -- kept between processes (backends.slot.Learnt) ---------------------------------------------------------------

    def _fingerprint(self) -> str:
        return hashlib.sha256(repr(self._seed).encode()).hexdigest()[:16]

    def to_json(self, now: float | None = None) -> dict | None:
        """What was learnt, for a later process: each batch size's offset and its decayed count of readings
        now (the level is theirs), against the seed's fingerprint; None unseeded. A few hundred bytes."""
        if not self._seed:
            return None
        own = [self._own(i) for i in range(len(self._seed))]
        return {"format": FORMAT, "saved_at": time.time() if now is None else now, "seed": self._fingerprint(),
                "offset": [round(o, 4) for o, _ in own], "weight": [round(w, 3) for _, w in own]}

    def restore(self, data: object, now: float | None = None) -> bool:
        """Take up what `to_json` kept of this same seed, as if its readings had been taken here; False, with
        nothing changed, for another seed or format, an entry older than KEPT_FOR, or anything malformed."""
        if not self._seed or not isinstance(data, dict) or data.get("format") != FORMAT \
                or data.get("seed") != self._fingerprint():
            return False
        n = len(self._seed)
        try:
            age = (time.time() if now is None else now) - float(data["saved_at"])
            offset = [float(x) for x in data["offset"]]
            weight = [float(x) for x in data["weight"]]
        except (KeyError, TypeError, ValueError):
            return False
        if not abs(age) <= KEPT_FOR or len(offset) != n or len(weight) != n \
                or not all(abs(o) <= MAX_OFFSET for o in offset) or not all(0 <= w <= 1 / (1 - DECAY) for w in weight):
            return False  # (NaNs fail every comparison, so they land here too)
        self._reset(n)
        self._offset, self._weight = offset, weight
        self._sum_w = sum(weight)
        self._sum_wo = sum(w * o for w, o in zip(weight, offset))
        return True
