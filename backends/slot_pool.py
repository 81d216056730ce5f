"""Many generations over one engine's slots, decoded together: what `specchat serve` and the load bench run.

`SlotPool` hands each admitted generation a free slot of the engine (its own
sequence ids and cells, backends.slot) and steps them all with one
`backends.scheduler.Scheduler`: a request joins at the next step and frees its
slot when it ends. Of the free slots it takes the one whose cache holds the
longest prefix of the prompt (of those, the least recently used), as
llama-server picks a slot by prompt similarity, so a conversation that comes
back decodes only its new turn; what a slot gives up for a new prompt (its
target's cells and its draft's) is kept in RAM and put back when its
conversation returns (backends.prompt_cache). A generation whose machine
raises, or ends in an error, ends alone and its slot is emptied (what a step
left half done in its caches is unknown).

The choices of one request (`n` > 1) share its prompt: the first decodes it,
the others wait for it (`backends.steps.PAUSE`) and then hold the same
cells (`KvSequence.copy_prefix`: a unified cache shares them, nothing is
decoded twice).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from backends.config import PROMPT_CACHE_MIB, StrategyOptions
from backends.events import Done, Event, Prefilled
from backends.kv import common_prefix
from backends.kv_store import KvDiskStore, kv_dir
from backends.prompt_cache import PromptCache
from backends.sampling import GenParams
from backends.scheduler import Scheduler
from backends.steps import PAUSE, Steps
from backends.strategies.base import never

if TYPE_CHECKING:
    from backends.engine import Engine


class SlotPool:
    def __init__(self, engine: "Engine", cache_mib: int = PROMPT_CACHE_MIB, kv_disk: int = 0) -> None:
        """`kv_disk`: the bound in bytes of the KV store on disk the prompt cache spills to (0: none; the
        server's --kv-cache-disk); a benchmark keeps it off, so that no run starts from another's cells."""
        self.engine = engine
        self.scheduler = Scheduler(engine.target_lane, engine.learnt)
        self.free = list(range(len(engine.slots)))
        folder = kv_dir() if kv_disk else None  # what leaves RAM, and the slots' cells when the server stops
        self.prompt_cache = PromptCache(cache_mib << 20, KvDiskStore(folder, engine.kv_key(), kv_disk)
                                        if folder is not None and cache_mib else None)
        self._admitted = 0
        self._last_used = [0] * len(engine.slots)  # when each slot last took a request (admissions so far)
        self.kv_errors = 0  # slots found holding other cells than their record after a generation (emptied)
        self._prefilled: dict[int, bool] = {}  # running slots: whether their prompt is in the cache
        # Cells the caches hold, and cells the slots' records account for, as counted after the last generation
        # ended (on the stepping thread: other threads read these two numbers, never llama.cpp's state).
        self.kv_cells = self.kv_cached = 0
        self.cache_stats = self.prompt_cache.stats()  # as of the last admission (read by other threads)
        for slot in engine.slots:  # auto prices its rows by the batch they join
            slot.load = self.scheduler.load

    def spill(self) -> None:
        """The server stops: the prompt cache and every slot's cells (target and draft) onto disk
        (backends.prompt_cache)."""
        self.prompt_cache.spill([(slot.target, slot.draft) for slot in self.engine.slots])

    @property
    def size(self) -> int:
        return len(self.engine.slots)

    @property
    def running(self) -> int:
        return self.size - len(self.free)

    def __len__(self) -> int:
        """Generations running."""
        return len(self.scheduler)

    def pick(self, prompt: Sequence[int]) -> int:
        """The free slot whose cache holds the longest prefix of `prompt`; of those, the least recently used
        (llama-server's LRU): the conversations the others hold may come back."""
        slots = self.engine.slots
        return max(self.free, key=lambda i: (common_prefix(slots[i].target.tokens, prompt), -self._last_used[i], -i))

    def admit(self, strategy: str, options: StrategyOptions, prompt: Sequence[int], params: GenParams,
              sink: Callable[[Event], None], on_end: Callable[[BaseException | None], None] = lambda _e: None,
              should_stop: Callable[[], bool] = never, share: int | None = None) -> int:
        """Start a generation in a free slot (there must be one); returns the slot.

        Raises at once what the strategy refuses before it starts (a prompt too
        long, settings the slot cannot hold); its events go to `sink`, and
        `on_end` hears when it ended (with the exception, if it raised).
        With `share`, the running slot of another choice of the same prompt:
        this one starts from the cells of that one's prompt once it is in.
        """
        slot = self.pick(prompt) if share is None else min(self.free)
        steps = self.engine.strategy(strategy, options, slot=slot).steps(prompt, params, should_stop)
        if share is not None:
            steps = self._sharing(share, slot, prompt, steps)
        else:
            s = self.engine.slots[slot]
            self.prompt_cache.before_prompt(s.target, s.draft, prompt)
            self.cache_stats = self.prompt_cache.stats()
        self.free.remove(slot)
        self._admitted += 1
        self._last_used[slot] = self._admitted
        self._prefilled[slot] = False
        failed = []

        def take(event: Event) -> None:
            if isinstance(event, Done) and event.reason == "error":
                failed.append(event)
            elif isinstance(event, Prefilled):
                self._prefilled[slot] = True
            sink(event)

        def ended(error: BaseException | None) -> None:
            del self._prefilled[slot]
            if error is not None or failed:
                self.reset(slot)
            elif not self.consistent(slot):
                self.kv_errors += 1
                self.reset(slot)
            self.free.append(slot)
            self.kv_cells, self.kv_cached = self.cells()
            on_end(error)

        self.scheduler.add(steps, take, ended)
        return slot

    def _sharing(self, src: int, dst: int, prompt: Sequence[int], steps: Steps) -> Steps:
        """`steps`, after waiting for slot `src` to have the prompt in its cache (or to end), from the cells of
        it that `src` holds (what it does not hold, after a failure, `steps` decodes itself)."""
        while self._prefilled.get(src) is False:
            yield PAUSE
        s, d = self.engine.slots[src], self.engine.slots[dst]
        for a, b in ((s.target, d.target), (s.draft, d.draft)):
            if a is not None and b is not None:
                b.copy_prefix(a, common_prefix(a.tokens, prompt[:-1]))
        yield from steps

    def consistent(self, slot: int) -> bool:
        """Whether a slot's caches hold what its record says: the main branch exactly its tokens, no scratch
        sequence a cell past it (scratch sequences may share the main branch's cells). Checked after every
        generation: one that is not is emptied (and counted in `kv_errors`), never decoded on."""
        for seq in self.engine.slots[slot].own_cells():
            n = len(seq.tokens)
            if seq.cells() != n or any(seq.ctx.pos_max(seq.base + i) >= n for i in range(1, seq.n_seq_max)):
                return False
        return True

    def cells(self) -> tuple[int, int]:
        """(cells held, cells accounted for): every sequence id of every slot, in the target's and the draft's
        cache, against the tokens the slots' records hold. A scratch sequence's cells within its main branch
        are the main branch's own (shared), so only what lies past it counts; a drafter that reads the target's
        cells and owns none (`KvSequence.owns_cells`, Gemma 4's assistant) counts zero times, or the target's
        would count twice. Equal unless cells leaked."""
        held = recorded = 0
        for s in self.engine.slots:
            for seq in s.own_cells():
                main = seq.cells()
                held += main + sum(max(0, seq.ctx.pos_max(seq.base + i) + 1 - main) for i in range(1, seq.n_seq_max))
                recorded += len(seq.tokens)
        return held, recorded

    def slots(self) -> list[dict[str, object]]:
        """Each slot as llama-server's /slots shows it: id, whether it is running, its context and cached
        tokens (read from this thread's records only: safe while another thread steps)."""
        free = set(self.free)
        return [{"id": i, "is_processing": i not in free, "n_ctx": s.target.n_ctx,
                 "cached_tokens": len(s.target.tokens)} for i, s in enumerate(self.engine.slots)]

    def reset(self, slot: int) -> None:
        """Empty a slot's caches."""
        self.engine.slots[slot].reset()

    def step(self) -> int:
        """One step of every running generation; how many still run."""
        return self.scheduler.step()

    def run(self) -> None:
        """Step until every generation has ended."""
        while self.step():
            pass
