"""What `auto` learns and keeps: acceptance estimates, timings, and their JSON form between sessions.

The estimates (`Acceptance`: Beta-Bernoulli counts with a prior, decayed), the
running means of what steps yield and cost (`Ewma`), the curve's correction
(`Calibration`) and the whole learnt state of one sampling mode (`AutoState`,
kept by the engine's Learnt store). backends.strategies.auto explains how
they are used.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field, fields
from typing import Callable

from backends.sampling import GenParams
from backends.strategies.auto.proposals import LOOKUP_SOURCE

# The speculation memory's proposals are learnt by the share of earlier occurrences that went their way, in
# this many bins (backends.memory: a continuation every earlier occurrence took is likelier than a split one).
SHARE_BINS = 5
CONFIDENCE_BINS = 10
MAX_POSITION = 12
# Lookup positions past this share one estimate: the first proposals decide whether a lookup starts.
LOOKUP_POSITIONS = 3
# Lookup's match length is counted up to this many tokens past the n-gram, and learnt in these bins: a
# rewrite that copies its source matches 10 or 16 tokens back, an answer quoting a phrase of the question
# 3 or 4, and their acceptance differs as much (pooled, the copying steps made the quoting ones look good).
MATCH_EXTEND = 16
MATCH_BINS = (1, 2, 3, 4, 6, 10, 16)


class Acceptance:
    """Chance that a proposed token is accepted, per key: Beta-Bernoulli counts with a prior, decayed.

    `prior(key)` gives the prior mean; `weight` is how many observations it is
    worth; `decay` < 1 forgets old observations (about 1/(1-decay) of them count).
    """

    def __init__(self, prior: Callable[[object], float], weight: float = 2.0, decay: float = 0.995) -> None:
        self.prior = prior
        self.weight = weight
        self.decay = decay
        self._counts: dict[object, list[float]] = {}

    def p(self, key: object) -> float:
        c = self._counts.get(key)
        prior = self.prior(key)
        if c is None:
            return prior
        return (c[0] + self.weight * prior) / (c[0] + c[1] + self.weight)

    def update(self, key: object, accepted: bool) -> None:
        c = self._counts.setdefault(key, [0.0, 0.0])
        c[0] *= self.decay
        c[1] *= self.decay
        c[0 if accepted else 1] += 1.0

    def counts(self) -> list[list[object]]:
        """The counts as JSON: [key (a list for a tuple key), accepted, refused] each."""
        return [[list(k) if isinstance(k, tuple) else k, a, r] for k, (a, r) in self._counts.items()]

    def load(self, counts: list[list[object]]) -> None:
        """Counts as `counts` gives them."""
        loaded: dict[object, list[float]] = {}
        for key, a, r in counts:
            k = tuple(int(x) for x in key) if isinstance(key, list) else int(key)  # type: ignore[arg-type]
            loaded[k] = [_finite(a), _finite(r)]
            if min(loaded[k]) < 0:
                raise ValueError("a negative count")
        self._counts = loaded


@dataclass
class Ewma:
    """Exponentially weighted mean; `value` is None until the first observation unless seeded.

    The n-th observation weighs max(alpha, 1/n): the plain mean while there are
    few, so that one lucky or unlucky first step does not steer for the next
    1/alpha steps, then the exponential forgetting that follows the text.
    """

    alpha: float
    value: float | None = None
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        weight = max(self.alpha, 1.0 / self.n)
        self.value = x if self.value is None else self.value + weight * (x - self.value)

    def seed(self, x: float) -> None:
        """Start from a prediction worth one observation."""
        self.value, self.n = x, 1

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


def confidence_bin(c: float) -> int:
    return min(int(c * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)


def match_bin(match: int) -> int:
    """The bin of MATCH_BINS a match length is learnt in: the longest bin it reaches."""
    return MATCH_BINS[bisect.bisect_right(MATCH_BINS, max(match, 1)) - 1]


def lookup_key(match: int, position: int) -> tuple[int, int]:
    """The estimate a lookup proposal at `position` (0-based) after a `match`-token match is learnt under."""
    return match_bin(match), min(position, LOOKUP_POSITIONS)


def lookup_acceptance(first: float = 0.15, longest: float = 0.6) -> Acceptance:
    """Lookup's acceptance by (match length, position).

    The first position's prior is `first` after a 1-token match, as most text
    does not repeat itself, and doubles with each further matched token (up to
    `longest`): a longer match is likelier to go on, and a prior that is too
    low is never corrected, because an option estimated worse is only tried
    once per MIN_EXPLORE_INTERVAL steps, while one tried on an optimistic prior
    is learnt from at once. A later position borrows the estimate of the one
    before it as its prior: a copy accepted so far tends to go on (repetition
    runs in streaks), and with a fixed low prior the positions past the first
    tries would never be verified, so never learnt, and chains would stay as
    short as first tried.
    """
    def prior(key: object) -> float:
        match, position = key  # type: ignore[misc]
        if position == 0:
            return min(first * 2 ** max(match - 1, 0), longest)
        return acc.p((match, position - 1))

    acc = Acceptance(prior)
    return acc


def memory_key(match: int, share: float, position: int) -> tuple[int, int, int]:
    """The estimate a proposal of the speculation memory is learnt under: match length bin, share bin, position."""
    return (match_bin(match), min(int(share * SHARE_BINS), SHARE_BINS - 1),
            min(position, LOOKUP_POSITIONS))


def memory_acceptance() -> Acceptance:
    """The memory's acceptance by (match, share, position): the first position's prior is the share itself (as
    often as earlier text went this way), halved after a one-token match; later positions borrow the one
    before them, as lookup's do."""
    def prior(key: object) -> float:
        match, share, position = key  # type: ignore[misc]
        if position == 0:
            return min((share + 0.5) / SHARE_BINS * (0.5 if match <= 1 else 1.0), 0.95)
        return acc.p((match, share, position - 1))

    acc = Acceptance(prior)
    return acc


