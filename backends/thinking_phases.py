"""The phases of one thinking model's answer: what they share, and how their Dones make one.

backends.reasoning.Thinking runs an answer as several ordinary generations
of the strategy it wraps (a phase up to the start tag, the thinking up to the
end tag or the budget, the answer; with forced tokens between them), each
continuing from the prompt and what the phases before it wrote. `PhaseRun`
is one answer's state across them: the splitter that labels every token's
text by channel, text a phase's Done released with no token to carry it
(handed on with the next token), forced tokens waiting for the answer's
phase to say its prompt is in, and the phases so far as one Done. It is the
seam that keeps each phase of Thinking a few lines of its own; the phases'
rules (which follow llama.cpp's common/reasoning-budget.cpp and its chat
parsers) are backends.reasoning's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Generator, Iterator, Sequence

from backends.errors import PromptError
from backends.events import Done, Event, GenStats, Prefilled, Token
from backends.sampling import GenParams
from backends.steps import Steps, relay

if TYPE_CHECKING:
    from backends.harmony import HarmonySplitter
    from backends.splitter import Splitter
    from backends.strategies.base import Strategy


def merge_stats(a: GenStats, b: GenStats | None, forced: int) -> GenStats:
    """The stats of an answer made of two phases with `forced` tokens between them (`b` None: one phase, then
    the forced tokens, if any)."""
    by_source = dict(a.tokens_by_source)
    if forced:
        by_source["grammar"] = by_source.get("grammar", 0) + forced
    if b is None:
        return replace(a, generated_tokens=a.generated_tokens + forced, tokens_by_source=by_source)

    def add(x: Sequence[int], y: Sequence[int]) -> tuple[int, ...]:
        n = max(len(x), len(y))
        return tuple((x[i] if i < len(x) else 0) + (y[i] if i < len(y) else 0) for i in range(n))

    def sums(x: dict, y: dict) -> dict:
        return {k: x.get(k, 0) + y.get(k, 0) for k in {**x, **y}}

    return replace(a, generated_tokens=a.generated_tokens + forced + b.generated_tokens,
                   decode_seconds=a.decode_seconds + b.prompt_seconds + b.decode_seconds,
                   target_forwards=a.target_forwards + b.target_forwards, drafted=a.drafted + b.drafted,
                   accepted=a.accepted + b.accepted,
                   accepted_per_position=add(a.accepted_per_position, b.accepted_per_position),
                   drafted_per_position=add(a.drafted_per_position, b.drafted_per_position),
                   tokens_by_source=sums(by_source, b.tokens_by_source),
                   steps_by_choice=sums(a.steps_by_choice, b.steps_by_choice),
                   extra={**a.extra, **b.extra})


def joined(a: Done, b: Done) -> Done:
    """Two phases as one: `a`'s tokens, then `b`'s, ending as `b` ends."""
    return replace(b, stats=merge_stats(a.stats, b.stats, 0), tokens=a.tokens + b.tokens)


class PhaseRun:
    """One answer's phases over `inner`: the state they share (see the module). `piece` renders a token as the
    output's text shows it (the tags' control tokens included, backends.text.rendering)."""

    def __init__(self, inner: "Strategy", prompt: list[int], params: GenParams, should_stop: Callable[[], bool],
                 splitter: "Splitter | HarmonySplitter", piece: Callable[[int], bytes]) -> None:
        self.inner, self.prompt, self.params, self.should_stop = inner, prompt, params, should_stop
        self.splitter = splitter
        self.piece = piece
        self.ends: list[Done] = []
        # Text a phase's Done released with no token to carry it (held back as a stop string's possible start):
        # handed on with the next token, or in the last Done's tail, so that the pieces still make the whole.
        self.carry = ["", ""]  # reasoning, answer
        self.waiting: list[Token] = []  # forced tokens to hand on once the answer's phase says its prompt is in
        self.prefilled = False
        self.first: Done | None = None  # the phases before the answer's, as one
        self.lead: list[int] = []  # tokens forced before any phase ran (a budget of 0 in a block the prompt opened)

    @property
    def written(self) -> list[int]:
        """The tokens the phases so far wrote (forced ones between them included)."""
        return list(self.first.tokens) if self.first is not None else list(self.lead)

    def add_forced(self, tokens: list[int]) -> None:
        """Forced tokens (handed on already) as part of the phases so far, as the grammar's."""
        if self.first is None:
            self.lead += tokens
        elif tokens:
            self.first = replace(self.first, tokens=self.first.tokens + tuple(tokens),
                                 stats=merge_stats(self.first.stats, None, len(tokens)))

    def start(self, params: GenParams) -> Steps | None:
        """The strategy's machine for the next phase, up to the tokens left; None where none can run (no token
        left, cancelled, the context full)."""
        room = self.params.max_tokens - len(self.written)
        if room < 1 or self.should_stop():
            return None
        try:
            # The phase's draws go on from the answer's place (backends.sampling.Noise), not from its first again.
            return self.inner.steps(self.prompt + self.written,
                                    replace(params, max_tokens=min(room, params.max_tokens),
                                            first_place=len(self.written)), self.should_stop)
        except PromptError:  # the context is full: after what the phases wrote, the answer's end
            if not self.written:
                raise
            return None

    def cut_short(self, forced: Sequence[int] = ()) -> Iterator[Event]:
        """The end where no phase could run (see `start`): the answer's Done, Prefilled first if none was sent."""
        if not self.prefilled:
            yield Prefilled(len(self.prompt), 0.0)
            yield from self.waiting
        yield self.done(list(forced), None, "cancelled" if self.should_stop() else "length")

    def carried(self, pieces: tuple[str, str]) -> None:
        self.carry[0] += pieces[0]
        self.carry[1] += pieces[1]

    def labelled(self, event: Event) -> Iterator[Event]:
        """A phase's event as the answer's: a token's text split by channel, its Done kept, one Prefilled."""
        if isinstance(event, Token):
            if event.kind == "rejected":
                yield replace(event, channel=self.splitter.channel)
                return
            reasoning, content = self.splitter.push(event.text)
            reasoning, content = self.carry[0] + reasoning, self.carry[1] + content
            self.carry[:] = ["", ""]
            yield replace(event, text=content, reasoning=reasoning, channel=self.splitter.channel)
        elif isinstance(event, Done):
            self.ends.append(event)
        elif isinstance(event, Prefilled):
            if not self.prefilled:
                self.prefilled = True
                yield event
                yield from self.waiting
                self.waiting.clear()
        else:
            yield event

    def phase(self, params: GenParams) -> Generator[Event, object, Done]:
        """A phase before the answer's: the strategy's generation after the prompt and what the phases so far
        wrote, joined to them; the text its Done released goes to the splitter. Returns its Done."""
        yield from self.relay(self.inner.steps(self.prompt + self.written, params, self.should_stop))
        return self.ended()

    def relay(self, steps: Steps) -> Steps:
        return relay(steps, self.labelled)

    def ended(self) -> Done:
        """The phase just run (its Done returned), joined to those before it (see `phase`)."""
        done = whole = self.ends[-1]
        if self.first is None and self.lead:
            whole = replace(done, tokens=tuple(self.lead) + done.tokens,
                            stats=merge_stats(done.stats, None, len(self.lead)))
        self.first = whole if self.first is None else joined(self.first, done)
        self.carried(self.splitter.push(done.tail))
        return done

    def after_tag(self, done: Done, tag: str) -> str | None:
        """Where a phase stopped at `tag` (a stop string, not one of the user's): the text its last token wrote
        after the tag (the tokens hold it, the text does not); None where it ended otherwise."""
        if done.reason != "stop":
            return None
        text = b"".join(self.piece(t) for t in done.tokens).decode("utf-8", errors="replace")[len(done.text):]
        return text[len(tag):] if text.startswith(tag) else None

    def hand_on(self, tokens: list[Token]) -> Iterator[Token]:
        """Forced tokens: handed on now, or once the answer's phase says its prompt is in."""
        if self.prefilled:
            yield from tokens
        else:
            self.waiting.extend(tokens)

    def done(self, forced: list[int], second: Done | None, reason: str | None = None) -> Done:
        """One Done for the phases: all their tokens, the answer as text, the reasoning whole."""
        first, splitter, carry = self.first, self.splitter, self.carry
        if first is None:
            forced = self.lead + forced
        last = second or first
        if second is not None:
            carry[1] += splitter.push(second.tail)[1]
        carry[1] += splitter.flush()[1]
        tail = carry[1]
        if first is not None:
            stats = merge_stats(first.stats, second.stats if second is not None else None, len(forced))
        elif second is not None:  # a budget of 0 where the prompt opens the block: no thinking phase ran
            stats = merge_stats(second.stats, None, len(forced))
        else:
            stats = GenStats(strategy=getattr(self.inner, "name", ""), prompt_tokens=len(self.prompt),
                             prompt_cached=0, prompt_seconds=0.0, generated_tokens=len(forced), decode_seconds=0.0,
                             target_forwards=0, drafted=0, accepted=0,
                             tokens_by_source={"grammar": len(forced)} if forced else {})
        tokens = (tuple(first.tokens) if first is not None else ()) + tuple(forced) + \
            (tuple(second.tokens) if second is not None else ())
        return Done(reason=(reason or (last.reason if last is not None else "length")),  # type: ignore[arg-type]
                    stats=stats, tokens=tokens, text=splitter.content, tail=tail,
                    error=last.error if last is not None else None, reasoning=splitter.reasoning)
