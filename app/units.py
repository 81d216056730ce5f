"""Quantities as every front end shows them to people: the CLI's `specchat models` and the chat app's
models screen print the same sizes, so both take them from here (neither imports the other)."""

from __future__ import annotations

import math


def format_size(n: float | None) -> str:
    """Bytes in decimal units (B, kB, MB, GB), "?" when unknown."""
    if n is None:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def parse_size(text: str) -> int:
    """Bytes from "2G", "500M", "64k", "0" or a plain number (decimal units, as format_size writes them;
    a trailing "B" is allowed); ValueError in words otherwise."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    t = text.strip().upper().removesuffix("B")
    unit = t[-1:] if t[-1:] in units and t[-1:] else ""
    number = t[:-1] if unit else t
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # "inf", "nan" parse as floats
        raise ValueError(f"{text!r} is not a size (e.g. 2G, 500M, 0)")
    if value < 0:
        raise ValueError(f"{text!r}: a size is 0 or more")
    return int(value * units[unit])
