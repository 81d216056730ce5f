"""Synthetic ticks for the realised check's tests (tests/test_realised.py, tests/test_realised_kept.py)."""

from __future__ import annotations

from typing import Callable

from backends.realised import Realised


def _ticks(realised: Realised, n: int, sequences: int, speculated: bool, tokens: int, seconds: float) -> None:
    for _ in range(n):
        realised.add(sequences, speculated, tokens, seconds)
        realised.next_tick()


def _drive(r: Realised, ticks: int, sequences: int, tick: Callable[[str], tuple[int, float]]) -> list[str]:
    """Ticks as the scheduler runs them under `auto`: each decodes the rows its sequences chose in the tick
    before, and in it they choose the next tick's (allowed to: they decide, `deciding`). `tick(rows)` gives the
    tokens and seconds of a tick whose rows were "held" (no decision) or "decided"."""
    rows, kinds = "held", []
    for _ in range(ticks):
        decides = r.allows(sequences)
        if decides:
            r.deciding()
        tokens, seconds = tick(rows)
        r.add(sequences, tokens > sequences, tokens, seconds)
        r.next_tick()
        kinds.append(rows)
        rows = "decided" if decides else "held"
    return kinds
