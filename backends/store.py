"""What specchat measured or learnt on this device, kept between sessions in small JSON files.

One file maps a key (a hash of what the entry depends on: the model files,
the thread count, the llama.cpp build, where the layers run) to an entry, a
JSON object stamped with the time it was made. A stale entry (older than
`max_age`: a driver update or a new power profile does not change the key)
reads as absent, and so does an unreadable file: it is rewritten atomically
on the next `put`. A store without a path keeps nothing. Each write
replaces the whole file at once (models.files.write_atomic), so it is never
left half-written; two processes writing at the same moment (a chat and a
server on the same models) may lose one's entry, which only costs measuring
or learning it again.

Used for the device's batch cost curve (backends.device_cost.CostCache, so a new
session's first turn pays no calibration) and for what `auto` has learnt of a
model pair's acceptance (so a new session does not pay its first tries again).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from models.files import write_atomic

MONTH = 30 * 24 * 3600.0


class JsonStore:
    def __init__(self, path: Path | None, max_age: float = MONTH, stamp: str = "saved_at") -> None:
        self.path = path
        self.max_age = max_age
        self.stamp = stamp  # the entry's field holding its time.time()

    def _load(self) -> dict[str, object]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str, now: float | None = None) -> dict | None:
        """The entry under `key`, or None (none, stale, or not a JSON object with a time stamp)."""
        entry = self._load().get(key)
        if not isinstance(entry, dict):
            return None
        stamp = entry.get(self.stamp)
        if not isinstance(stamp, (int, float)) or (now if now is not None else time.time()) - stamp > self.max_age:
            return None
        return entry

    def put(self, key: str, entry: dict | None) -> None:
        """Store `entry` (which carries its own time stamp) under `key`; None forgets it."""
        self.put_many({key: entry})

    def put_many(self, entries: dict[str, dict | None]) -> None:
        """Store each entry under its key (None forgets it) in one write of the file."""
        if self.path is None or not entries:
            return
        data = self._load()
        for key, entry in entries.items():
            if entry is None:
                data.pop(key, None)
            else:
                data[key] = entry
        try:
            # Compact: json's C encoder serves no `indent` (indented, encoding a 70 kB store took 20 ms).
            write_atomic(self.path, json.dumps(data, separators=(",", ":")) + "\n")
        except OSError:
            pass  # a store that cannot be written only costs measuring or learning again next time
