"""Many step machines in one batch (`Scheduler`): continuous batching.

A strategy is a step machine (the protocol: backends.steps): it yields the
engine's events and, whenever it needs rows decoded, a `Decode`, and is sent
back the batch rows they landed on. One machine alone is driven by
backends.steps.run_solo; the scheduler drives many with the same loop
(backends.steps.advance).

`Scheduler` drives many, as llama-server's slots and vLLM's scheduler do
(continuous batching). One tick: every sequence runs until it wants rows
decoded (or ends), then each lane (the target's context, the draft's) packs
the waiting requests into one batch, up to its capacity, and decodes it.
The draft lane runs first, until no sequence waits on it: every sequence
that drafts drafts its whole chain within the tick, batched with the other
drafters (llama-server drafts for all slots at once too), and the target
decode then verifies every chain together. Requests
join between ticks (`add`) and leave when their machine ends; a request that
does not fit this tick's batch waits for the next one (who goes first rotates). A failed decode is
thrown into every sequence that had rows in it (their strategies end with
`Done(reason="error")`), and a sequence whose machine raises ends alone.

`load` (a backends.steps.BatchLoad) is what the last target batch held: `auto`
prices its rows against it, since under load a row it adds delays every
sequence in the batch. Each tick is timed and its committed tokens counted,
as a speculating or a plain tick of its batch size (backends.realised): what
speculation delivers here, which bounds `auto` (against the plain rate the
target lane's live curve predicts, where plain ticks are too few to judge
by). Given the engine's `Learnt`, those rates start from what an earlier
process kept on the same files, and are kept for the next
(backends.slot.Learnt.realised_for).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from backends.errors import DecodeError
from backends.events import REJECTED, Event, Token
from backends.kv import Lane
from backends.sampling import GenParams
from backends.steps import BatchLoad, Decode, Finished, Reply, Steps, advance
from backends.strategies.base import never
from backends.tick_log import TickLog

if TYPE_CHECKING:
    from backends.slot import Learnt
    from backends.strategies.base import Strategy


def _decode_seconds(lane: Lane, rows: int) -> float | None:
    """Seconds of a decode of `rows` rows on `lane`, by its live curve; None beyond it or before it is seeded."""
    curve = lane.live.curve()
    return curve.seconds[rows - 1] if curve is not None and 1 <= rows <= len(curve.seconds) else None


class _Active:
    """One sequence in the scheduler: its machine, where its events go (counted), and what it waits for."""

    __slots__ = ("steps", "sink", "on_end", "pending", "reply")

    def __init__(self, steps: Steps, sink: Callable[[Event], None],
                 on_end: Callable[[BaseException | None], None]) -> None:
        self.steps = steps
        self.sink = sink
        self.on_end = on_end
        self.pending: Decode | None = None
        self.reply: Reply = None  # the rows of its last request, or the error its decode raised


class Scheduler:
    """Many step machines, their rows packed into one decode per lane per tick."""

    def __init__(self, target_lane: Lane | None = None, learnt: "Learnt | None" = None,
                 load: BatchLoad | None = None) -> None:
        """`load`: the one its sequences' strategies read (a slot's, for one driven alone); a new one by default."""
        self.target_lane = target_lane  # whose batches `load` describes
        self._active: list[_Active] = []
        self._turn = 0  # who goes first in the next tick's batches (rotates: no sequence always waits)
        self.load = load if load is not None else BatchLoad()
        if learnt is not None:  # the realised rates an earlier process kept, and kept from now on
            learnt.realised_for(self.load)
        if target_lane is not None:  # a plain tick's time as the live curve predicts it (backends.realised)
            self.load.realised.plain_seconds = lambda rows: _decode_seconds(target_lane, rows)
        self.ticks = 0
        self._tick_log = TickLog.from_env()  # SPECCHAT_TICK_LOG: every tick, for measuring (backends.tick_log)
        self._tokens = 0  # tokens committed in this tick
        # Whether this tick verified proposals, ran a draft phase, decoded a prompt chunk.
        self._speculated = self._drafted = self._prompt = False
        self._decoding = [0.0, 0.0]  # seconds this tick spent in llama_decode: the target's lane, the others'

    def __len__(self) -> int:
        return len(self._active)

    def add(self, steps: Steps, sink: Callable[[Event], None],
            on_end: Callable[[BaseException | None], None] = lambda _e: None) -> None:
        """A new sequence; it starts at the next tick. `on_end(None)` when its machine ends, `on_end(exc)`
        when it raised (after which its strategy's caches are in an unknown state)."""
        def counted(event: Event) -> None:  # the tick's committed tokens, for the realised rates
            if type(event) is Token and event.kind != REJECTED:
                self._tokens += 1
            sink(event)

        self._active.append(_Active(steps, counted, on_end))
        self.load.running = len(self._active)

    def _advance(self, a: _Active) -> bool:
        """Run `a` to its next request; False when it ended."""
        reply, a.reply = a.reply, None
        try:
            request = advance(a.steps, reply, a.sink)
        except Exception as e:  # noqa: BLE001 - one sequence's failure ends it alone
            a.on_end(e)
            return False
        if isinstance(request, Finished):
            a.on_end(None)
            return False
        if isinstance(request, Decode):
            a.pending = request
        return True  # a Pause runs again after this step's decode

    def _decode(self, lane: Lane, waiting: list[_Active]) -> list[_Active]:
        """Pack the waiting requests of one lane into one batch, in order, as many as fit, and decode it; the
        sequences that got their rows (or the decode's error)."""
        batch: list[_Active] = []
        used = 0
        for a in waiting:
            size = len(a.pending.entries)  # type: ignore[union-attr]
            if size > lane.capacity:
                a.reply = ValueError(f"{size} rows do not fit in a batch of {lane.capacity}")
                a.pending = None
            elif used + size <= lane.capacity:
                batch.append(a)
                used += size
        if not batch:
            return [a for a in waiting if a.pending is None]
        target = lane is self.target_lane
        before = lane.seconds
        try:
            rows = lane.decode([a.pending.entries for a in batch])  # type: ignore[union-attr]
        except DecodeError as e:
            for a in batch:
                a.reply, a.pending = e, None
            return batch
        self._decoding[not target] += lane.seconds - before
        for a, r in zip(batch, rows):
            if target:
                entries = a.pending.entries  # type: ignore[union-attr]
                wanted = sum(1 for e in entries if e[3])
                self._speculated |= wanted > 1  # verification wants logits on several rows (lookahead: not all)
                self._prompt |= wanted < min(len(entries), 2)  # a prompt chunk wants them on its last row at most
            a.reply, a.pending = r, None
        if target:
            self.load.sequences, self.load.rows = len(batch), used
        else:
            self._drafted = True  # a draft phase
        return [a for a in waiting if a.pending is None]

    def _by_lane(self, order: list[_Active], inner: bool) -> dict[int, tuple[Lane, list[_Active]]]:
        lanes: dict[int, tuple[Lane, list[_Active]]] = {}
        for a in order:
            if a.pending is not None and (a.pending.lane is not self.target_lane) == inner:
                lanes.setdefault(id(a.pending.lane), (a.pending.lane, []))[1].append(a)
        return lanes

    def step(self) -> int:
        """One step of every sequence: one target decode; returns how many sequences are still running.

        Before it, the other lanes (the draft's) run until nobody waits on
        them: every sequence that drafts drafts its whole chain in this step,
        its draft decodes batched with the other drafters', and the target
        decode then verifies every chain at once. (Were the draft lane decoded
        once per step, a chain of K tokens would take K steps of everyone's
        time and could never beat plain decoding.)
        """
        t0 = time.perf_counter()
        self._tokens, self._speculated, self._drafted, self._prompt = 0, False, False, False
        self._decoding = [0.0, 0.0]
        self._active = [a for a in self._active if a.pending is not None or self._advance(a)]
        if not self._active:
            return 0
        n = len(self._active)
        order = [self._active[(self._turn + i) % n] for i in range(n)]
        self._turn += 1
        outer = self.target_lane is not None
        while outer and (inner := self._by_lane(order, inner=True)):
            for lane, waiting in inner.values():
                for a in self._decode(lane, waiting):  # on to their next request while the logits are valid
                    if not self._advance(a):  # ended
                        order.remove(a)
                        self._active.remove(a)
        decoded = False
        for lane, waiting in self._by_lane(order, inner=False).values():
            self._decode(lane, waiting)
            decoded = True
        self.ticks += 1
        # Everyone who got rows (or an error) runs on to its next request now, while the logits are valid.
        self._active = [a for a in self._active if a.pending is not None or self._advance(a)]
        realised = self.load.realised
        if decoded:
            seconds, log = time.perf_counter() - t0, self._tick_log
            verdict = realised.pays(self.load.sequences) if log is not None else None
            switching = realised.switched
            kind = "prompt" if self._prompt else \
                realised.add(self.load.sequences, self._speculated or self._drafted, self._tokens, seconds,
                             self._decoding[0], verified=self._speculated)
            if log is not None:
                log.tick(realised.tick, self.load.sequences, self.load.rows, kind, verdict, self._tokens, seconds,
                         switching, self.target_lane.ctx.threads if self.target_lane is not None else None,
                         *self._decoding)
        realised.next_tick()
        self.load.running = max(len(self._active), 1)
        if not self._active:
            self.load.sequences, self.load.rows = 1, 1  # whoever decodes next decodes alone
        return len(self._active)

    def run(self) -> None:
        """Tick until every sequence has ended."""
        while self.step():
            pass


def run_alone(steps: Steps, scheduler: Scheduler) -> Iterator[Event]:
    """The events of one step machine, driven alone by `scheduler` (a batch of one): as backends.steps.run_solo
    drives it, each tick's events handed on as soon as the tick ends (before the next decode), a raising machine's
    exception raised here, and the machine closed when its events are no longer wanted; and each tick timed and
    counted as under load, so that `auto` alone is bounded by what its speculation delivers (backends.realised)
    as it is beside others."""
    events: list[Event] = []
    ended: list[BaseException | None] = []
    scheduler.add(steps, events.append, ended.append)
    try:
        running = 1
        while running:
            running = scheduler.step()
            yield from events
            events.clear()
    finally:
        steps.close()
    if ended and ended[0] is not None:
        raise ended[0]


class Alone:
    """A strategy whose `generate` runs its step machine through a scheduler of its own (`run_alone`), made for each
    generation by `scheduler`; everything else is the strategy's (`inner`)."""

    def __init__(self, inner: "Strategy", scheduler: Callable[[], Scheduler]) -> None:
        self.inner = inner
        self._scheduler = scheduler

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        return self.inner.steps(prompt, params, should_stop)

    def generate(self, prompt: Sequence[int], params: GenParams,
                 should_stop: Callable[[], bool] = never) -> Iterator[Event]:
        return run_alone(self.inner.steps(prompt, params, should_stop), self._scheduler())
