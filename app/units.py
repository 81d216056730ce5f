"""Quantities as every front end shows them to people: the CLI's `specchat models` and the chat app's
models screen print the same sizes, so both take them from here (neither imports the other)."""

from __future__ import annotations


def format_size(n: float | None) -> str:
    """Bytes in decimal units (B, kB, MB, GB), "?" when unknown."""
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError
