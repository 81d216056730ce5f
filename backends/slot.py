"""What a strategy runs on: one sequence's share of an engine, and nothing else of it.

As llama.cpp's common_speculative and vLLM's proposers receive the target,
the draft and their settings rather than the whole server, a strategy is
built on a `Slot`: the target's and the draft's sequences (backends.kv), the
device's measured cost curve, what strategies learnt on these models
(`Learnt`), and the load of the batch the sequence decodes in
(backends.steps.BatchLoad). The engine makes slots (backends.engine);
strategies never see it, so neither knows the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from backends.device_cost import DeviceCost
from backends.kv import KvSequence
from backends.memory import SpeculationMemory
from backends.steps import BatchLoad
from backends.store import JsonStore


class Learnt:
    """What strategies learnt on one engine's model files, threads, build and placement.

    `session` holds it in memory, by name, across the turns and requests of a
    session (what `auto` keeps is its own `AutoState` per sampling mode); the
    store keeps it between sessions (learnt.json beside the device cost cache),
    under `key` (computed once: every generation of `auto` keeps its state).
    """

    def __init__(self, store: JsonStore, key: Callable[[], str]) -> None:
        self.session: dict[str, Any] = {}
        self._store = store
        self._key = key
        self._read = True

    def kept(self, name: str) -> dict | None:
        """What `name` kept in an earlier session (with `keep`), or None: nothing kept, stale, or `afresh`."""
        return self._store.get(f"{name}:{self._key()}") if self._read else None

    def keep(self, name: str, entry: dict) -> None:
        """Keep what `name` learnt (a JSON object with a `saved_at` time stamp) for later sessions."""
        self._store.put(f"{name}:{self._key()}", entry)

    def afresh(self) -> None:
        """Start from nothing learnt, here and for the rest of this session (what is learnt is still kept):
        `specchat bench` does, so that its figures do not depend on earlier sessions."""
        self.session.clear()
        self._read = False


@dataclass
class Slot:
    target: KvSequence
    draft: KvSequence | None
    device_cost: Callable[[], DeviceCost | None]  # known, else measured now (where the engine measures on demand)
    learnt: Learnt
    load: BatchLoad = field(default_factory=BatchLoad)
    # The speculation memory of this vocabulary (backends.memory), opened on first use; None when it is off.
    memory: Callable[[], SpeculationMemory | None] = lambda: None
    # The device cost if it is known (cached or measured before), never measuring: for what must not wait.
    known_cost: Callable[[], DeviceCost | None] = lambda: None

    def reset(self) -> None:
        """Empty this slot's caches, the target's and the draft's (another slot's cells stay)."""
        for seq in (self.target, self.draft):
            if seq is not None:
                seq.reset()
