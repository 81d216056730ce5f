"""A loaded target (and optional draft) with their KV caches, shared by one or many sequences.

The engine loads the models and makes their contexts; a `Slot`
(backends.slot) is one sequence's share of them: its own sequence ids and
cells in the target's and the draft's context. One slot serves `specchat
run`, the chat app and `bench` (every strategy built on it shares the
target's sequence, so switching strategy between turns keeps the
conversation's cache); `specchat serve --parallel N` makes N, which decode
together (backends.scheduler). The draft is checked against the target with
llama.cpp's compatibility rules before it is loaded.

The drafter of a slot's sequences is one of four behind the same seam
(`KvSequence`): a draft model's own context, the target's MTP head
(backends.mtp: a target with NextN layers and no -md), an EAGLE-3 draft
(backends.eagle3: -md of architecture `eagle3`, which reads three of the
target's layers), a DFlash / DSpark block draft (backends.dflash: -md of
architecture `dflash`, which reads the target's layers into its own cells
and proposes a whole chain from one decode), or Gemma 4's assistant
(backends.gemma4_assistant: -md of architecture `gemma4-assistant`, MTP
blocks that read the target's cells and hold none). `drafter` says which.

KV memory: each slot may fill `n_ctx` positions, so the contexts hold
`n_ctx x n_parallel` cells (as Ollama's OLLAMA_NUM_PARALLEL multiplies its
context; llama-server divides -c among its slots instead).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from backends.config import AUTO_K_MAX, MEMORY_TOKENS, StrategyOptions
from backends.device_cost import CostCache, DeviceCost, cost_key, measure_device_cost
from backends.dflash import dflash_lanes
from backends.eagle3 import eagle3_lanes
from backends.gemma4_assistant import ASSISTANT_ARCHITECTURE, assistant_lanes
from backends.kv import KvSequence, Lane
from backends.kv_store import KvKey
from backends.llama import ContextConfig, LlamaContext, LlamaModel, build_info, default_threads, max_sequences
from backends.memory import SpeculationMemory
from backends.memory_file import memory_file, memory_dir
from backends.mtp_chain import mtp_lanes
from backends.reasoning import Thinking
from backends.registry import spec
from backends.scheduler import Alone, Scheduler
from backends.slot import Learnt, Slot
from backends.store import JsonStore
from backends.strategies.base import Remembering, Strategy
from backends.thread_count import FollowingCount, ThreadCount
from models.compat import require_compatible
from models.drafters import RS_ROLLBACK_ARCHITECTURES, mtp_heads
from models.errors import ModelError
from models.gguf_info import validate_gguf
from models.paths import data_dir

COST_CACHE_FILE = "device-cost.json"
RS_SNAPSHOTS = AUTO_K_MAX + 1  # a recurrent state's snapshots: a rejected chain of auto's longest is undone
LEARNT_FILE = "learnt.json"  # beside the cost cache: what strategies learnt (auto's acceptance estimates)


@dataclass(frozen=True)
class EngineConfig:
    target: Path
    draft: Path | None = None
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int | None = None
    n_gpu_layers: int = 0
    n_gpu_layers_draft: int = 0
    # llama.cpp RPC servers (HOST:PORT) whose devices take the target's offloaded layers (-ngl).
    rpc: tuple[str, ...] = ()
    # Sequence ids each slot's strategies may use (see n_seq_needed).
    n_seq_max: int = 1
    # Sequences decoded together (specchat serve --parallel); each has n_ctx positions and n_seq_max ids.
    n_parallel: int = 1
    # Where measured device costs are kept between sessions; None: the data dir's, "" : not kept. What
    # strategies learnt (auto's estimates) is kept beside it, in LEARNT_FILE, or not at all.
    cost_cache: Path | None = None
    # The speculation memory (backends.memory): kept and consulted, or not at all (--no-memory).
    memory: bool = True
    # Its folder (one file per vocabulary); None: $SPECCHAT_MEMORY_DIR, else the data dir's. Its bound, in tokens.
    memory_dir: Path | None = None
    memory_size: int = MEMORY_TOKENS
    # Draft with the target's own MTP head (backends.mtp) when the file carries one and no draft is given.
    mtp: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.memory, bool):  # the folder was once given here: say where it goes now
            raise TypeError(f"EngineConfig.memory is on or off, got {self.memory!r}; a folder for the "
                            "speculation memory is memory_dir")


def cost_cache_path(configured: Path | None) -> Path | None:
    """Where device costs are kept: as configured, else $SPECCHAT_COST_CACHE, else the data dir; "" keeps none."""
    if configured is None:
        env = os.environ.get("SPECCHAT_COST_CACHE")
        configured = Path(env) if env is not None else data_dir() / COST_CACHE_FILE
    return configured if str(configured) not in ("", ".") else None


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.n_parallel < 1:
            raise ValueError("n_parallel must be at least 1")
        if config.n_seq_max * config.n_parallel > max_sequences():
            raise ModelError(f"these settings need {config.n_seq_max * config.n_parallel} sequences in one context, "
                             f"more than the {max_sequences()} llama.cpp allows (lookahead needs W+G+1, a tree one "
                             f"per path, for each of the {config.n_parallel} parallel sequences)"
                             if config.n_parallel > 1 else
                             f"these settings need {config.n_seq_max} sequences in one context, more than the "
                             f"{max_sequences()} llama.cpp allows (lookahead needs W+G+1, a tree one per path)")
        self.config = config
        self.target_info = validate_gguf(config.target)
        draft_info = validate_gguf(config.draft) if config.draft is not None else None
        if draft_info is not None:
            require_compatible(self.target_info, draft_info)
        n_par = config.n_parallel
        ctx_config = ContextConfig(n_ctx=config.n_ctx * n_par, n_batch=config.n_batch, n_threads=config.threads)
        # llama.cpp aborts when a context has more sequences than batch rows (n_outputs_max): never ask it to.
        ids = max(1, min(config.n_seq_max, config.n_batch // n_par, config.n_ctx))
        # A recurrent target (Qwen3.5/3.6, ...) is cut back from per-token snapshots of its state, enough for the
        # longest chain `auto` verifies, and runs one sequence id per slot (models.drafters).
        self.recurrent = recurrent = self.target_info.architecture in RS_ROLLBACK_ARCHITECTURES
        if recurrent:
            ids = 1
        ctx_config = replace(ctx_config, n_seq_max=ids * n_par, n_rs_seq=RS_SNAPSHOTS if recurrent else 0)
        self.target_model: LlamaModel = None  # type: ignore[assignment]  # set below, or there is no engine
        self.draft_model: LlamaModel | None = None
        self.target_lane: Lane = None  # type: ignore[assignment]
        self.draft_lane: Lane | None = None
        # The target's own MTP head drafts when the file has one, its graph runs in llama.cpp and no draft is given.
        want_mtp = config.mtp and config.draft is None and mtp_heads(self.target_info) > 0
        # Who drafts: "draft" (a draft model), "mtp" (the target's own head), "eagle3" (an EAGLE-3 draft), "dflash" (a
        # DFlash or DSpark block draft), "gemma4-assistant" (Gemma 4's assistant file), or None.
        self.drafter: str | None = None
        mtp_drafts: list[KvSequence] = []  # the MTP head's, the EAGLE-3 or the DFlash draft's sequences, one per slot
        per_slot = config.n_ctx
        try:
            self.target_model = LlamaModel(config.target, config.n_gpu_layers, rpc=config.rpc, info=self.target_info,
                                           load_mtp=want_mtp)
            # Alone, a prompt fills whole batches; beside others, half of one, so they wait one chunk at most.
            chunk = None if n_par == 1 else config.n_batch // 2
            self.target_lane = Lane(LlamaContext(self.target_model, ctx_config), ids, chunk)
            per_slot = self.target_lane.ctx.n_ctx // n_par  # llama.cpp may round the context up
            if config.draft is not None:
                self.draft_model = LlamaModel(config.draft, config.n_gpu_layers_draft, info=draft_info)
                ctx_config = replace(ctx_config, n_rs_seq=RS_SNAPSHOTS if draft_info is not None
                                     and draft_info.architecture in RS_ROLLBACK_ARCHITECTURES else 0)
                if draft_info is not None and draft_info.architecture == "eagle3":
                    self.draft_lane, mtp_drafts = eagle3_lanes(self.target_lane, self.draft_model, ctx_config, ids,
                                                               chunk, n_par, per_slot)
                    self.drafter = "eagle3"
                elif draft_info is not None and draft_info.architecture == "dflash":
                    self.draft_lane, mtp_drafts = dflash_lanes(self.target_lane, self.draft_model, ctx_config, ids,
                                                               chunk, n_par, per_slot)
                    self.drafter = "dflash"
                elif draft_info is not None and draft_info.architecture == ASSISTANT_ARCHITECTURE:
                    self.draft_lane, mtp_drafts = assistant_lanes(self.target_lane, self.draft_model, ctx_config,
                                                                  ids, chunk, n_par, per_slot)
                    self.drafter = ASSISTANT_ARCHITECTURE
                else:
                    self.draft_lane = Lane(LlamaContext(self.draft_model, ctx_config), ids, chunk)
                    self.drafter = "draft"
            elif want_mtp and self.target_model.n_layer_nextn > 0:
                mtp_ctx = LlamaContext(self.target_model, replace(ctx_config, n_rs_seq=0), other=self.target_lane.ctx,
                                       mtp=True)  # the head's cache is attention only
                self.draft_lane, mtp_drafts = mtp_lanes(self.target_lane, mtp_ctx, ids, chunk, n_par, per_slot)
                self.drafter = "mtp"
            # As llama.cpp does at load: the first request does not page the weights in (LlamaContext.warm_up). The
            # drafters that read the target's hidden rows (MTP, EAGLE-3, DFlash) run only beside a target decode.
            for model, lane in ((self.target_model, self.target_lane),
                                (self.draft_model, self.draft_lane if self.drafter == "draft" else None)):
                if model is not None and lane is not None:
                    lane.ctx.warm_up([t for t in (model.bos, model.eos) if t >= 0] or [0])
        except BaseException:
            self.close()  # a load that fails halfway (the draft, an RPC server) frees what it had loaded
            raise
        if self.draft_lane is not None and self.draft_lane is not self.target_lane:
            self.draft_lane.live.follows = self.target_lane.live  # a busy core slows both (backends.live_cost)
        # On the CPU, the target decodes with as many of its threads as decode fastest now: fewer beside a busy
        # program (backends.thread_count); a draft model on the CPU too, with the target's count. Offloaded layers
        # run on their device, whatever the thread count.
        if config.n_gpu_layers == 0 and not config.rpc and self.target_lane.ctx.threads > 1:
            self.target_lane.threads = count = ThreadCount(self.target_lane.ctx.threads)
            if self.drafter == "draft" and self.draft_lane is not None and config.n_gpu_layers_draft == 0:
                self.draft_lane.threads = FollowingCount(count)
        cost_path = cost_cache_path(config.cost_cache)
        self._cost_cache = CostCache(cost_path)
        self._cost: DeviceCost | None = None
        # May a slot's first generation measure the device's cost? Not under a scheduler: measuring decodes at
        # once on the shared context, in the middle of a tick. `specchat serve` measures before it serves.
        self.measure_on_demand = n_par == 1
        # What strategies learnt on these files (auto's acceptance by sampling mode), kept across the turns of a
        # conversation and between sessions (LEARNT_FILE).
        self.learnt = Learnt(JsonStore(cost_path.with_name(LEARNT_FILE) if cost_path is not None else None),
                             lambda: self._cost_key, {"target": self.target_lane, "draft": self.draft_lane})
        self._memory: SpeculationMemory | None = None
        self._memory_dir = memory_dir(config.memory_dir) if config.memory else None
        self.slots: list[Slot] = []
        for i in range(n_par):
            target = KvSequence(self.target_lane, i * ids, ids, per_slot)
            draft = mtp_drafts[i] if mtp_drafts else \
                KvSequence(self.draft_lane, i * ids, ids, per_slot) if self.draft_lane is not None else None
            if draft is not None and not draft.owns_cells:
                draft.follow(target)  # it reads the target's cells: its record is the target's
            self.slots.append(Slot(target, draft, self._slot_cost, self.learnt, memory=self.memory,
                                   known_cost=self.known_device_cost))
        # Set up at load, not by the first request before its first token: the speculation memory, found by a hash
        # of the vocabulary (0.36 s of a restarted server's first request with Gemma's 262k tokens, docs/results.md).
        self.memory()
        # What a slot's cells depend on: the files as they were loaded, read once (a model file replaced on disk
        # while it runs must not key the cells of the one in memory). An MTP head's cells are the draft's, of the
        # target's own file.
        self._kv_key = KvKey.of(config.target, config.target if self.mtp else config.draft, self.target.n_ctx,
                                build_info())

    @property
    def mtp(self) -> bool:
        """Whether the target's own MTP head drafts."""
        return self.drafter == "mtp"

    @property
    def target(self) -> KvSequence:
        """The first slot's target sequence (the only one unless n_parallel > 1)."""
        return self.slots[0].target

    @property
    def draft(self) -> KvSequence | None:
        return self.slots[0].draft

    @property
    def auto_states(self) -> dict:
        """What `auto` learnt in this session, by sampling mode (Learnt.session)."""
        return self.learnt.session

    @auto_states.setter
    def auto_states(self, states: dict) -> None:
        self.learnt.session = states

    def _slot_cost(self) -> DeviceCost | None:
        return self.device_cost() if self.measure_on_demand else self.known_device_cost()

    def tokenize(self, text: str) -> list[int]:
        return self.target_model.tokenize(text, add_special=True, parse_special=True)

    def strategy(self, name: str, options: StrategyOptions = StrategyOptions(), slot: int = 0) -> Strategy:
        """The named strategy on one of this engine's slots (backends.registry). With the speculation memory
        on (and the options not refusing it), what it generates is remembered (Remembering). A thinking model's
        output is split into reasoning and answer where GenParams.reasoning asks (backends.reasoning.Thinking). One
        bounded by what it realises (`auto`) is driven alone through a scheduler (backends.scheduler.Alone)."""
        entry = spec(name)
        try:
            built = entry.build(self.slots[slot], options)
        except ValueError as e:  # too few sequences: on a recurrent target, say why there is one
            if not self.recurrent:
                raise
            raise ModelError(f"{e}: {self.target_info.architecture} keeps a recurrent state, which runs one sequence "
                             "per request here; use auto, sps, lookup or ar") from None
        strategy: Strategy = Thinking(built, self.target_model)
        memory = self.memory() if options.memory else None
        if memory is not None:
            strategy = Remembering(strategy, memory)
        if not entry.realised:
            return strategy
        # `auto` alone is a batch of one: its ticks are timed and counted as under load (backends.realised), on the
        # slot's load, with the rates every scheduler of this engine shares.
        return Alone(strategy, lambda: Scheduler(self.target_lane, self.learnt, self.slots[slot].load))

    # -- the speculation memory -------------------------------------------------

    def memory(self) -> SpeculationMemory | None:
        """This vocabulary's speculation memory (backends.memory), opened on first use; None when off."""
        if self._memory is None and self._memory_dir is not None:
            model = self.target_model
            self._memory = SpeculationMemory(memory_file(self._memory_dir, model.vocab_hash), model.vocab_hash,
                                       model.n_vocab, self.config.memory_size,
                                       warn=lambda m: print(f"specchat: warning: {m}", file=sys.stderr, flush=True))
        return self._memory

    # -- the device's measured cost -----------------------------------------

    @cached_property
    def _cost_key(self) -> str:
        """What the device's cost and what strategies learn depend on: the model files as loaded, threads,
        llama.cpp build and placement. Computed once: every generation of `auto` keeps its state under it."""
        c = self.config
        placement = [c.n_gpu_layers, c.n_gpu_layers_draft, list(c.rpc), self.target.ctx.config.n_ubatch,
                     self.target.batch.capacity]  # the batch size llama.cpp really has
        if self.drafter in ("mtp", "eagle3", "dflash", ASSISTANT_ARCHITECTURE):
            placement.append(self.drafter)  # the target's own head, or a draft that reads the target's layers
        return cost_key(c.target, c.draft, c.threads or default_threads(), build_info(), placement)

    def device_cost(self, k_max: int = AUTO_K_MAX, repeats: int = 2, remeasure: bool = False) -> DeviceCost | None:
        """This device's batch cost curve and draft cost: from the cache on disk, else measured now.

        Measured once per (model files, threads, llama.cpp build, placement)
        and kept on disk, so later sessions pay nothing; measuring takes about
        a second, right after a prefill (it appends cells after what the
        target's cache holds and removes them, and syncs the draft's cache to
        the same tokens). None when the context has no room for a batch of 2
        yet; the next call tries again. `remeasure` measures now whatever is
        known (`specchat bench` does, so later sessions decide with its curve).
        """
        if not remeasure and self.known_device_cost() is not None:
            return self._cost
        key = self._cost_key
        context = list(self.target.tokens)
        k_max = min(k_max, self.target.n_ctx - len(context), self.target.batch.capacity)
        if k_max < 2 or not context:
            return None
        self._cost = measure_device_cost(self.target, self.draft, context, k_max, repeats)
        self._cost_cache.put(key, self._cost)
        return self._cost

    def measure_now(self, context: list[int], k_max: int = AUTO_K_MAX) -> DeviceCost | None:
        """The device's cost, measured now after `context` on the first slot unless known already with a curve
        of at least `k_max` batch sizes (the server measures before it serves, to the largest batch it allows);
        the first slot is empty afterwards."""
        if self.measured_to(k_max):
            return self.known_device_cost()
        slot = self.slots[0]
        try:
            slot.target.sync(context, logits=False)
            if slot.draft is not None:
                slot.draft.sync(context, logits=False)
            return self.device_cost(k_max, remeasure=True)
        finally:
            slot.reset()

    def kv_key(self) -> KvKey:
        """What a slot's cells depend on, for KV files (backends.kv_store), as the files were loaded."""
        return self._kv_key

    def measured_to(self, k_max: int = AUTO_K_MAX) -> bool:
        """Is the device's cost known (this session or on disk) with a curve of at least `k_max` batch sizes, so
        that `measure_now(_, k_max)` measures nothing?"""
        known = self.known_device_cost()
        return known is not None and len(known.batch.seconds) >= k_max

    def known_device_cost(self) -> DeviceCost | None:
        """The device's cost as measured before (in this session or kept on disk), without measuring."""
        if self._cost is None:
            self._cost = self._cost_cache.get(self._cost_key)
        return self._cost

    # -- what strategies learnt, kept between sessions -----------------------

    def learn_afresh(self) -> None:
        """Strategies start from nothing learnt, here and for the rest of this engine's life (Learnt.afresh)."""
        self.learnt.afresh()

    def close(self) -> None:
        if getattr(self, "learnt", None) is not None:
            self.learnt.flush(force=True)  # what was learnt, the lanes' live curves, the realised rates: for the next process
        if getattr(self, "_memory", None) is not None:
            self._memory.flush()  # type: ignore[union-attr]
        for lane in (self.draft_lane, self.target_lane):  # an MTP or EAGLE-3 context reads the target's: first
            if lane is not None:
                lane.ctx.close()
        for model in (self.target_model, self.draft_model):
            if model is not None:
                model.close()
