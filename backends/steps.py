"""The step-machine protocol: what a strategy yields, what it is sent back, and the one loop that drives it.

A strategy is a step machine: a generator that yields the engine's events
(backends.events) and, whenever it needs rows decoded, a `Decode`; it is
sent back the batch rows those entries landed on (or, when the decode
failed, the error is thrown into it). It never calls llama_decode itself, so
whoever drives it decides how the rows of many sequences share a forward
pass: vLLM v1 splits its scheduler from its proposers the same way, and
llama-server's slots share one batch per step.

The protocol, in one place:
  - `Decode`: rows to decode on one lane (a context and its batch,
    backends.kv.Lane); answered with the rows.
  - `Pause`: the machine waits on another sequence (the prompt another choice
    of the same request is decoding); it decodes nothing and runs again at
    the next step.
  - `Steps`: the generator type.
  - `BatchLoad`: what the last target batch held, which `auto` prices its
    rows against.

And the one loop every driver is built on, `advance`: send the machine the
answer to its last request, hand its events to a sink until it asks for
something again, and return that request (or `Finished` with its return
value). `run_solo` (one machine, each request decoded at once: `specchat
run`, the chat app, `bench`), `run_now` (the KV helpers' coroutines, decoded
at once for measurements and tools), the scheduler (many machines, one batch
per lane per tick: backends.scheduler) and `tap` (a machine whose events are
also observed, as the speculation memory records finished answers) all use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generator, Iterable, Iterator, Optional, Union

from backends.errors import DecodeError
from backends.events import Event
from backends.realised import Realised

if TYPE_CHECKING:
    from backends.kv import Lane

# One row of a batch: token, position, sequence ids, whether its logits are wanted (and, on an MTP head's
# lane only, the target's hidden state the row is paired with: backends.mtp).
Entry = tuple


class Decode:
    """What a step machine yields to have rows decoded: the entries (global sequence ids) and their lane.

    The answer sent back is the list of batch rows the entries landed on;
    their logits are valid until the lane's next decode.
    """

    __slots__ = ("lane", "entries")

    def __init__(self, lane: "Lane", entries: list[Entry]) -> None:
        self.lane = lane
        self.entries = entries


class Pause:
    """Yielded by a step machine that waits on another sequence (the prompt another choice of the same request
    is decoding): it decodes nothing and runs again at the next step."""

    __slots__ = ()


PAUSE = Pause()

Request = Union[Decode, Pause]
# A strategy's machine: events and requests out, the rows of its last Decode (or None) in.
Steps = Generator[Union[Event, Decode, Pause], Optional[list[int]], None]
# A KV helper's coroutine (backends.kv): only Decodes out, rows in, a value returned.
Rows = Generator[Decode, list[int], list[int]]
# What a machine is sent after a request: its rows, the error its decode raised (thrown in), or nothing.
Reply = Union[list[int], BaseException, None]


@dataclass(frozen=True)
class Finished:
    """A machine that returned (what `advance` gives instead of a request), with its return value."""

    value: object = None


def advancing(steps: Generator, reply: Reply) -> Generator[Event, None, Request | Finished]:
    """Run a step machine to its next request: send it `reply` (an error is thrown in) and yield each event it
    yields; return its next request, or `Finished` when it returned. What the machine raises is raised."""
    try:
        item = steps.throw(reply) if isinstance(reply, BaseException) else steps.send(reply)
        while not isinstance(item, (Decode, Pause)):
            yield item
            item = steps.send(None)
        return item
    except StopIteration as stop:
        return Finished(stop.value)


def advance(steps: Generator, reply: Reply, sink: Callable[[Event], None]) -> Request | Finished:
    """`advancing` for a driver that is no generator itself: each event goes to `sink`. (The same loop, not a
    generator around `advancing`: a scheduler runs it once per sequence per tick.)"""
    try:
        item = steps.throw(reply) if isinstance(reply, BaseException) else steps.send(reply)
        while not isinstance(item, (Decode, Pause)):
            sink(item)
            item = steps.send(None)
        return item
    except StopIteration as stop:
        return Finished(stop.value)


def decode_now(request: Decode) -> list[int] | DecodeError:
    """Decode one request alone, at once: its rows, or the decode's error (to throw into the machine)."""
    try:
        return request.lane.decode([request.entries])[0]
    except DecodeError as e:
        return e


def run_solo(steps: Steps) -> Iterator[Event]:
    """The events of one step machine, each of its requests decoded at once (a Pause just runs it again)."""
    reply: Reply = None
    try:
        while True:
            request = yield from advancing(steps, reply)
            if isinstance(request, Finished):
                return
            reply = decode_now(request) if isinstance(request, Decode) else None
    finally:
        steps.close()


def _no_events(item: object) -> None:
    raise TypeError(f"a KV coroutine yielded {item!r}, not a Decode")


def run_now(steps: Generator[Decode, list[int], object]) -> object:
    """Drive a KV coroutine (backends.kv) alone, decoding each request at once; its return value. A failed
    decode raises here (nothing to hand it to)."""
    reply: Reply = None
    while True:
        request = advance(steps, reply, _no_events)
        if isinstance(request, Finished):
            return request.value
        reply = request.lane.decode([request.entries])[0] if isinstance(request, Decode) else None


def relay(steps: Steps, transform: Callable[[Event], Iterable[Event]]) -> Generator:
    """The same step machine, each of its events replaced by what `transform` makes of it (none, itself, or
    others); the driver's replies (rows, or a decode's error) are passed to it, and its return value returned.
    A machine that wraps another (`tap`, backends.reasoning's phases) is written with it."""
    reply: Reply = None
    try:
        while True:
            events = advancing(steps, reply)
            try:
                while True:
                    yield from transform(next(events))
            except StopIteration as stop:
                request = stop.value
            if isinstance(request, Finished):
                return request.value
            try:
                reply = yield request
            except GeneratorExit:
                raise
            except BaseException as e:  # noqa: BLE001 - a decode error thrown in by the driver: passed on
                reply = e
    finally:
        steps.close()


def tap(steps: Steps, observe: Callable[[Event], None]) -> Steps:
    """The same step machine, each of its events shown to `observe` before it is handed on."""
    def shown(event: Event) -> tuple[Event]:
        observe(event)
        return (event,)

    return relay(steps, shown)


@dataclass
class BatchLoad:
    """The last target batch: how many sequences had rows in it, and how many rows it had in all; how many
    sequences the scheduler runs now (those that just joined included); and what speculation delivered."""

    sequences: int = 1
    rows: int = 1
    running: int = 1
    # What speculating ticks delivered against plain ones, per batch size (the scheduler's; empty alone).
    realised: Realised = field(default_factory=Realised)

