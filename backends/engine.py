"""A loaded target (and optional draft) with their KV caches, and the strategies over them.

Every strategy built by one `Engine` shares the target's `KvSequence`, so
switching strategy between turns keeps the conversation's cache. The draft is
checked against the target with llama.cpp's compatibility rules before it is
loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from backends.config import AUTO_K_MAX, StrategyOptions
from backends.cost import CostCache, DeviceCost, cost_key, measure_device_cost
from backends.kv import KvSequence
from backends.llama import ContextConfig, LlamaContext, LlamaModel, build_info, default_threads, max_sequences
from backends.registry import NEEDS_DRAFT, STRATEGIES, n_seq_needed, spec
from backends.store import JsonStore
from backends.strategies.base import Strategy
from models.compat import require_compatible
from models.errors import ModelError
from models.gguf_info import validate_gguf
from models.paths import data_dir

__all__ = ["Engine", "EngineConfig", "StrategyOptions", "STRATEGIES", "NEEDS_DRAFT", "n_seq_needed"]
COST_CACHE_FILE = "device-cost.json"
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
    # Sequence ids the contexts allow (see n_seq_needed).
    n_seq_max: int = 1
    # Where measured device costs are kept between sessions; None: the data dir's, "" : not kept. What
    # strategies learnt (auto's estimates) is kept beside it, in LEARNT_FILE, or not at all.
    cost_cache: Path | None = None


def cost_cache_path(configured: Path | None) -> Path | None:
    """Where device costs are kept: as configured, else $SPECCHAT_COST_CACHE, else the data dir; "" keeps none."""
    if configured is None:
        env = os.environ.get("SPECCHAT_COST_CACHE")
        configured = Path(env) if env is not None else data_dir() / COST_CACHE_FILE
    return configured if str(configured) not in ("", ".") else None


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.n_seq_max > max_sequences():
            raise ModelError(f"these settings need {config.n_seq_max} sequences in one context, more than the "
                             f"{max_sequences()} llama.cpp allows (lookahead needs W+G+1, a tree one per path)")
        self.config = config
        self.target_info = validate_gguf(config.target)
        if config.draft is not None:
            require_compatible(self.target_info, validate_gguf(config.draft))
        ctx_config = ContextConfig(n_ctx=config.n_ctx, n_batch=config.n_batch, n_threads=config.threads)
        # llama.cpp aborts when a context has more sequences than batch rows (n_outputs_max): never ask it to.
        ctx_config = replace(ctx_config, n_seq_max=max(1, min(config.n_seq_max, config.n_batch, config.n_ctx)))
        self.target_model: LlamaModel = None  # type: ignore[assignment]  # set below, or there is no engine
        self.target: KvSequence = None  # type: ignore[assignment]
        self.draft_model: LlamaModel | None = None
        self.draft: KvSequence | None = None
        try:
            self.target_model = LlamaModel(config.target, config.n_gpu_layers, rpc=config.rpc)
            self.target = KvSequence(LlamaContext(self.target_model, ctx_config))
            if config.draft is not None:
                self.draft_model = LlamaModel(config.draft, config.n_gpu_layers_draft)
                self.draft = KvSequence(LlamaContext(self.draft_model, ctx_config))
        except BaseException:
            self.close()  # a load that fails halfway (the draft, an RPC server) frees what it had loaded
            raise
        cost_path = cost_cache_path(config.cost_cache)
        self._cost_cache = CostCache(cost_path)
        self._cost: DeviceCost | None = None
        # What `auto` has learnt about this engine's proposers, by sampling mode ("greedy", "sampled"), kept
        # across the turns of a conversation, and between sessions in the learnt store (a mode not here yet
        # is read from there when auto first runs in it).
        self.auto_states: dict[str, object] = {}
        self._learnt = JsonStore(cost_path.with_name(LEARNT_FILE) if cost_path is not None else None)
        self._read_learnt = True

    def tokenize(self, text: str) -> list[int]:
        return self.target_model.tokenize(text, add_special=True, parse_special=True)

    def strategy(self, name: str, options: StrategyOptions = StrategyOptions()) -> Strategy:
        """The named strategy over this engine's models and caches (backends.registry)."""
        return spec(name).build(self, options)

    # -- the device's measured cost -----------------------------------------

    @cached_property
    def _cost_key(self) -> str:
        """What the device's cost and what strategies learn depend on: the model files as loaded, threads,
        llama.cpp build and placement. Computed once: every generation of `auto` keeps its state under it."""
        c = self.config
        placement = [c.n_gpu_layers, c.n_gpu_layers_draft, list(c.rpc), self.target.ctx.config.n_ubatch,
                     self.target.batch.capacity]  # the batch size llama.cpp really has
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
        if self._cost is not None and not remeasure:
            return self._cost  # held: no need to stat the model files again
        key = self._cost_key
        if not remeasure:
            self._cost = self._cost_cache.get(key)
            if self._cost is not None:
                return self._cost
        context = list(self.target.tokens)
        k_max = min(k_max, self.target.n_ctx - len(context), self.target.batch.capacity)
        if k_max < 2 or not context:
            return None
        self._cost = measure_device_cost(self.target, self.draft, context, k_max, repeats)
        self._cost_cache.put(key, self._cost)
        return self._cost

    # -- what strategies learnt, kept between sessions -----------------------

    def learnt(self, name: str) -> dict | None:
        """What strategy `name` learnt on these model files, threads, build and placement in an earlier
        session (as it stored it with `keep_learnt`), or None: nothing kept, stale, or `learn_afresh` called."""
        return self._learnt.get(f"{name}:{self._cost_key}") if self._read_learnt else None

    def keep_learnt(self, name: str, entry: dict) -> None:
        """Keep what strategy `name` learnt (a JSON object with a `saved_at` time stamp) for later sessions."""
        self._learnt.put(f"{name}:{self._cost_key}", entry)

    def learn_afresh(self) -> None:
        """Strategies start from nothing learnt, here and for the rest of this engine's life (what they learn
        is still kept): `specchat bench` does, so that its figures do not depend on earlier sessions."""
        self.auto_states.clear()
        self._read_learnt = False

    def close(self) -> None:
        for seq in (self.target, self.draft):
            if seq is not None:
                seq.ctx.close()
        for model in (self.target_model, self.draft_model):
            if model is not None:
                model.close()
