"""A loaded target (and optional draft) with their KV caches, and the strategies over them.

Every strategy built by one `Engine` shares the target's `KvSequence`, so
switching strategy between turns keeps the conversation's cache. The draft is
checked against the target with llama.cpp's compatibility rules before it is
loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from backends.kv import KvSequence
from backends.llama import ContextConfig, LlamaContext, LlamaModel
from backends.strategies.ar import Autoregressive
from backends.strategies.base import Strategy
from backends.strategies.lookahead import LookaheadConfig, LookaheadDecoding
from backends.strategies.lookup import LookupConfig, PromptLookup
from backends.strategies.sps import SpeculativeSampling, SpsConfig
from backends.strategies.tree import TreeConfig, TreeSpeculation
from models.compat import require_compatible
from models.errors import ModelError
from models.gguf_info import validate_gguf

STRATEGIES = ("ar", "sps", "lookahead", "lookup", "tree")
NEEDS_DRAFT = frozenset({"sps", "tree"})


def n_seq_needed(strategy: str, options: "StrategyOptions") -> int:
    """Sequence ids the contexts need: lookahead W+G+1, a tree one per path (and per drafted node)."""
    if strategy == "lookahead":
        return options.lookahead.n_seq_max
    if strategy == "tree":
        return max(options.tree.target_seqs, options.tree.draft_seqs)
    return 1


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


@dataclass(frozen=True)
class StrategyOptions:
    """Settings of every strategy; each takes its own part."""

    sps: SpsConfig = SpsConfig()
    lookahead: LookaheadConfig = LookaheadConfig()
    lookup: LookupConfig = LookupConfig()
    tree: TreeConfig = TreeConfig()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.target_info = validate_gguf(config.target)
        if config.draft is not None:
            require_compatible(self.target_info, validate_gguf(config.draft))
        ctx_config = ContextConfig(n_ctx=config.n_ctx, n_batch=config.n_batch, n_threads=config.threads)
        self.target_model = LlamaModel(config.target, config.n_gpu_layers, rpc=config.rpc)
        ctx_config = replace(ctx_config, n_seq_max=config.n_seq_max)
        self.target = KvSequence(LlamaContext(self.target_model, ctx_config))
        self.draft_model: LlamaModel | None = None
        self.draft: KvSequence | None = None
        if config.draft is not None:
            self.draft_model = LlamaModel(config.draft, config.n_gpu_layers_draft)
            self.draft = KvSequence(LlamaContext(self.draft_model, ctx_config))

    def tokenize(self, text: str) -> list[int]:
        return self.target_model.tokenize(text, add_special=True, parse_special=True)

    def strategy(self, name: str, options: StrategyOptions = StrategyOptions()) -> Strategy:
        if name == "ar":
            return Autoregressive(self.target)
        if name == "sps":
            if self.draft is None:
                raise ModelError("strategy 'sps' needs a draft model (-md DRAFT)")
            return SpeculativeSampling(self.target, self.draft, options.sps)
        if name == "lookahead":
            return LookaheadDecoding(self.target, options.lookahead)
        if name == "lookup":
            return PromptLookup(self.target, options.lookup)
        if name == "tree":
            if self.draft is None:
                raise ModelError("strategy 'tree' needs a draft model (-md DRAFT)")
            return TreeSpeculation(self.target, self.draft, options.tree)
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")

    def close(self) -> None:
        for seq in (self.target, self.draft):
            if seq is not None:
                seq.ctx.close()
        for model in (self.target_model, self.draft_model):
            if model is not None:
                model.close()
