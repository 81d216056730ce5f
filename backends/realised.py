"""What speculation delivers here, now: tokens per second of the ticks that speculated against those that did not.

`auto` prices every row from a cost model (backends.strategies.auto.costs):
the device's measured curve, corrected by what verification took. A model
can be wrong in ways it cannot see: a machine whose batch cost moved since
it was measured, another program taking a core, a draft phase that makes
every sequence of the batch wait. vLLM's adaptive verification and SmartSpec
(arXiv 2406.14066) keep their cost model current from the running system;
this goes one step further and checks the outcome itself. The scheduler
times every tick (draft phase, target decode and the host work after it)
and counts the tokens it committed; per batch size (the sequences with rows
in the target batch), decayed sums of tokens and seconds give the rate of
ticks where someone speculated and of ticks where nobody did. Where the
first is below the second by more than MARGIN, with enough evidence of
both, speculation does not pay here, now: `auto` decodes plainly at that
batch size (`Realised.allows`).

Evidence goes stale, both ways: while speculation is held back there are no
new speculating ticks, and while everyone speculates no plain ones. Where
plain evidence is older than PLAIN_EVERY ticks, two ticks in every
PLAIN_EVERY are plain for everyone (`plain_due`; the second is the
evidence, as below): at most that share of ticks, where speculation pays,
is spent keeping the plain rate current. Evidence older
than STALE ticks counts a quarter in the rate when new evidence of its kind
comes, so that once speculation is held back, a probe tick now and then
(where sequences decide as they would) is judged with it at once: a probe
that finds speculation paying lets it run again (within a few probes after a
busy spell ends), one that does not keeps it held back, and no ticks
speculate unchecked in between. A probe is paid for: where speculation does
not pay, it delivers less than the plain ticks it stands for, and one that
verifies a large tree on a steep curve costs several of them (on the tests'
tiny model, with every row priced as free, a 13-row probe took twelve plain
ticks' time, and probes every STALE ticks 7% of the time in llama_decode:
docs/results.md). So probes are spaced further apart than STALE where the
last one's time beyond what it delivered, counted in plain ticks, would make
them more than PROBE_SHARE of the time: the same bound as `auto`'s
exploration (AutoConfig.explore_budget).
Ticks that decode a prompt chunk are not counted: they are neither. Nor
is the draft catching up on tokens it missed where that is a one-off
switch (`switching`): the prompt it takes alone after the first token, and
the tokens decoded while this check held speculation back. Counted in the
tick that paid it, it made the draft's first steps and every probe after a
hold-back look like a loss (the Q8_0 draft, greedy, one client: held back
at 1.0x in some runs where it delivers 1.4x). The catch-up on `auto`'s own
plain and lookup steps is counted: where it alternates, it recurs. Nor are
the ticks whose rows an option still being learnt chose (`learning`: taken
fewer than backends.strategies.auto.decide's SETTLE_STEPS times on the
engine): its estimates are near their priors, its first chains short, and
judged on them the check held the Q8_0 draft back at 1.0x plain in runs
where, learnt, it delivers 1.4x (held back, the estimates never learn).
Exploration's price is bounded by those steps, once per engine. Nor are
a try's ticks (an option the estimates call worse, taken now and then to
keep its estimate fresh, at most `auto`'s exploration budget): it loses by
design. Such ticks count where they delivered more than plain ticks do
(`_gained`): their losses are exploration's, their gains speculation's.
Left out whole, prompt lookup's first 32 steps (chains of 7-13 tokens at
2-3x plain) were missing from speculation's rate, and the ticks that found
nothing to propose judged it alone: a coin toss at a tie, which held the
Gemma pair back for the rest of a run (docs/results.md). A probe's rows
count whatever chose them.

A tick where nobody speculated but `auto` decided (its rows or, within it,
the next tick's) is no plain evidence, yet it bounds the plain rate from
below: plain rows and `auto`'s lookups and pricing on top take at least
what the plain rows alone take. These ticks are kept apart too (`decided`;
those whose rows were decided count with speculation's as well), and
speculation is held back where its ticks deliver less than they do, with
no margin: below a lower bound of plain decoding, it loses. At 8 clients
over HTTP with one thread, lookup chains at 0.8 delivered 0.965x plain
decoding while plain ticks came only every PLAIN_EVERY ticks; their decided
ticks, 95 of them against 20 plain, ran at 0.995x plain (docs/results.md).
A bound holds for the machine it was measured on, so decided ticks bar
speculation only where their evidence is about as recent as its own (within
STALE ticks): the chat app's record of one session read decided ticks at
49 tok/s from a quiet spell, then, under another program's load, plain ticks
at 21.5 and a probe's speculating ticks at 40, and held speculation back
at 1.9x the plain rate, tick after tick (docs/results.md).

Plain evidence is what plain decoding would deliver, not what `auto`
delivers when it looks for proposals and then decodes plainly: a sequence
that was allowed to speculate marks it (`deciding`), and a tick whose rows
such a sequence chose counts with speculation's ticks, whatever it chose,
since its lookups, pricing and events are speculation's cost. A tick is
plain evidence only where nobody decided its rows nor, within it, the next
tick's (a sequence decides its next rows in the tick that verified its
last: the scheduler runs it on while the logits are valid), so a due plain
tick holds two decision points back. Judged against `auto`'s own plain
ticks, MARGIN stacked on the host work they carry and let `auto` run that
much further under plain decoding where speculation about broke even (8
clients over HTTP with a draft that never paid: docs/results.md).

Where a batch size has speculating evidence and too little plain evidence
to judge by (a burst of new clients, a batch size not seen before: plain
ticks come only every PLAIN_EVERY ticks there), the plain rate is predicted
from the target lane's live curve (backends.live_cost: `plain_seconds`, the
seconds of a decode of that many rows), scaled by what plain ticks at the
nearest batch size with evidence took beyond their decode (the host's work),
and speculation is held back where its ticks deliver less than
(1 - PREDICTED_MARGIN) x that. Before any plain evidence the prediction is
the bare decode, so its margin is wide. A gross loss (under GROSS x the
bar) is judged after MIN_GROSS ticks instead of MIN_SPECULATED: eight
clients arriving at once, each verifying long memory chains, ran 19 ticks
at 0.55-0.7x plain's rate before (0.62x plain over HTTP, docs/results.md).
Real plain ticks, once there are enough, judge the rest.

Held back, speculation's rate is frozen while plain ticks go on, and the
machine's speed moves meanwhile (another program, a longer context) by as
much as a small loss is judged by: alone on the 4-layer SmolLM2 cut, `auto`'s
decided ticks at 0.955x plain decoding were let speculate again for a hundred
ticks at a time whenever a slower spell made the plain ticks slower than the
frozen rate (docs/results.md). So a hold-back lasts until speculation's own
new evidence, a probe's, says it pays: the plain rate moving does not end it.
(Judging each rate at the machine's pace now, by the live curve's plain
decode, was tried and dropped: while speculation runs, the curve's one-row
prediction moves with the verification batches' readings, and held the Q8_0
draft back at 1.02x plain where it delivers 1.33x.)

The rates are kept for the next process on the same files and machine
(backends.slot.Learnt, under "realised"; `to_json`, `from_json`), tick
count and all, so that a new server does not speculate at a batch size where
the last one found it does not pay while it gathers that evidence again.
They describe another spell of the machine, though: taken up, each rate
stands until the first new evidence of its kind, which replaces it (and, for
speculating ticks, whose tokens vary with what they verified, its count: a
few ticks of this spell judge it); and the
new process counts its ticks on from the next multiple of STALE, so that its
first ticks are plain (`plain_due`) and a held-back batch size is probed
within STALE. Kept at full weight, a plain rate measured beside the test
suite (15.6 tok/s, where the quiet machine does 51.8) let the chat app's
next answer speculate unchecked at 0.85x plain decoding; a dozen ticks on,
it still read 16.5 (docs/results.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

# Speculation is held back where its ticks deliver less than (1 - MARGIN) x the plain ticks' rate. No margin: a
# tick `auto` decided already carries its work (lookups, pricing, events), and speculation that only matches plain
# decoding gains nothing; the 3% the promise allows goes to the host work `auto` does even where it is held back,
# and to the check's noise (with 0.03 here, the Q8_0 draft at 0.8 over HTTP with 8 clients ran at 0.87x plain
# decoding, its speculating ticks at 0.97x its plain ones: docs/results.md).
MARGIN = 0.0
# Ticks of each kind at a batch size before the rates are compared (decayed counts).
MIN_SPECULATED = 8.0
MIN_PLAIN = 4.0
# A tick of plain rows that `auto` chose counts for speculation at the plain rate, longer by its host work beyond
# plain ticks' less this share of a plain tick (`_as_plain`): deciding that costs less than this is not held back.
# Looking up proposals and pricing them cost 0.2-0.5 ms a token where a step took 30 ms (0.6-1.5%); on a fast
# device's 1.5-2.2 ms step that is several times the slack, and held back there as before (the 4-layer cut alone:
# docs/results.md, "Ticks that decided plain rows").
DECIDE_SLACK = 0.02
# A gross loss (speculating ticks at less than GROSS x the plain rate) is judged after MIN_GROSS ticks: a burst
# of eight clients whose first ticks took five times a plain tick's time and delivered 0.55-0.7x its rate ran
# nineteen of them before MIN_SPECULATED was reached.
MIN_GROSS = 2.0
GROSS = 0.75
# Per observation of a kind at a batch size: about 1/(1-DECAY) recent ticks count, so a machine that slows
# down or speeds up (another program starts or stops) is followed within a few dozen ticks.
DECAY = 0.95
# A count's limit after many ticks (1 + DECAY + DECAY^2 + ...). Kept rounded to three decimals, a count at its limit
# reads 20.0, a hair above 1/(1-DECAY) in floating point: the bound of what `from_json` takes allows for that.
MAX_COUNT = 1 / (1 - DECAY) + 1e-3
# Evidence older than STALE ticks weighs STALE_WEIGHT in the rate when new evidence of its kind comes.
STALE = 64
STALE_WEIGHT = 0.25
# Held back, probes take at most about this share of the time beyond the plain ticks they stand for (`_probe`).
PROBE_SHARE = 0.01
# Where speculation has evidence and plain ticks have none this recent, two ticks in every PLAIN_EVERY are plain.
PLAIN_EVERY = 32
# Without enough plain ticks at a batch size, speculation is held back where it delivers less than this share
# below the plain rate the live curve predicts (which knows the host's work per tick only as far as plain ticks
# at another batch size show it).
PREDICTED_MARGIN = 0.15
# What a process kept is taken by the next for a week at most, as the lanes' live curves (backends.live_cost:
# the rates describe the machine as it was used, and the first new evidence of their kind replaces them).
KEPT_FOR = 7 * 24 * 3600.0
# 4: each rate's decode seconds; 3: the decided ticks kept apart too; 2: plain evidence without `auto`'s decisions (1
# counted them plain)
FORMAT = 4
KINDS = ("plain", "speculated", "decided")


@dataclass
class _Rate:
    tokens: float = 0.0
    seconds: float = 0.0
    decode: float = 0.0  # of `seconds`, those in the target's decode
    count: float = 0.0
    last_tick: int = -(1 << 30)
    # Kept by an earlier process, no new evidence since: "keep" (the first new evidence replaces the rate, the count
    # stays) or "recount" (it replaces both); "" for evidence of this process (`taken_up`).
    taken: str = field(default="", compare=False)

    def add(self, tokens: int, seconds: float, tick: int, decode: float = 0.0) -> None:
        # Stale evidence weighs less in the rate, not in the count: the count says there is evidence to judge
        # by, so a probe's tick is judged at once with what came before (had the count fallen below the
        # minimum, the ticks after each probe would speculate unchecked until it was reached again). Evidence an
        # earlier process kept, of another spell of the machine, the first new evidence replaces, count and all.
        keep = 0.0 if self.taken else DECAY * (STALE_WEIGHT if tick - self.last_tick > STALE else 1.0)
        self.tokens = self.tokens * keep + tokens
        self.seconds = self.seconds * keep + seconds
        self.decode = self.decode * keep + decode
        self.count = 1.0 if self.taken == "recount" else self.count * DECAY + 1.0
        self.taken = ""
        self.last_tick = tick

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> list[float]:
        return [float(f"{self.tokens:.6g}"), float(f"{self.seconds:.6g}"), float(f"{self.decode:.6g}"),
                round(self.count, 3), self.last_tick]

    def taken_up(self, tick: int, recount: bool) -> None:
        """Kept by an earlier process, taken up by this one at `tick`: the rate stands until new evidence comes,
        which replaces it (`add`), and it is stale (plain ticks are due, probes come). Its count, which says there
        is evidence to judge by, stays where one tick tells the rate (a plain tick's time, or a decided one's,
        varies little), and starts over with the new evidence where one tick does not (`recount`: a speculating
        tick's tokens vary with what it verified; one probe tick judged as twenty held the Gemma pair back in
        the chat app)."""
        self.taken = "recount" if recount else "keep"
        self.last_tick = min(self.last_tick, tick - STALE - 1)

    @classmethod
    def from_json(cls, v: object, tick: int) -> "_Rate":
        """What `to_json` wrote; ValueError for anything else (a last tick after `tick` included)."""
        if not isinstance(v, list) or len(v) != 5 or type(v[4]) is not int or v[4] > tick:
            raise ValueError("not a rate")
        tokens, seconds, decode, count = (float(x) for x in v[:4])
        if not all(0 <= x < math.inf for x in (tokens, seconds, decode, count)) or count > MAX_COUNT \
                or decode > seconds:
            raise ValueError("not a rate")
        return cls(tokens, seconds, decode, count, v[4])


@dataclass
class Realised:
    """Per batch size: the realised rates of speculating and of plain ticks, and the tick count."""

    plain: dict[int, _Rate] = field(default_factory=dict)
    speculated: dict[int, _Rate] = field(default_factory=dict)
    # Ticks where nobody speculated but `auto` decided: plain rows and its work on top, at most the plain rate.
    decided: dict[int, _Rate] = field(default_factory=dict)
    tick: int = 0
    # Seconds of a target decode of n rows, from the lane's live curve (the scheduler's); None: no prediction.
    plain_seconds: Callable[[int], float | None] | None = field(default=None, compare=False, repr=False)
    # Whether a sequence decided, among proposals, the rows of this tick (`_rows_decided`) and of the next one.
    _rows_decided: bool = field(default=False, compare=False, repr=False)
    _deciding: bool = field(default=False, compare=False, repr=False)
    _switching: float = field(default=0.0, compare=False, repr=False)  # seconds of this tick's catch-ups
    # Whether a sequence chose this tick's rows (`_rows_learning`), or the next one's, with an option still learnt.
    _rows_learning: bool = field(default=False, compare=False, repr=False)
    _learning: bool = field(default=False, compare=False, repr=False)
    # Whether this tick probes speculation held back (`_probe`), or the last one did (`_rows_probed`): its rows,
    # chosen in this tick, are counted even where the option chosen is still being learnt.
    _probing: bool = field(default=False, compare=False, repr=False)
    _rows_probed: bool = field(default=False, compare=False, repr=False)
    # Per batch size held back: the last tick of speculating evidence when it was (`allows`).
    _held: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    # Per batch size: the tokens, seconds and tick of its last speculating tick, counted or not (held back: a probe).
    _last_speculated: dict[int, tuple[int, float, int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def observed(self) -> bool:
        """Whether any tick was counted, of any kind."""
        return any(getattr(self, kind) for kind in KINDS)

    def deciding(self) -> None:
        """A sequence allowed to speculate decides its next rows now: they, and this tick's work, count with
        speculation's ticks."""
        self._deciding = True

    def switching(self, seconds: float) -> None:
        """A sequence's draft caught up in this tick on tokens it missed, in `seconds`: a switching cost, left out
        of the tick's time. Sequences catch up in the same batched draft decodes: the longest counts."""
        self._switching = max(self._switching, seconds)

    def learning(self) -> None:
        """A sequence chose its next rows with an option whose estimates are still being learnt, or tries one its
        estimates call worse: the tick they run in is exploration's, not counted."""
        self._learning = True

    @property
    def switched(self) -> float:
        """Seconds of this tick's catch-ups so far (`switching`): left out of its time."""
        return self._switching

    def add(self, sequences: int, speculated: bool, tokens: int, seconds: float, decode: float = 0.0,
            verified: bool = True) -> str:
        """This tick at this batch size: did anyone speculate (draft or verify), how many tokens it committed, how
        long it took (of which `decode` in the target's decode; 0: not known), and whether its target batch
        verified proposals. Plain evidence only where nobody decided this tick's rows nor, within it, the next
        tick's; decided evidence where nobody speculated but someone decided, counted in the plain rate's spell
        (`_as_plain`). A tick whose draft phase caught a draft up (`switching`) and whose target batch verified
        nothing is neither kind: the switch is left out of its time, but the target decode after the draft's
        prompt ran on caches that prompt had taken (the Gemma pair: 45.7 ms against a plain tick's 37.4), and
        counted as speculation's, the second tick of every answer weighed against it: one such tick after a
        57-token prompt held the Gemma pair back for the rest of a run (docs/results.md, "Exploration's gains
        counted"). Returns what it was counted as (the kinds, joined by "+"; "learning", "switch" or "" where it
        was not: backends.tick_log)."""
        if speculated and not verified and self._switching > 0:
            return "switch"
        seconds -= self._switching
        if seconds <= 0:
            return "learning" if self._rows_learning else ""
        if speculated or self._rows_decided:  # what a probe costs, counted or not (an option still learnt)
            self._last_speculated[sequences] = (tokens, seconds, self.tick)
        if self._rows_learning and not self._rows_probed and not (speculated and self._gained(sequences, tokens,
                                                                                            seconds)):
            return "learning"
        decided = self._rows_decided or self._deciding
        if speculated or self._rows_decided:
            kinds = ["speculated"]
        elif not decided:
            kinds = ["plain"]
        else:  # plain rows, but the next tick's decisions ran in it: no plain evidence
            kinds = []
        if decided and not speculated:  # plain rows and `auto`'s work on top
            kinds.append("decided")
        for kind in kinds:
            counted = seconds
            if not speculated and kind != "plain":  # plain rows, `auto`'s work on top
                counted = self._as_plain(sequences, seconds, decode, DECIDE_SLACK if kind == "speculated" else 0.0)
            getattr(self, kind).setdefault(sequences, _Rate()).add(tokens, counted, self.tick, decode)
        return "+".join(kinds)

    def _gained(self, sequences: int, tokens: int, seconds: float) -> bool:
        """Whether a tick delivered more than plain ticks deliver at this batch size (as measured, else as the live
        curve predicts them). Exploration's ticks are left out of the check for their losses, which their priors
        and tries cause; their gains are speculation's evidence all the same. Left out whole, the ticks that paid
        (prompt lookup's first 32 steps, chains of 7-13 tokens at 2-3x plain) were missing from speculation's
        rate, and the ticks that found nothing to propose judged it alone: a coin toss at a tie, which held the
        Gemma pair back for the rest of a run (docs/results.md, "Exploration's gains counted")."""
        plain = self.plain.get(sequences)
        if plain is not None and plain.count >= MIN_PLAIN and plain.rate > 0:
            return tokens / seconds > plain.rate
        predicted = self._predicted_tick(sequences)
        return predicted is not None and tokens / seconds > sequences / predicted

    def _as_plain(self, sequences: int, seconds: float, decode: float, slack: float) -> float:
        """A tick of plain rows whose work `auto` did (it looked up proposals and priced them, or decided the next
        tick's rows), in the plain rate's spell: a plain tick's time there, longer by the share its host work
        took beyond plain ticks' (less `slack`). Its decode is what a plain tick's would have been now, so the
        machine's pace cancels: counted as it was seen, such ticks were compared with plain ticks of another
        spell, and a machine 10% slower while `auto` decided held speculation back before it found anything to
        propose (a code answer that prompt lookup alone speeds up 1.56x, at 1.04x: docs/results.md). Where plain
        ticks are too few to tell their host work, or the decode was not timed, as seen, less `slack`: the decided
        ticks that then bound plain's rate from below are these same ticks, as seen, and speculation's evidence
        held against them was a coin toss on the one tick that differs."""
        plain = self.plain.get(sequences)
        if plain is None or plain.count < MIN_PLAIN or plain.decode <= 0 or plain.rate <= 0 or decode <= 0:
            return seconds * (1.0 - slack)
        share = seconds / (decode * plain.seconds / plain.decode)  # this tick against a plain tick now
        return sequences / plain.rate * max(share - slack, share / 2)

    def next_tick(self) -> None:
        """The scheduler's tick ended (counted or not): the decisions made in it are the next tick's rows'."""
        self.tick += 1
        self._rows_decided, self._deciding, self._switching = self._deciding, False, 0.0
        self._rows_learning, self._learning = self._learning, False
        self._rows_probed, self._probing = self._probing, False

    def pays(self, sequences: int) -> bool | None:
        """Whether speculating ticks delivered at least (1 - MARGIN) x the plain ones' tokens per second at
        this batch size lately, and at least the decided ticks' (a lower bound of plain's) where those are about
        as recent as theirs; with too few plain ticks, at least (1 - PREDICTED_MARGIN) x the rate the live curve
        predicts for them; None without enough evidence (a gross loss needs less of it)."""
        spec, plain, decided = (kind.get(sequences) for kind in (self.speculated, self.plain, self.decided))
        if spec is None or spec.count < MIN_GROSS:
            return None
        bars = []  # (a plain rate, the share of it speculation must deliver)
        if plain is not None and plain.count >= MIN_PLAIN:
            bars.append((plain.rate, 1.0 - MARGIN))
        elif (predicted := self._predicted_tick(sequences)) is not None:
            bars.append((sequences / predicted, 1.0 - PREDICTED_MARGIN))
        if decided is not None and decided.count >= MIN_PLAIN and spec.last_tick - decided.last_tick <= STALE:
            bars.append((decided.rate, 1.0))  # a lower bound of plain's rate, measured about when speculation's was
        if not bars:
            return None
        if spec.count < MIN_SPECULATED:  # a few ticks judge a gross loss only
            return False if spec.rate < GROSS * max(rate for rate, _ in bars) else None
        return spec.rate >= max(rate * share for rate, share in bars)

    def _predicted_tick(self, sequences: int) -> float | None:
        """Seconds of a plain tick at this batch size: the live curve's decode, scaled by what plain ticks at the
        nearest batch size with evidence took against their decode (the host's work per tick: sampling, events,
        the step machines), which on a fast device is a large share of a tick."""
        if self.plain_seconds is None or not (decode := self.plain_seconds(sequences)) or decode <= 0:
            return None
        known = [b for b, r in self.plain.items() if r.count >= MIN_PLAIN and r.rate > 0]
        if known:
            b = min(known, key=lambda b: (abs(b - sequences), b))
            seen = self.plain_seconds(b)
            if seen and seen > 0:
                return decode * max(1.0, b / self.plain[b].rate / seen)  # a plain tick commits one token a sequence
        return decode

    def plain_due(self, sequences: int) -> bool:
        """Decide plainly now: speculation has evidence here, plain ticks have none this recent. Two ticks in a
        row are due, so that the second is plain evidence (nobody decided its rows nor, in it, the next ones)."""
        spec, plain = self.speculated.get(sequences), self.plain.get(sequences)
        return spec is not None and spec.count >= MIN_SPECULATED and self.tick % PLAIN_EVERY < 2 and \
            (plain is None or self.tick - plain.last_tick >= PLAIN_EVERY)

    def allows(self, sequences: int) -> bool:
        """Whether a sequence may speculate in this tick at this batch size: not when a plain tick is due, and
        not where speculation was found not to pay, unless its evidence is stale and this tick probes it. Held
        back, it stays held back until speculation's own new evidence (a probe's) says otherwise: plain ticks
        alone do not let it run again."""
        spec = self.speculated.get(sequences)
        if spec is not None and self._held.get(sequences) == spec.last_tick:  # held back: only a probe may speculate
            # (Only a probe's evidence can change that, so the rates are not judged again at each held-back tick:
            # where speculation does not pay that is nearly every tick, and on a fast device a share of the step.)
            probe = self._probe(sequences, spec) and not self.plain_due(sequences)
        elif self.plain_due(sequences):
            return False
        elif self.pays(sequences) is False:
            self._held[sequences] = spec.last_tick  # type: ignore[union-attr]
            probe = self._probe(sequences, spec)  # type: ignore[arg-type]
        else:
            return True
        self._probing |= probe
        return probe

    def _probe(self, sequences: int, spec: _Rate) -> bool:
        """Whether this tick probes speculation held back at this batch size: one tick in STALE may (the same
        ticks for every sequence), once its evidence is older than STALE ticks, and the last probe older than
        `probe_interval`. A probe's rows count even where the option chosen is still being learnt: held back,
        options are not taken, so they stay being learnt, and probes that chose one were never counted (held
        back for the rest of a code answer that prompt lookup speeds up 1.7x: docs/results.md)."""
        if self.tick % STALE != STALE // 2 or self.tick - spec.last_tick <= STALE:
            return False
        last = self._last_speculated.get(sequences)
        return last is None or self.tick - last[2] > self.probe_interval(sequences)

    def probe_interval(self, sequences: int) -> float:
        """Ticks between probes at this batch size, so that they cost at most PROBE_SHARE of the time: the last
        speculating tick's time beyond the plain ticks its tokens stand for, in plain ticks, over PROBE_SHARE;
        STALE where that is less, or where there is no plain rate to count by."""
        last, plain = self._last_speculated.get(sequences), self.plain.get(sequences)
        if last is None or plain is None or plain.rate <= 0:
            return float(STALE)
        tokens, seconds, _ = last
        plain_tick = sequences / plain.rate  # a plain tick commits a token a sequence
        return max(float(STALE), (seconds / plain_tick - tokens / sequences) / PROBE_SHARE)

    # -- kept between processes (backends.slot.Learnt) ---------------------------------------------------------------

    def to_json(self, now: float | None = None) -> dict:
        """The rates and the tick count, for a later process: a few hundred bytes."""
        return {"format": FORMAT, "saved_at": time.time() if now is None else now, "tick": self.tick,
                **{kind: {str(b): r.to_json() for b, r in sorted(getattr(self, kind).items())} for kind in KINDS}}

    @classmethod
    def from_json(cls, data: object, now: float | None = None) -> "Realised":
        """What `to_json` kept; a new one for None, another format, an entry older than KEPT_FOR, or anything
        malformed."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return cls()
        try:
            age = (time.time() if now is None else now) - float(data["saved_at"])
            tick = data["tick"]
            if not abs(age) <= KEPT_FOR or type(tick) is not int or tick < 0:
                return cls()
            out = cls(tick=-(-tick // STALE) * STALE)  # plain ticks due at once (`plain_due`), probes aligned as ever
            for kind in KINDS:
                rates = data[kind]
                if not isinstance(rates, dict):
                    return cls()
                for b, v in rates.items():
                    if int(b) < 1:
                        return cls()
                    rate = getattr(out, kind)[int(b)] = _Rate.from_json(v, tick)
                    rate.taken_up(tick, recount=kind == "speculated")
        except (KeyError, TypeError, ValueError):
            return cls()
        return out
