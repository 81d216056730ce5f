"""From the engine's events (backends.events) to UI messages, in the generation thread.

A step of speculation can release a burst of tokens in microseconds; posting
one message per token would flood the UI's queue and steal CPU from
generation. Tokens are collected and posted at most every `interval` seconds,
always at a step boundary, plus once at the end. Every UI update costs CPU
that llama.cpp's threads wait for (on a 2-core laptop each frame preempts a
compute thread): measured with tests/perf/tui_overhead.py on the demo pair,
updates every 1/30 s cost 7.7% of generation speed, every 0.1 s 5.7%, every
0.25 s 4.2%; 0.25 s still streams a few tokens at a time. The interval is asked
for at every step, so the UI can change it mid-answer: the Markdown view posts
once a second (MARKDOWN_INTERVAL), since each Markdown update re-lays out the
blocks on screen. Live stats come from the same stream (StepEnd carries
drafted/accepted per target forward), so the bar moves while the answer
streams, in the same frame as the text; the final figures are `Done.stats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from textual.message import Message

from backends.events import REJECTED, Done, Event, GenStats, Prefilled, StepEnd, Token

POST_INTERVAL = 0.25  # seconds between UI updates while streaming
# Seconds between UI updates while the answer streams into the Markdown view. Each update re-lays out and repaints
# the Markdown blocks on screen, about three times what the speculation view's update costs; on a 2-core machine
# that time is taken from generation (at 0.25 s it cost 12% of the tokens/s on a 1,000-token answer,
# tests/perf/tui_overhead.py --view markdown).
MARKDOWN_INTERVAL = 1.0


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

    def source_share(self) -> str:
        """e.g. 'draft 41% · lookup 12% · target 47%' (empty when every token is the target's own)."""
        total = sum(n for _, n in self.by_source)
        if not total or all(s == "target" for s, _ in self.by_source):
            return ""
        return " · ".join(f"{s} {100 * n / total:.0f}%" for s, n in sorted(self.by_source))

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


class TokensArrived(Message):
    def __init__(self, tokens: tuple[Token, ...], live: LiveStats) -> None:
        super().__init__()
        self.tokens = tokens
        self.live = live


class PromptDecoded(Message):
    def __init__(self, prefilled: Prefilled) -> None:
        super().__init__()
        self.prefilled = prefilled


class TurnFinished(Message):
    def __init__(self, done: Done) -> None:
        super().__init__()
        self.done = done


def stream_events(
    strategy: str,
    events: Iterable[Event],
    post: Callable[[Message], object],
    interval: Callable[[], float] = lambda: POST_INTERVAL,
    clock: Callable[[], float] = time.perf_counter,
) -> Done | None:
    """Post the stream as coalesced messages, at least `interval()` seconds apart; returns the `Done` event."""
    pending: list[Token] = []
    generated = drafted = accepted = forwards = 0
    by_source: dict[str, int] = {}
    why = ""
    started = last_post = clock()
    for event in events:
        if isinstance(event, Token):
            pending.append(event)
            if event.kind != REJECTED:
                generated += 1
                by_source[event.source] = by_source.get(event.source, 0) + 1
        elif isinstance(event, StepEnd):
            forwards += 1
            drafted += event.drafted
            accepted += event.accepted
            why = event.why or why
            now = clock()
            if pending and now - last_post >= interval():
                live = LiveStats(strategy, generated, drafted, accepted, forwards, now - started,
                                 tuple(by_source.items()), why)
                post(TokensArrived(tuple(pending), live))
                pending, last_post = [], now
        elif isinstance(event, Prefilled):
            started = last_post = clock()
            post(PromptDecoded(event))
        elif isinstance(event, Done):
            if pending:
                post(TokensArrived(tuple(pending), replace(LiveStats.from_stats(event.stats), why=why)))
            post(TurnFinished(event))
            return event
    return None
