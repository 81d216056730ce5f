"""What a step of `auto` costs here: the device's batch cost curve, the live step times, and the batch load.

The seconds side of the decision (backends.strategies.auto.choose weighs
them against expected tokens). Its inputs:
  - the device's batch cost curve T(k)/T(1) and the draft's cost, measured
    once per model files, threads and build and cached on disk
    (backends.device_cost, Slot.device_cost), which seed
  - each lane's live curve (backends.live_cost, Lane.live): every decode of
    the target's and the draft's lanes, alone or in a batch of many
    sequences, moves it, so a machine that slows down or speeds up, a
    growing context and a full batch are priced as they are now; the
    measured curve seeds it and never has the last word;
  - the live time of a plain step and of a draft decode (`AutoState.t_plain`,
    `t_draft`), learnt from every step this sequence decodes alone;
  - the curve's error: the extra cost beyond one token is scaled by what
    verification batches really took against what the curve predicts (the
    ratio of decayed sums, `AutoState.batch_scale`), which also covers the
    Python work per verified row: a curve measured once in a fast or slow
    spell of a shared machine would otherwise steer every decision for as
    long as it is kept;
  - the batch this sequence decodes in (backends.steps.BatchLoad): beside
    others, a row it adds delays every sequence of the batch, so its extra
    time counts once for each of them (SmartSpec's goodput, arXiv 2406.14066).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from backends.device_cost import BatchCost, DeviceCost
from backends.strategies.auto.state import AutoState, Ewma

if TYPE_CHECKING:
    from backends.slot import Slot

# Under load, an extra row is priced by the curve's slope over at least this many rows from the batch's size
# (curve_relative): a single step of the measured curve may be flat.
LOAD_SLOPE_SPAN = 4
# The least the batch cost curve's extra cost is scaled by (the calibration can approach 0 when verification
# batches keep taking no longer than a plain step, as they may on a GPU): a row is never taken as free.
MIN_CURVE_SCALE = 0.1
# Before a draft decode is measured, it costs this share of a plain step.
DRAFT_PRIOR = 0.5


class CostModel:
    """The seconds a step of one sequence costs, from the measured curve, the live times and the batch load."""

    def __init__(self, state: AutoState, slot: "Slot") -> None:
        self.state = state
        self.slot = slot
        self.seed_curve: BatchCost | None = None  # as measured (what is priced when timing is not learnt)
        self.t1 = 0.0  # the measured T(1), seconds
        self.measured_draft = 0.0  # a draft token's measured cost, in target tokens
        self.own_rows = 1  # rows this sequence put in its last target batch (the others' are the rest of it)

    def seed(self, cost: DeviceCost | None, has_draft: bool) -> None:
        """Start from the device's measured cost (the live times start from it where nothing was learnt yet)."""
        if cost is None:
            return
        self.seed_curve = cost.batch
        self.t1 = cost.batch.seconds[0]
        self.measured_draft = cost.draft
        # The lanes' live curves start from the measurement (the same one again keeps what they learnt); the
        # draft's from its measured cost, shaped as the target's until its own decodes say otherwise.
        self.slot.target.lane.live.seed(cost.batch.seconds)
        if has_draft and self.slot.draft is not None and cost.draft > 0:
            self.slot.draft.lane.live.seed([cost.draft * s for s in cost.batch.seconds])
        st = self.state
        if st.t_plain.value is None:
            st.t_plain.seed(self.t1)
        if st.t_draft.value is None and has_draft:
            st.t_draft.seed(cost.draft * self.t1)

    @property
    def priced(self) -> bool:
        """Whether the device's cost is known (`curve` is not None), without building the live curve: rebuilt
        after every decode's reading, it was most of what a held-back step's Python costs over `ar`'s through the
        same scheduler (18 -> 7 us a token, tests/perf/host_python.py; docs/results.md)."""
        return self.seed_curve is not None

    @property
    def curve(self) -> BatchCost | None:
        """The target's batch cost curve: its lane's live one, or as measured where timing is not learnt."""
        if self.seed_curve is None or not self.state.learn_timing:
            return self.seed_curve
        return self.slot.target.lane.live.curve() or self.seed_curve

    # -- learning ------------------------------------------------------------

    def timing(self) -> bool:
        """Whether what this step takes is learnt: alone only. Beside others, a step's wall time holds their
        rows and prompt chunks too, so the times learnt alone (and the curve) are kept, and only acceptance is
        learnt (a plain step's time swelled with others' prompt chunks would take the curve's correction to
        its floor, and lookups that seldom pay would look worth verifying)."""
        return self.state.learn_timing and self.batch() == (1, 0)

    def learn(self, ewma: Ewma, x: float) -> None:
        """Add a time (or a ratio of times) to a running mean, when timing is learnt."""
        if self.timing():
            ewma.add(x)

    def learn_scale(self, seconds: float, drafts: int) -> None:
        """What a verification of `drafts` rows past the pending token took, against the curve's prediction."""
        if self.timing():
            st = self.state
            t_plain = st.t_plain.get(self.t1 or seconds)
            predicted = curve_relative(self.curve, drafts + 1, self.batch()[1]) - 1.0
            # A step interrupted (another process, a pause of the collector) says nothing about the curve:
            # what one step adds is bounded, so one stall moves the scale by at most a few steps' worth.
            st.batch_scale.add(min(seconds / t_plain - 1.0, 3.0 * predicted + 1.0), predicted)

    # -- pricing -------------------------------------------------------------

    def t_plain(self) -> float:
        """Seconds of a plain step, as learnt (seeded from the measured T(1))."""
        return self.state.t_plain.get(self.t1 or 1.0)

    def rate(self) -> float:
        """R: tokens per second this engine reaches (never below plain decoding's)."""
        st = self.state
        plain = 1.0 / max(self.t_plain(), 1e-6)
        if st.tokens.value and st.seconds.value:
            return max(plain, st.tokens.value / st.seconds.value)
        return plain

    def batch(self) -> tuple[int, int]:
        """(B, L): how many sequences the batch this one decodes in holds, and how many rows the others put
        in it (backends.steps.BatchLoad): (1, 0) alone. Sequences that joined since the last batch count
        with a row each: in the first tick of a burst of clients, the last batch held one or none of them, and
        every newcomer would price its rows as if alone (eight clients at once, each verifying a long
        memory chain: ticks of 100-160 rows, 5x a plain tick's time)."""
        load = self.slot.load
        b = max(load.sequences, load.running, 1)
        return b, max(load.rows - self.own_rows, b - 1)

    def draft_ratio(self) -> float:
        """A draft decode of one row against a target decode of one, from the lanes' live curves (as measured
        where timing is not learnt or a lane has no curve yet)."""
        measured = self.measured_draft
        draft = self.slot.draft
        if draft is None or not self.state.learn_timing:
            return measured
        live, target = draft.lane.live.curve(), self.slot.target.lane.live.curve()
        if live is None or target is None:
            return measured
        return live.seconds[0] / target.seconds[0]

    def t_draft_alone(self, t_plain: float) -> float:
        """Seconds of one draft decode: measured alone, seeded from the device cost, else DRAFT_PRIOR steps."""
        return self.state.t_draft.get(t_plain * DRAFT_PRIOR)

    def t_draft(self, t_plain: float) -> float:
        """Seconds a draft decode costs the batch, in this sequence's plain steps as `relative` counts them.

        Alone: as measured alone. Beside others: every one of the B
        sequences waits for the draft phase of the tick (backends.scheduler),
        so its share of a draft decode (the draft lane's live T(m)/m, m the
        drafters in its last decode) counts B times, against the batch's
        plain tick T(B) on the target's live curve, one row per sequence: the
        denominator `curve_relative` prices rows against, not the tick the
        others' proposals have already slowed (against that, a draft looks
        cheap exactly when everyone speculates). Without live curves, a draft
        decode as measured alone, B times.
        """
        alone = self.t_draft_alone(t_plain)
        b, others = self.batch()
        if b == 1 and others == 0:
            return alone
        draft = self.slot.draft
        live = draft.lane.live.curve() if draft is not None and self.state.learn_timing else None
        target = self.curve
        if live is None or target is None or target is self.seed_curve:
            return alone * b
        m = min(max(draft.lane.last_rows, 1), len(live.seconds))  # type: ignore[union-attr]
        tick = target.seconds[min(b, len(target.seconds)) - 1]
        return t_plain * b * (live.seconds[m - 1] / m) / tick

    def relative(self, k: float) -> float:
        """What verifying k rows costs, in plain steps of this sequence.

        Alone: T(k)/T(1), the measured curve with its extra cost beyond one
        token scaled by what verification batches really took
        (AutoState.batch_scale). Beside others (B sequences, L rows of theirs),
        the extra rows delay the whole batch: the time they add,
        T(L+k)/T(L+1) - 1, counts once for each of the B sequences that wait
        for it (Dinkelbach's rule over the batch's tokens per second, split
        per sequence, as SmartSpec's goodput prices a batch). A lone sequence
        gets exactly the decisions it gets alone; under load a row costs
        more where the curve is steeper and the batch fuller, so fewer
        sequences speculate, and those whose proposals are likeliest.
        """
        return self.prices()(k)

    def prices(self) -> Callable[[float], float]:
        """`relative` for one decision, its inputs (the curve, the batch, the correction) read once and each row
        count priced once: nothing they hold moves until the step runs, and a decision prices the same row
        counts many times (every chain length, every node of a candidate tree, each option's shortest chain)."""
        memo: dict[float, float] = {}
        inputs: tuple[BatchCost | None, float, int, int] | None = None  # read at the first price asked for

        def relative(k: float) -> float:
            nonlocal inputs
            r = memo.get(k)
            if r is None:
                if inputs is None:  # (a step with nothing to price, most plain steps, never rebuilds the live curve)
                    inputs = (self.curve, self.scale(), *self.batch())
                curve, scale, b, others = inputs
                r = memo[k] = self.shared(time_relative(curve, scale, k, others, b), b, others)
            return r

        return relative

    @staticmethod
    def shared(time_relative: float, b: int, others: int) -> float:
        """A step's time relative to a plain one, as a cost to the batch: its extra counted B times."""
        if b == 1 and others == 0:
            return time_relative
        return 1.0 + b * (time_relative - 1.0)

    def scale(self) -> float:
        """What the curve's extra cost beyond one row is multiplied by: what verification batches took against
        its prediction (AutoState.batch_scale), never below MIN_CURVE_SCALE."""
        return max(self.state.batch_scale.factor(), MIN_CURVE_SCALE)

    def time_relative(self, k: float, others: int = 0, plain_rows: int | None = None) -> float:
        """How much longer the batch takes with k rows of this sequence than with one (alone: T(k)/T(1)), from
        the measured curve corrected by what verification batches took (`plain_rows`: curve_relative's)."""
        return time_relative(self.curve, self.scale(), k, others, plain_rows)


