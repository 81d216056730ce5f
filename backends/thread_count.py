"""How many of its threads a lane decodes with: the count that decodes fastest here, now (`ThreadCount`).

llama.cpp splits each decode's graph between the threads it is given (-t),
and every op ends at a barrier where they wait for each other (ggml-cpu; an
OpenMP team in this build). Where another program keeps a core busy, one of
those threads shares that core and every barrier waits out its time slices:
on the developers' 2-core VM with a busy loop beside it, a decode of 8 rows at
-t 2 took 0.124 s on average (median 0.080 s: a tick's time turns bimodal)
against 0.078 s at -t 1; on the quiet machine 0.041 s at 2 and 0.077 s at 1
(docs/results.md, "Threads beside a busy core"). llama.cpp keeps the count
it started with, and so did specchat: beside a busy program, plain decoding
at 8 clients ran at 43 tok/s where one thread gave 78.

So the target's lane takes its -t as the most threads it may use and moves
(llama_set_n_threads, between decodes) to the count that decodes fastest
now, as the realised check (backends.realised) judges speculation: from the
decodes it runs. Now and then a few decodes (PROBE_DECODES) run at another
count (one thread fewer, one more, or half: with several cores busy, one
thread either side may sit on the same plateau), and their mean time is
compared with the current count's recent decodes of as many rows: one faster
by MARGIN becomes the count. A probe costs (on a quiet machine fewer threads
are clearly slower), so where it finds that, the wait before the next one
doubles, from PROBE_FIRST up to PROBE_MAX. A machine that changes shows first
as spread: a busy core makes the current count's decodes of one size vary
(their recent mean over their fastest above SPREAD; on a quiet machine they
vary by a few percent), and then a probe comes within PROBE_SOON decodes.
Below the most threads the wait is capped lower (PROBE_UP_MAX), so that when
the other program ends the lane takes its threads back within seconds. A
draft model's lane decodes with the target's count (`FollowingCount`).
Thread counts do not change llama.cpp's CPU results (each output row is one
thread's sum: the SmolLM2 F32 and Q2_K logits were bit for bit the same at 1
and 2 threads on the developers' VM).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Decodes at a neighbouring count per probe, of at most PROBE_ROWS rows, and how much faster (their mean time) it must
# be to be taken.
PROBE_DECODES = 2
PROBE_ROWS = 64
MARGIN = 0.10
# A probe that finds the neighbour slower by CLEAR or more doubles the wait before the next (a quiet machine).
CLEAR = 0.25
# Decodes at the current count between probes: the first wait, the longest, the longest below the most threads.
PROBE_FIRST = 128
PROBE_MAX = 2048
PROBE_UP_MAX = 256
# A busy core shows as spread: the recent mean decode time of one size over its fastest, above SPREAD, over at least
# SPREAD_SEEN decodes, brings the next probe within PROBE_SOON decodes: at most once per PROBE_SOON_EVERY decodes,
# or a quarter of the wait between probes (a machine whose decodes vary for another reason pays a probe that often).
SPREAD = 1.3
SPREAD_SEEN = 8
PROBE_SOON = 8
PROBE_SOON_EVERY = 32
# Decodes remembered per (thread count, rows): the current count's recent times; a probe's decode is compared with
# at least COMPARED of them.
RECENT = 16
COMPARED = 3


@dataclass
class ThreadCount:
    """The thread count for a lane's next decode (`next`), learnt from the decodes it times (`observe`)."""

    most: int
    current: int = 0
    decodes: int = 0
    wait: int = PROBE_FIRST
    next_probe: int = PROBE_FIRST
    probe: int | None = None  # the count being probed, and its decodes so far
    probe_times: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds)
    last_probe: int = 0
    _turn: int = 0  # which of the counts to probe comes next
    _recent: dict[tuple[int, int], deque[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError("a lane decodes with at least one thread")
        self.current = self.current or self.most

    def next(self, rows: int) -> int:
        """The thread count for the next decode, of `rows` rows: a probe's neighbour when one is due, else the
        current one (always for a decode of more than PROBE_ROWS, a prompt chunk a probe would delay, and for one of
        a size the current count did not decode lately, which nothing would judge)."""
        if rows > PROBE_ROWS or len(self._recent.get((self.current, rows), ())) < COMPARED:
            return self.current  # a probe's decode is one the current count's recent decodes of its size judge
        if self.probe is None and self.decodes >= self.next_probe and self.most > 1:
            c = self.current
            options = list(dict.fromkeys(n for n in (c - 1, c + 1, (c + 1) // 2) if 1 <= n <= self.most and n != c))
            self.probe, self.probe_times = options[self._turn % len(options)], []
            self._turn += 1
        return self.probe if self.probe is not None else self.current

    def observe(self, threads: int, rows: int, seconds: float) -> None:
        """A decode of `rows` rows at `threads` threads took `seconds`."""
        self.decodes += 1
        if threads == self.probe:
            self.probe_times.append((rows, seconds))
            if len(self.probe_times) >= PROBE_DECODES:
                self._judge()
            return
        if threads != self.current:
            return
        recent = self._recent.setdefault((threads, rows), deque(maxlen=RECENT))
        recent.append(seconds)
        if len(recent) >= SPREAD_SEEN and self.decodes - self.last_probe >= max(PROBE_SOON_EVERY, self.wait // 4) \
                and self.next_probe > self.decodes + PROBE_SOON \
                and sum(recent) / len(recent) > SPREAD * min(recent):
            self.next_probe = self.decodes + PROBE_SOON  # the machine may have changed: look soon

    def _judge(self) -> None:
        probe, times = self.probe, self.probe_times
        assert probe is not None
        self.probe, self.probe_times, self.last_probe = None, [], self.decodes
        pairs = [(s, sum(recent) / len(recent)) for rows, s in times
                 for recent in [self._recent[(self.current, rows)]]]
        ratio = sum(s for s, _ in pairs) / sum(c for _, c in pairs)
        if ratio < 1 - MARGIN:  # the neighbour decodes faster now: it is the count, its old times stale
            self._recent = {key: recent for key, recent in self._recent.items() if key[0] != probe}
            self.current, self.wait = probe, PROBE_FIRST // 4
        elif ratio >= 1 + CLEAR:  # clearly slower: the machine is as it was, look less often
            self.wait = min(self.wait * 2, PROBE_MAX if self.current == self.most else PROBE_UP_MAX)
        self.next_probe = self.decodes + self.wait


class FollowingCount:
    """A lane that decodes with another lane's thread count (a draft beside its target: a busy core slows both, and
    the draft's decodes, a row or a few, are too short to judge a count by: their time varies by more than a busy
    core's spread on a quiet machine). It never probes."""

    def __init__(self, leader: ThreadCount) -> None:
        self.leader = leader

    @property
    def current(self) -> int:
        return self.leader.current

    def next(self, rows: int) -> int:
        return self.leader.current

    def observe(self, threads: int, rows: int, seconds: float) -> None:
        pass