def sampling_mode(params: GenParams) -> str:
    """Which of an engine's learnt states a generation uses: "greedy" or "sampled". Acceptance differs most
    between them (a draft can pay greedy and lose when sampling), so each learns its own: runs at 0.8 that
    started from a state learnt greedily were slower than from one learnt at 0.8 (docs/results.md, "Figures
    behind design choices"; tests/perf/auto_kept.py modes). A thinking model's thinking (backends.reasoning's
    first phase) learns apart from its answers too: long, self-repeating text that quotes the question, where
    lookups and the memory pay unlike in an answer ("greedy.reasoning", "sampled.reasoning")."""
    mode = "greedy" if params.greedy else "sampled"
    return f"{mode}.reasoning" if params.reasoning_phase else mode


@dataclass
class AutoState:
    """What `auto` has learnt on one engine in one sampling mode: kept across turns and requests (Learnt.session)
    and between sessions (Learnt.keep)."""

    # Draft: by confidence bin (prior: the confidence itself, a calibrated draft) and by position.
    draft_by_conf: Acceptance = field(default_factory=lambda: Acceptance(
        lambda b: (b + 0.5) / CONFIDENCE_BINS))  # type: ignore[operator]
    draft_by_pos: Acceptance = field(default_factory=lambda: Acceptance(lambda _k: 0.5))
    # Lookup: by (match length, position).
    lookup: Acceptance = field(default_factory=lambda: lookup_acceptance())
    # The speculation memory: by (match length, share of earlier occurrences, position).
    memory: Acceptance = field(default_factory=lambda: memory_acceptance())
    # What a lookahead step and a draft step (drafting with its stopping rule, then verifying) really
    # yield, and cost in plain steps: measured against the plain step's time of the moment, so that a
    # busy machine, which slows every kind of step alike, does not tilt the comparison.
    lookahead_tokens: Ewma = field(default_factory=lambda: Ewma(0.1))
    lookahead_cost: Ewma = field(default_factory=lambda: Ewma(0.1))
    draft_step_tokens: Ewma = field(default_factory=lambda: Ewma(0.1))
    draft_step_cost: Ewma = field(default_factory=lambda: Ewma(0.1))
    # Seconds: a plain step; one draft decode.
    t_plain: Ewma = field(default_factory=lambda: Ewma(0.1))
    t_draft: Ewma = field(default_factory=lambda: Ewma(0.1))
    # The measured curve's error: the extra time (in plain steps, beyond one) that verification batches really
    # took, against what the curve predicted for them, as a ratio of decayed sums (see Calibration).
    batch_scale: "Calibration" = field(default_factory=lambda: Calibration(prior=2.0, decay=0.98))
    # Seconds per token for the draft to catch up on tokens decoded while it stood by (a batched decode).
    catch_up: Ewma = field(default_factory=lambda: Ewma(0.1))
    # Throughput reached: EWMA of tokens and of seconds per step.
    tokens: Ewma = field(default_factory=lambda: Ewma(0.02))
    seconds: Ewma = field(default_factory=lambda: Ewma(0.02))
    since: dict[str, int] = field(default_factory=dict)  # steps since each option was last taken
    taken: dict[str, int] = field(default_factory=dict)  # steps each option was taken, ever
    # Steady tries of each option since it was last chosen on its estimate (explore_interval's back-off), and
    # the temperature they were made at: a new one starts the back-off over.
    backoff: dict[str, int] = field(default_factory=dict)
    temperature: float | None = None
    # False: keep the times the device cost gave and learn only acceptance (tests pin a synthetic device so).
    learn_timing: bool = True

    def estimates(self, source: str) -> Acceptance:
        """The acceptance estimates a candidate node of `source` (proposals' LOOKUP_SOURCE or MEMORY_SOURCE)
        is judged and learnt under."""
        return self.lookup if source == LOOKUP_SOURCE else self.memory

    # Kept between sessions (Learnt.keep), so that a new one, or a one-off `specchat run`, does not pay
    # the first tries again: short runs that start from nothing spend a large share of their steps trying
    # options (docs/results.md, "Figures behind design choices"). `since` is of this session (a new one
    # waits a full interval before its first try); `learn_timing` is a setting, not learnt.
    NOT_KEPT = ("since", "learn_timing")
    # What the keys of the estimates mean: state kept under other bins starts afresh.
    FORMAT = [1, CONFIDENCE_BINS, MAX_POSITION, list(MATCH_BINS), LOOKUP_POSITIONS]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"format": self.FORMAT, "saved_at": time.time()}
        for f in fields(self):
            if f.name in self.NOT_KEPT:
                continue
            v = getattr(self, f.name)
            if isinstance(v, Acceptance):
                out[f.name] = v.counts()
            elif isinstance(v, Ewma):
                out[f.name] = [v.value, v.n]
            elif isinstance(v, Calibration):
                out[f.name] = [v.real, v.predicted]
            else:
                out[f.name] = v
        return out

    @classmethod
    def from_json(cls, data: dict | None) -> "AutoState":
        """The state `to_json` kept; a new one for None, another format or anything malformed."""
        state = cls()
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            return state
        try:
            for f in fields(state):
                if f.name in cls.NOT_KEPT or f.name not in data:
                    continue
                v, current = data[f.name], getattr(state, f.name)
                if isinstance(current, Acceptance):
                    current.load(v)
                elif isinstance(current, Ewma):
                    value, n = v
                    current.value, current.n = (None if value is None else _finite(value)), int(n)
                elif isinstance(current, Calibration):
                    current.real, current.predicted = _finite(v[0]), _finite(v[1])
                elif isinstance(current, dict):
                    setattr(state, f.name, {str(k): int(n) for k, n in v.items()})
                else:  # the temperature
                    setattr(state, f.name, None if v is None else float(v))
        except (TypeError, ValueError, AttributeError):
            return cls()
        return state


def _finite(x: object) -> float:
    v = float(x)  # type: ignore[arg-type]
    if not math.isfinite(v):
        raise ValueError("not a finite number")
    return v


@dataclass
class Calibration:
    """How far a prediction can be trusted: what really came, against what was predicted, over the last
    observations. For lookup's counts in this answer: the extra tokens (beyond the one every step gives) its
    lookup steps gave, against what the counts predicted; for the batch cost curve: the extra time (beyond a
    plain step) verification batches took, against what the curve predicted.

    The ratio of decayed sums, each with `prior` added, so that it starts at 1 and moves by evidence in the
    predicted unit: one lookup that promised 6 extra tokens and gave none takes it to 2/8, while one that
    promised 0.5 and gave none only to 2/2.5. `decay` per observation follows the text (or the machine).
    """

    prior: float = 2.0
    decay: float = 0.9
    real: float = 0.0
    predicted: float = 0.0

    def add(self, real: float, predicted: float) -> None:
        self.real = self.real * self.decay + real
        self.predicted = self.predicted * self.decay + predicted

    def factor(self) -> float:
        return (self.real + self.prior) / (self.predicted + self.prior)