def time_relative(curve: BatchCost | None, scale: float, k: float, others: int = 0,
                  plain_rows: int | None = None) -> float:
    """curve_relative's ratio with its extra cost beyond one row multiplied by `scale` (CostModel.scale)."""
    base = curve_relative(curve, k, others, plain_rows)
    if curve is None:
        return base
    return 1.0 + scale * (base - 1.0)


def curve_relative(curve: BatchCost | None, k: float, others: int = 0, plain_rows: int | None = None) -> float:
    """T(others + k)/T(others + 1) as measured; without a measured curve, as steep as it gets (speculation
    never pays).

    Beside others, by the curve's slope over at least LOAD_SLOPE_SPAN rows from the batch's size: a curve
    measured on a busy machine is made non-decreasing by suffix minima (backends.device_cost.monotone), which
    leaves flat steps, and on a flat step one more row would look free to every sequence of a full batch
    (docs/results.md, "Figures behind design choices"). The time the rows add is measured against the tick
    the batch would take plain (`plain_rows`: one row per sequence), not against one already slowed by the
    others' proposals: against that, every sequence's rows look cheap once all speculate, and all go on
    speculating in ticks slower than plain ones deliver (eight clients, each verifying 16-row memory chains:
    ticks of 130 rows at 0.8x plain's rate, each sequence's own rows pricing at under 2 plain steps).

    Nor below what the curve says the rows add where they land, T(L+k) - T(L+1): the slope averages a jump
    away, and on a GPU the curve jumps where llama.cpp's kernels for small batches stop (an H200, a 4-layer
    SmolLM2, each decode timed to completion: T(8) = 1.35, T(9) = 2.01), so that one more row beside 7 others
    was priced by the slope at about a quarter of what it added to everyone's tick (docs/results.md, "A GPU":
    8 clients ran at 0.83-0.87x plain decoding there)."""
    if not others:
        return curve_at(curve, k)
    lo = others + 1
    hi = max(others + k, lo + LOAD_SLOPE_SPAN)
    slope = (curve_at(curve, hi) - curve_at(curve, lo)) / (hi - lo)
    added = max(max(slope, 0.0) * (k - 1), curve_at(curve, others + k) - curve_at(curve, lo))
    return 1.0 + added / curve_at(curve, min(lo, plain_rows or lo))


def curve_at(curve: BatchCost | None, k: float) -> float:
    """T(k)/T(1) as measured, extrapolated linearly beyond the measurement; k without a curve."""
    if curve is None:
        return float(k)
    if k > len(curve.seconds):  # beyond the measurement: grow linearly from its last slope
        n = len(curve.seconds)
        last = curve.relative(n)
        slope = last - curve.relative(n - 1)
        return last + max(slope, 0.0) * (k - n)
    return curve.relative(k)
