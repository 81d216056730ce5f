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

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from backends.device_cost import DeviceCost
from backends.kv import KvSequence, Lane
from backends.memory import SpeculationMemory
from backends.realised import Realised
from backends.steps import BatchLoad
from backends.store import JsonStore

# What was learnt is written at a generation's end at most this often (and always when the engine closes): a
# process that ends without closing loses a minute of it at most. One write (the whole store, synced) took about
# 20 ms on the decoding thread: at every request's end it cost a server of short replies 3-4% of its throughput.
KEEP_EVERY = 60.0


class Learnt:
    """What strategies learnt on one engine's model files, threads, build and placement.

    `session` holds it in memory, by name, across the turns and requests of a
    session (what `auto` keeps is its own `AutoState` per sampling mode); the
    store keeps it between sessions (learnt.json beside the device cost cache),
    under `key` (computed once: every generation of `auto` keeps its state).

    The engine's timing is kept the same way, so that a new process starts
    from what the last one learnt on these files: each lane's live cost curve
    (`lanes`, under "live:" and the lane's name: taken up when the lane is
    seeded with the curve it was learnt against, backends.live_cost) and the
    scheduler's realised rates (`realised_for`, under "realised",
    backends.realised). Everything is written together, in one write of the
    store (`flush`): at a generation's end at most every KEEP_EVERY seconds,
    and when the engine closes; never while decoding.
    """

    def __init__(self, store: JsonStore, key: Callable[[], str],
                 lanes: Mapping[str, Lane | None] | None = None) -> None:
        self.session: dict[str, Any] = {}
        self._store = store
        self._key = key
        self._read = True
        self._lanes = {name: lane for name, lane in (lanes or {}).items() if lane is not None}
        for name, lane in self._lanes.items():
            lane.live.earlier = lambda name=name: self._earlier(f"live:{name}")
        self._realised: Realised | None = None  # this session's realised rates (every scheduler's), kept
        self._load_tick = 0  # its tick count when taken up
        self._pending: dict[str, dict | Callable[[], dict]] = {}  # what `keep` was given since the last write
        self._written = -math.inf  # when `flush` last wrote (time.monotonic)

    def kept(self, name: str) -> dict | None:
        """What `name` kept in an earlier session (with `keep`), or None: nothing kept, stale, or `afresh`."""
        return self._store.get(f"{name}:{self._key()}") if self._read else None

    def keep(self, name: str, entry: dict | Callable[[], dict]) -> None:
        """Keep what `name` learnt (a JSON object with a `saved_at` time stamp, or what makes it when it is
        written: the latest state then) for later sessions: written with the engine's timing by `flush`."""
        self._pending[name] = entry
        self.flush()

    def _earlier(self, name: str) -> dict | None:
        try:
            return self.kept(name)
        except OSError:  # a model file gone since it was loaded: nothing to key what was kept by
            return None

    def realised_for(self, load: BatchLoad) -> None:
        """The scheduler's load (a new scheduler's): its realised rates are this session's, as what strategies
        learnt is (a later scheduler on the same engine goes on from them); the first start from what an earlier
        session kept (none after `afresh`). Kept from now on."""
        if self._realised is None:
            self._realised = Realised.from_json(self._earlier("realised"))
            self._load_tick = self._realised.tick
        load.realised = self._realised

    def flush(self, force: bool = False) -> None:
        """Write what `keep` was given and the timing (the lanes' live curves and the scheduler's realised rates,
        those that learnt anything here), in one write: at most every KEEP_EVERY seconds, unless `force` (the
        engine closes). Never raises: what cannot be kept is learnt again."""
        now = time.monotonic()
        if self._store.path is None or not force and now - self._written < KEEP_EVERY:
            return
        try:
            entries = {name: entry() if callable(entry) else entry for name, entry in self._pending.items()}
            self._pending.clear()
            entries.update({f"live:{name}": lane.live.to_json() for name, lane in self._lanes.items()
                            if lane.live.observed})
            realised = self._realised
            if realised is not None and realised.tick != self._load_tick and realised.observed:
                entries["realised"] = realised.to_json()
            entries = {name: entry for name, entry in entries.items() if entry is not None}
            if entries:
                self._written = now
                key = self._key()
                self._store.put_many({f"{name}:{key}": entry for name, entry in entries.items()})
        except Exception:  # noqa: BLE001 - keeping is for later; it must never fail a generation or a close
            pass

    def afresh(self) -> None:
        """Start from nothing learnt, here and for the rest of this session (what is learnt is still kept):
        `specchat bench` does, so that its figures do not depend on earlier sessions."""
        self.session.clear()
        self._realised = None
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

    def own_cells(self) -> list[KvSequence]:
        """The sequences whose cells are their own: the target's, and the draft's unless it reads the target's
        (`KvSequence.owns_cells`). What counts or checks a slot's cells reads these, each cell once."""
        return [seq for seq in (self.target, self.draft) if seq is not None and seq.owns_cells]

    def reset(self) -> None:
        """Empty this slot's caches, the target's and the draft's (another slot's cells stay)."""
        for seq in (self.target, self.draft):
            if seq is not None:
                seq.reset()
