"""The scheduler's ticks, one JSON line each: where `auto`'s time went, for whoever measures it.

The realised check (backends.realised) judges speculation by decayed rates
per batch size; when a cell of the machine matrix reads under the bar, those
rates alone do not say why: speculating ticks that cost more than they gave,
batch sizes where nothing was judged yet, or plain ticks that were slower
than plain decoding's. With SPECCHAT_TICK_LOG naming a file, every scheduler
(`specchat serve`, `bench --clients`) appends a line per tick to it:

    {"pid": 1314, "t": 1764512345.123, "tick": 4951, "sequences": 8, "rows": 18, "kind": "speculated",
     "verdict": false, "tokens": 12, "seconds": 0.2495, "switching": 0.0, "threads": 1, "decode": 0.2301,
     "draft": 0.0112}

`kind` is what the realised check counted the tick as ("speculated",
"plain", "decided", "speculated+decided", as backends.realised.Realised.add
returns it; "learning" where an option still being learnt, or a try, chose
its rows, "switch" where a draft only caught up and nothing was verified,
"prompt" for a prompt chunk: these are not counted), `verdict` what
`Realised.pays` said at that batch size before the tick was counted (None:
not enough evidence to judge), `threads` what the target's decodes ran with
at the tick's end (backends.thread_count), `decode` and `draft` the seconds
the tick spent in llama_decode on the target's lane and on the others (a
draft's): the rest of `seconds` is the host's (the step machines, sampling,
events), where `auto`'s own work shows against plain decoding's. Several
processes may append to one file (a line is written whole, with O_APPEND):
`pid` tells them apart.
tests/perf/tick_log.py sums a log by process, batch size and kind.

Off unless the variable is set; a file that cannot be written is one warning
on stderr and no log, never a failed decode.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO

ENV = "SPECCHAT_TICK_LOG"


class TickLog:
    """Appends a scheduler's ticks to one file (line-buffered: a line is whole on disk when the tick ends)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._pid = os.getpid()

    @classmethod
    def from_env(cls) -> "TickLog | None":
        """The log SPECCHAT_TICK_LOG names, or None (unset, or the file cannot be opened: said once). One per
        process and file: every scheduler a process makes (`bench` makes one per run) writes through it."""
        path = os.environ.get(ENV)
        if not path:
            return None
        if (log := _OPEN.get(path)) is not None and log._pid == os.getpid():
            return log
        try:
            log = _OPEN[path] = cls(open(path, "a", buffering=1, encoding="utf-8"))
        except OSError as e:
            print(f"specchat: {ENV}: cannot write {path}: {e.strerror or e}; ticks not logged", file=sys.stderr)
            os.environ.pop(ENV, None)  # said once per process, not per scheduler
            return None
        return log

    def tick(self, tick: int, sequences: int, rows: int, kind: str, verdict: bool | None, tokens: int,
             seconds: float, switching: float, threads: int | None, decode: float = 0.0, draft: float = 0.0) -> None:
        try:
            self._stream.write(json.dumps({
                "pid": self._pid, "t": round(time.time(), 3), "tick": tick, "sequences": sequences, "rows": rows,
                "kind": kind, "verdict": verdict, "tokens": tokens, "seconds": round(seconds, 5),
                "switching": round(switching, 5), "threads": threads, "decode": round(decode, 5),
                "draft": round(draft, 5)}) + "\n")
        except (OSError, ValueError):  # a full disk, a closed file: the log stops, decoding goes on
            self._stream = _Closed()


_OPEN: dict[str, TickLog] = {}  # this process's logs by path (a forked child opens its own: its pid differs)


class _Closed:
    def write(self, _text: str) -> int:
        return 0
