"""The `Strategy` role, and the loop every strategy shares.

A strategy is a step machine (the protocol: backends.steps): `steps(prompt,
params, should_stop)` returns a generator that yields the engine's events
and, whenever it wants rows decoded, a `Decode` (through its sequences'
`decoding`, `extending` and `syncing`), and is sent back the batch rows.
Whoever drives it packs those rows: `generate` drives it alone
(backends.steps.run_solo), `specchat serve` drives many at once in one batch
(backends.scheduler.Scheduler). A strategy imports neither the scheduler nor
the engine.

A strategy supplies its prompt decode and one step (one target forward pass
and the events it yields); `drive` wraps them with the start, the stop checks
and the clean ending: a llama.cpp failure mid-generation ends the stream with
`Done(reason="error")` instead of an exception, so a chat session survives it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Generator, Iterable, Iterator, Protocol, Sequence

from backends.errors import CacheRollbackError, ContextFullError, DecodeError
from backends.events import Done, Event
from backends.grammar import GrammarError
from backends.run import Run
from backends.sampling import GenParams
from backends.steps import Steps, run_solo, tap

if TYPE_CHECKING:
    from backends.memory import SpeculationMemory


def never() -> bool:
    return False


class Strategy(Protocol):
    name: str

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        """The step machine of one generation (raises PromptError at once for a prompt that cannot run)."""
        ...

    def generate(
        self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never
    ) -> Iterator[Event]: ...


class StepMachine:
    """What every strategy shares: `generate` is its step machine driven alone."""

    name = ""

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        raise NotImplementedError

    def generate(
        self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never
    ) -> Iterator[Event]:
        return run_solo(self.steps(prompt, params, should_stop))


RUNTIME_ERRORS = (DecodeError, CacheRollbackError, ContextFullError, GrammarError)


def drive(
    run: Run,
    prefill: Callable[[], Generator[object, object, int]],
    step: Callable[[], Iterable[object]],
    should_stop: Callable[[], bool],
    on_done: Callable[[], Iterable[object]] | None = None,
) -> Steps:
    """The step machine: the prompt's decode (`prefill` returns how many tokens were cached), then steps.

    `on_done` runs before Done is yielded (whoever drives the machine may stop there), as one more step: it may
    yield requests (a Pause, to have the last step's events handed on before work that takes a while)."""
    try:
        cached = yield from prefill()
        yield run.prefilled(cached)
        while run.should_continue(should_stop):
            yield from step()  # type: ignore[misc]
    except RUNTIME_ERRORS as e:
        done = run.done(e)
    else:
        done = run.done()
    if on_done is not None:
        yield from on_done()  # type: ignore[misc]
    yield done


# What of the prompt a remembered generation keeps before its output: enough to find it again by its context.
PROMPT_KEPT = 48


class Remembering:
    """A strategy whose finished generations go into the speculation memory (backends.memory): the end of the
    prompt and the output, once it ended well (not an error or a cancel). Everything else is the strategy's."""

    def __init__(self, inner: Strategy, memory: "SpeculationMemory") -> None:
        self.inner = inner
        self.memory = memory

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        return self._remembered(self.inner.steps(prompt, params, should_stop), list(prompt[-PROMPT_KEPT:]))

    def generate(self, prompt: Sequence[int], params: GenParams,
                 should_stop: Callable[[], bool] = never) -> Iterator[Event]:
        return run_solo(self.steps(prompt, params, should_stop))

    def _remembered(self, inner: Steps, head: list[int]) -> Steps:
        def observe(event: Event) -> None:
            if isinstance(event, Done) and event.reason in ("eos", "length", "stop") and event.tokens:
                self.memory.add(head + list(event.tokens))

        return tap(inner, observe)
