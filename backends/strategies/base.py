"""The `Strategy` role and the loop every strategy shares.

A strategy supplies its prompt decode and one step (one target forward pass
and the events it yields); `drive` wraps them with the start, the stop checks
and the clean ending: a llama.cpp failure mid-generation ends the stream with
`Done(reason="error")` instead of an exception, so a chat session survives it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol, Sequence

from backends.events import Event
from backends.errors import CacheRollbackError, ContextFullError, DecodeError
from backends.run import Run
from backends.sampling import GenParams


def never() -> bool:
    return False


class Strategy(Protocol):
    name: str

    def generate(
        self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never
    ) -> Iterator[Event]: ...


RUNTIME_ERRORS = (DecodeError, CacheRollbackError, ContextFullError)


def drive(
    run: Run,
    prefill: Callable[[], int],
    step: Callable[[], Iterable[Event]],
    should_stop: Callable[[], bool],
) -> Iterator[Event]:
    try:
        yield run.prefill(prefill)
        while run.should_continue(should_stop):
            yield from step()
    except RUNTIME_ERRORS as e:
        yield run.done(e)
        return
    yield run.done()
