"""From the engine's events (backends.events) to UI messages, in the generation thread.

A step of speculation can release a burst of tokens in microseconds; posting
one message per token would flood the UI's queue and steal CPU from
generation. Tokens are collected and posted at most every `interval` seconds,
always at a step boundary, and at the answer's last step (StepEnd.last: its
Done may come seconds later, after `auto` measured a new machine). Live stats
come from the same stream (StepEnd carries drafted/accepted per target
forward), so the bar moves while the answer streams, in the same frame as the
text; the final figures are `Done.stats`. For a thinking model, the batch in
which the answer starts (its first token after the reasoning's) carries how
long the thinking took, timed here per token, not per batch.

Every UI update costs CPU that llama.cpp's threads wait for: on a 2-core
laptop each frame preempts a compute thread, and generation loses about twice
the UI thread's share of a core (tests/perf/tui_overhead.py; docs/results.md,
"Figures behind design choices"). What a batch costs the UI grows as
an answer does: a Markdown batch late in a 1,000-token answer re-lays out the
answer's blocks and, once the transcript scrolls, repaints the whole screen
(30-45 ms), where the first batches cost 5 ms. So no fixed interval fits both:
`Pacer` measures the UI thread's CPU per batch and sets the next interval so
that showing the answer takes at most UI_BUDGET of a core, between
MIN_INTERVAL (a few tokens at a time while batches are cheap) and
MAX_INTERVAL. The interval is asked for at every step, so the UI can change it
mid-answer.

The bar's "× vs plain decoding" needs plain decoding's rate under the same
conditions as the answer: above all the same context length. The short
plain run after the model loads (24 tokens after a short prompt) reads far
faster than a conversation's plain decoding (the SmolLM2 F32 target, `specchat
run -s ar`: 52.2 tok/s for 24 tokens, 42.2 for 400; an answer of `auto`'s
held back to plain decoding throughout read 0.92× against it in the chat
app), so every answer's plain steps are timed too (from the step before to
theirs, the first from the prompt's end, tokens and seconds:
LiveStats.plain_tokens, plain_seconds: an answer decoded plainly throughout
is its own baseline) and `PlainBaseline` prefers them, after the user's own
`ar` turns, to that run. Their seconds are the engine's (StepEnd.seconds), not
this thread's clock: a step's events are handed on after whatever the engine
does before its next request, and after an answer's last step that is the
device's cost measured on a new machine (backends.strategies.auto, seconds):
timed here, a first answer decoded plainly throughout read "1.47× vs plain
decoding" against itself.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from textual.message import Message

from app.tui.messages import PromptDecoded, TokensArrived, TurnFinished
from backends.events import REJECTED, Done, Event, GenStats, Prefilled, StepEnd, Token

UI_BUDGET = 0.02  # the share of one core the UI may spend showing a streaming answer
MIN_INTERVAL = 0.25  # seconds between UI updates while they are cheap
MAX_INTERVAL = 3.0  # seconds between UI updates however much they cost


def paced_interval(ui_seconds: float, budget: float = UI_BUDGET, lo: float = MIN_INTERVAL,
                   hi: float = MAX_INTERVAL) -> float:
    """Seconds until the next batch, so that a batch costing the UI `ui_seconds` of CPU keeps it at `budget`."""
    if ui_seconds < 0 or not 0 < budget <= 1 or not 0 < lo <= hi:
        raise ValueError(f"bad pacing: {ui_seconds=}, {budget=}, {lo=}, {hi=}")
    return min(hi, max(lo, ui_seconds / budget))


class Pacer:
    """The interval between batches, from what the last one cost the UI thread.

    `started` and `arrived` run in the UI thread: the CPU time it spent between two arrivals is what
    showing the earlier batch cost (the handler and the frames it caused, plus the idle event loop's
    own small share). `interval` is read by the generation thread at every step.
    """

    def __init__(self, budget: float = UI_BUDGET, lo: float = MIN_INTERVAL, hi: float = MAX_INTERVAL,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.budget, self.lo, self.hi = budget, lo, hi
        self.interval = paced_interval(0.0, budget, lo, hi)  # validates them
        self._cpu_clock = cpu_clock
        self._last: float | None = None

    def started(self) -> None:
        """A new answer begins streaming: its first batches come at the shortest interval."""
        self.interval, self._last = self.lo, self._cpu_clock()

    def arrived(self) -> None:
        """A batch arrived (call before showing it)."""
        now = self._cpu_clock()
        if self._last is not None:
            self.interval = paced_interval(now - self._last, self.budget, self.lo, self.hi)
        self._last = now

    def __call__(self) -> float:
        return self.interval


@dataclass(frozen=True)
class LiveStats:
    strategy: str
    generated: int
    drafted: int
    accepted: int
    forwards: int
    seconds: float
    by_source: tuple[tuple[str, int], ...] = ()  # output tokens by who proposed them
    why: str = ""  # auto: what it chooses now, and why
    # The plain steps' tokens and seconds (each from the step before, the first from the prompt's end): plain
    # decoding's rate here, now, as a whole answer pays it (PlainBaseline).
    plain_tokens: int = 0
    plain_seconds: float = 0.0

    def shares(self) -> list[tuple[str, int]]:
        """Each source's share of the output tokens in percent, by source name, e.g. [('draft', 41), ('target', 59)]
        ([] when every token is the target's own; app.tui.stats_bar.share_text shows it)."""
        total = sum(n for _, n in self.by_source)
        if not total or all(s == "target" for s, _ in self.by_source):
            return []
        return [(s, round(100 * n / total)) for s, n in sorted(self.by_source)]

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.forwards if self.forwards else 0.0

    @classmethod
    def from_stats(cls, stats: GenStats) -> "LiveStats":
        return cls(stats.strategy, stats.generated_tokens, stats.drafted, stats.accepted,
                   stats.target_forwards, stats.decode_seconds, tuple(stats.tokens_by_source.items()))


def stream_events(
    strategy: str,
    events: Iterable[Event],
    post: Callable[[Message], object],
    interval: Callable[[], float] = lambda: MIN_INTERVAL,
    clock: Callable[[], float] = time.perf_counter,
) -> Done | None:
    """Post the stream as coalesced messages, at least `interval()` seconds apart; returns the `Done` event."""
    pending: list[Token] = []
    generated = drafted = accepted = forwards = 0
    step_tokens = plain_tokens = 0  # tokens of the step under way; of the plain steps so far
    plain_seconds = 0.0
    by_source: dict[str, int] = {}
    why = ""
    thinking = False  # a reasoning token has come
    thought: float | None = None  # the seconds until the answer's first token, after the reasoning's
    started = last_post = clock()
    for event in events:
        if isinstance(event, Token):
            pending.append(event)
            if event.kind != REJECTED:
                generated += 1
                step_tokens += 1
                by_source[event.source] = by_source.get(event.source, 0) + 1
                thinking = thinking or event.channel == "reasoning" or bool(event.reasoning)
                if thinking and thought is None and event.channel == "content":
                    thought = clock() - started
        elif isinstance(event, StepEnd):
            forwards += 1
            drafted += event.drafted
            accepted += event.accepted
            why = event.why or why
            now = clock()
            if event.choice == "plain" and not event.drafted:
                plain_tokens, plain_seconds = plain_tokens + step_tokens, plain_seconds + event.seconds
            step_tokens = 0
            if pending and (now - last_post >= interval() or event.last):  # the answer's end: now, not at Done
                live = LiveStats(strategy, generated, drafted, accepted, forwards, now - started,
                                 tuple(by_source.items()), why, plain_tokens, plain_seconds)
                post(TokensArrived(tuple(pending), live, thought))
                pending, last_post = [], now
        elif isinstance(event, Prefilled):
            started = last_post = clock()
            post(PromptDecoded(event))
        elif isinstance(event, Done):
            final = replace(LiveStats.from_stats(event.stats), why=why, plain_tokens=plain_tokens,
                            plain_seconds=plain_seconds)
            if pending:
                post(TokensArrived(tuple(pending), final, thought))
            post(TurnFinished(event, final))
            return event
    return None


class PlainBaseline:
    """Plain decoding's tokens per second on this model, in this session: what the bar's speedup is against. The
    median of the user's own `ar` turns where there are any; else the plain steps of the last RECENT turns,
    once they hold MIN_TOKENS; else the short plain run measured after the model loaded (`calibrated`). A new
    model starts it over (`reset`). An answer with MIN_TOKENS of plain steps of its own is judged against them
    (`for_answer`): they ran at its context length, and a step grows with the context (SmolLM2 held back to plain
    steps in a fourth turn: 36-40 ms a step against 29-31 ms in the first, and read 0.94-0.95x against the turns
    before it, as if it were slower than itself)."""

    RECENT = 8
    MIN_TOKENS = 32

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._ar: list[float] = []
        self._plain: deque[tuple[int, float]] = deque(maxlen=self.RECENT)
        self._calibrated: float | None = None

    def calibrated(self, tokens_per_second: float) -> None:
        self._calibrated = tokens_per_second

    def turn(self, live: LiveStats) -> None:
        """A turn ended with these figures (an `ar` turn of a few tokens or more is plain decoding whole)."""
        if live.strategy == "ar" and live.generated >= 8 and live.seconds > 0:
            self._ar.append(live.tokens_per_second)
        elif live.plain_tokens and live.plain_seconds > 0:
            self._plain.append((live.plain_tokens, live.plain_seconds))

    def for_answer(self, live: LiveStats) -> float | None:
        """The baseline for this answer (under way or ended): its own plain steps where they hold MIN_TOKENS,
        else `value`."""
        if live.plain_tokens >= self.MIN_TOKENS and live.plain_seconds > 0:
            return live.plain_tokens / live.plain_seconds
        return self.value

    @property
    def value(self) -> float | None:
        if self._ar:
            return statistics.median(self._ar)
        tokens = sum(t for t, _ in self._plain)
        if tokens >= self.MIN_TOKENS:
            return tokens / sum(s for _, s in self._plain)
        return self._calibrated
