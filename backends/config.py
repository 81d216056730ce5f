"""Every strategy's settings: typed frozen dataclasses, validated in `__post_init__`.

Kept apart from the strategies themselves so that the command line, the chat
app's settings and the server can build and check them without loading
llama.cpp (`specchat --help` stays instant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class SpsConfig:
    # Chosen by `python tests/perf/speed.py --sweep` on the demo pair (docs/results.md, "Earlier measurements").
    draft_max: int = 6
    p_min: float = 0.4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.draft_max < 1:
            raise ValueError("--draft-max must be at least 1")
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError("--draft-p-min must be in [0, 1)")


@dataclass(frozen=True)
class LookupConfig:
    draft_max: int = 10
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.draft_max < 1:
            raise ValueError("--draft-max must be at least 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= --lookup-ngram-min <= --lookup-ngram-max")


@dataclass(frozen=True)
class LookaheadConfig:
    # Defaults: the best of a sweep on a 2-core CPU with the demo pair (docs/results.md, "Earlier measurements").
    window: int = 2  # W
    ngram: int = 3  # N
    guesses: int = 2  # G
    seed_pool_from_prompt: bool = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("-W must be at least 1")
        if self.ngram < 2:
            raise ValueError("-N must be at least 2")
        if self.guesses < 0:
            raise ValueError("-G must be at least 0")

    @property
    def n_seq_max(self) -> int:
        return self.window + self.guesses + 1

    @property
    def batch_size(self) -> int:
        w, n, g = self.window, self.ngram, self.guesses
        return 1 + g * (n - 1) + (w - 1) + w * (n - 2)



Shape = Literal["dynamic", "static"]
SHAPES: tuple[Shape, ...] = ("dynamic", "static")
AUTO = "auto"
# The auto budget's cost curve covers batches of 1..AUTO_K_MAX, so it verifies at most AUTO_K_MAX - 1 nodes.
AUTO_K_MAX = 16


@dataclass(frozen=True)
class TreeConfig:
    depth: int = 4  # D: longest path
    # dynamic: children per expanded node, and nodes expanded per depth; static: most branches (n_seq_dft)
    top_k: int = 2
    nodes: int | Literal["auto"] = 8  # M: nodes verified per step, or chosen per step from the cost curve
    shape: Shape = "dynamic"
    p_split: float = 0.1  # static: a further candidate starts a branch above this (llama.cpp's default)
    p_min: float = SpsConfig.p_min  # static: a branch stops below this top probability (one flag with sps)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or (self.nodes != AUTO and (not isinstance(self.nodes, int)
                                                                         or self.nodes < 1)):
            raise ValueError("tree depth, top-k and nodes must be at least 1 (nodes may be 'auto')")
        if self.shape not in SHAPES:
            raise ValueError(f"tree shape must be one of {', '.join(SHAPES)}")
        if not 0.0 <= self.p_split <= 1.0:
            raise ValueError("--draft-p-split must be in [0, 1]")
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError("--draft-p-min must be in [0, 1)")

    @property
    def auto(self) -> bool:
        return self.nodes == AUTO

    @property
    def drafted_nodes(self) -> int:
        """Most nodes one step drafts: the candidates selection chooses from."""
        if self.shape == "static":
            # At most top_k branches, one node each per depth; a fixed budget stops drafting at M.
            full = self.depth * self.top_k
            return full if self.auto else min(full, self.nodes)  # type: ignore[type-var]
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def max_nodes(self) -> int:
        """Most nodes one step verifies."""
        return min(self.drafted_nodes, AUTO_K_MAX - 1 if self.auto else self.nodes)  # type: ignore[type-var]

    @property
    def draft_seqs(self) -> int:
        """Sequence 0 and one scratch sequence per expanded node (dynamic) or per branch (static)."""
        return 1 + self.top_k * (1 if self.shape == "static" else self.depth)

    @property
    def target_seqs(self) -> int:
        """Sequence 0 and one per root-to-leaf path; a static tree has a leaf per branch at most."""
        leaves = min(self.max_nodes, self.top_k) if self.shape == "static" else self.max_nodes
        return 1 + leaves


@dataclass(frozen=True)
class AutoConfig:
    """`auto`: which proposers it may use, and how much exploring may cost.

    Lookup's n-gram sizes and lookahead's W/N/G come from those strategies'
    configs. The draft chain's and lookup's lengths are chosen every step, up
    to `draft_max` (the chain stops where the next token no longer pays; only
    a try of the draft, when its estimate is stale, drafts by sps's p_min, up
    to sps's K at first and a few tokens later).
    """

    draft: bool = True  # the draft-model chain (when a draft model is loaded)
    lookup: bool = True  # prompt lookup
    memory: bool = True  # continuations from the speculation memory (backends.suffix), when it is on
    lookahead: bool = True  # lookahead's window and n-gram pool (uses the lookahead settings)
    explore_budget: float = 0.01  # most of the time spent trying options the estimates call worse
    draft_max: int = 12  # longest draft chain or lookup proposal one step verifies
    # Most root-to-leaf paths of the memory's candidate tree verified in one step (a sequence id each);
    # 1: its likeliest chain only.
    memory_paths: int = 8

    def __post_init__(self) -> None:
        if not 0.0 <= self.explore_budget <= 0.2:
            raise ValueError("auto's exploration budget must be in [0, 0.2]")
        if self.draft_max < 1:
            raise ValueError("auto's draft_max must be at least 1")
        if self.memory_paths < 1:
            raise ValueError("auto's memory_paths must be at least 1")


# The speculation memory's bound, in tokens (backends.suffix; docs/results.md, "Speculation memory": its size
# on disk, load time and cost per step at this bound).
SUFFIX_CACHE_TOKENS = 500_000

# MiB of RAM the server's prompt cache may hold by default (backends.prompt_cache; llama-server's --cache-ram is
# 8192, but a laptop that runs the chat app beside the server has less to spare: 2 GiB holds 90,000 tokens of
# SmolLM2-135M's cells, 16,000 of an 8B model with 8 KV heads).
PROMPT_CACHE_MIB = 2048


@dataclass(frozen=True)
class SuffixConfig:
    """`suffix`: token trees from the speculation memory and the request (SuffixDecoding's shape rule)."""

    depth: int = 16  # deepest continuation proposed
    max_nodes: int = 24  # most tree nodes verified in one step
    factor: float = 2.0  # at most factor x the match length nodes (SuffixDecoding's alpha)
    min_prob: float = 0.1  # a node at least this share of the occurrences goes through

    def __post_init__(self) -> None:
        if self.depth < 1 or self.max_nodes < 1:
            raise ValueError("suffix's depth and max_nodes must be at least 1")
        if self.factor <= 0 or not 0.0 <= self.min_prob <= 1.0:
            raise ValueError("suffix's factor must be > 0 and min_prob in [0, 1]")

    @property
    def n_seq_max(self) -> int:
        return self.max_nodes + 1


@dataclass(frozen=True)
class StrategyOptions:
    """Settings of every strategy; each takes its own part. `suffix_cache` False: this generation neither
    consults nor updates the speculation memory (a request that must not be remembered)."""

    sps: SpsConfig = field(default_factory=SpsConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    auto: AutoConfig = field(default_factory=AutoConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    suffix_cache: bool = True
