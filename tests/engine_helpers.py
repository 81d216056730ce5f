"""Running a strategy to the end and checking the event stream's invariants on the way."""

from __future__ import annotations

from backends.engine import Engine, StrategyOptions
from backends.events import REJECTED, Done, Prefilled, StepEnd, Token
from backends.sampling import GenParams


def run_to_done(engine: Engine, strategy: str, prompt: list[int], params: GenParams,
                options: StrategyOptions = StrategyOptions()) -> Done:
    """Generate, assert the event order (Prefilled, Token..., Done) and output invariant, return the Done."""
    events = list(engine.strategy(strategy, options).generate(prompt, params))
    assert isinstance(events[0], Prefilled)
    assert isinstance(events[-1], Done)
    assert sum(isinstance(e, Done) for e in events) == 1
    body = events[1:-1]
    assert not body or isinstance(body[-1], StepEnd), "every step ends with StepEnd"
    done = events[-1]
    assert done.reason != "error", done.error
    out_tokens = [e for e in body if isinstance(e, Token) and e.kind != REJECTED]
    assert tuple(e.id for e in out_tokens) == done.tokens
    assert "".join(e.text for e in out_tokens) + done.tail == done.text
    steps = [e for e in body if isinstance(e, StepEnd)]
    assert len(steps) == done.stats.target_forwards
    return done
