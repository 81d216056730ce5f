"""Every strategy's settings: typed frozen dataclasses, validated in `__post_init__`.

Each field declares, beside itself, its flag, its label in the chat app's
settings panel, its range and the words it takes (backends.settings_schema);
the command line, the settings file, the F4 panel and the server's
`speculative` object are derived from those declarations. Kept apart from the
strategies themselves so that they can build and check settings without
loading llama.cpp (`specchat --help` stays instant).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from backends.settings_schema import Flag, Range, check_fields, setting

AT_LEAST_1 = Range(1)
PROBABILITY = Range(0.0, 1.0)
BELOW_1 = Range(0.0, 1.0, high_open=True)

# Flags that set several strategies' fields (each field below names the one it answers to).
DRAFT_MAX = Flag(("--draft-max",), "K: most tokens proposed per step", request_key="n_max")
DRAFT_P_MIN = Flag(("--draft-p-min",), "sps and the static tree: stop drafting (a branch) when the draft's top "
                                       "probability is below this", request_key="p_min")


@dataclass(frozen=True)
class SpsConfig:
    # Chosen by `python tests/perf/speed.py --sweep` on the demo pair (docs/results.md, "Earlier measurements").
    draft_max: int = setting(6, flag=DRAFT_MAX, label="sps: K", range=AT_LEAST_1)
    p_min: float = setting(0.4, flag=DRAFT_P_MIN, label="sps: p_min", range=BELOW_1)
    adaptive: bool = setting(True, label="sps: adaptive K", flag=Flag(
        ("--no-adaptive",), "sps: keep K fixed instead of adapting it to acceptance", sets=False))

    def __post_init__(self) -> None:
        check_fields(self, "sps")


@dataclass(frozen=True)
class LookupConfig:
    draft_max: int = setting(10, flag=DRAFT_MAX, label="lookup: K", range=AT_LEAST_1)
    ngram_max: int = setting(3, label="lookup: n-gram max", flag=Flag(
        ("--lookup-ngram-max",), "lookup: longest suffix to match in the context"))
    ngram_min: int = setting(1, flag=Flag(("--lookup-ngram-min",), "lookup: shortest suffix to match"))

    def __post_init__(self) -> None:
        check_fields(self, "lookup")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= --lookup-ngram-min <= --lookup-ngram-max")


@dataclass(frozen=True)
class LookaheadConfig:
    # Defaults: the best of a sweep on a 2-core CPU with the demo pair (docs/results.md, "Earlier measurements").
    window: int = setting(2, label="lookahead: W", range=AT_LEAST_1, flag=Flag(
        ("-W", "--lookahead-window"), "lookahead: window width W"))
    ngram: int = setting(3, label="lookahead: N", range=Range(2), flag=Flag(
        ("-N", "--lookahead-ngram"), "lookahead: n-gram size N, window levels N-1"))
    guesses: int = setting(2, label="lookahead: G", range=Range(0), flag=Flag(
        ("-G", "--lookahead-guesses"), "lookahead: most n-grams verified per step G"))
    seed_pool_from_prompt: bool = setting(False, flag=Flag(
        ("--lookahead-seed-prompt",), "lookahead: fill the n-gram pool from the prompt's own n-grams first", sets=True))

    def __post_init__(self) -> None:
        check_fields(self, "lookahead")

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
    depth: int = setting(4, label="tree: depth", range=AT_LEAST_1, flag=Flag(  # D
        ("--tree-depth",), "tree: longest drafted path"))
    # dynamic: children per expanded node, and nodes expanded per depth; static: most branches (n_seq_dft)
    top_k: int = setting(2, label="tree: top-k", range=AT_LEAST_1, flag=Flag(
        ("--tree-top-k",), "tree: children per expanded node and nodes expanded per depth; static shape: most "
                           "branches"))
    # M: nodes verified per step, or chosen per step from the cost curve
    nodes: int | Literal["auto"] = setting(8, label="tree: nodes M", range=AT_LEAST_1, words=(AUTO,), flag=Flag(
        ("--tree-nodes",), "tree: nodes verified per step, M, or 'auto': chosen every step from this device's "
                           "measured batch cost curve"))
    shape: Shape = setting("dynamic", label="tree: shape", choices=SHAPES, flag=Flag(
        ("--tree-shape",), "tree: dynamic = EAGLE-2's expand-and-rerank tree; static = llama.cpp speculative.cpp's "
                           "branch splitting"))
    # static: a further candidate starts a branch above this (llama.cpp's default)
    p_split: float = setting(0.1, label="tree: p_split", range=PROBABILITY, flag=Flag(
        ("--draft-p-split",), "tree, static shape: a further draft candidate starts a new branch above this "
                              "probability"))
    # static: a branch stops below this top probability (one flag with sps)
    p_min: float = setting(SpsConfig.p_min, flag=DRAFT_P_MIN, range=BELOW_1)

    def __post_init__(self) -> None:
        check_fields(self, "tree")

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
    memory: bool = True  # continuations from the speculation memory (backends.memory), when it is on
    lookahead: bool = True  # lookahead's window and n-gram pool (uses the lookahead settings)
    # most of the time spent trying options the estimates call worse
    explore_budget: float = setting(0.01, range=Range(0.0, 0.2))
    # longest draft chain or lookup proposal one step verifies
    draft_max: int = setting(12, flag=DRAFT_MAX, range=AT_LEAST_1)
    # Most root-to-leaf paths of the memory's candidate tree verified in one step (a sequence id each);
    # 1: its likeliest chain only.
    memory_paths: int = setting(8, range=AT_LEAST_1)

    def __post_init__(self) -> None:
        check_fields(self, "auto")


# The speculation memory's bound, in tokens (backends.memory; docs/results.md, "Speculation memory": its size
# on disk, load time and cost per step at this bound).
MEMORY_TOKENS = 500_000

# MiB of RAM the server's prompt cache may hold by default (backends.prompt_cache; llama-server's --cache-ram is
# 8192, but a laptop that runs the chat app beside the server has less to spare: 2 GiB holds 90,000 tokens of
# SmolLM2-135M's cells, 16,000 of an 8B model with 8 KV heads).
PROMPT_CACHE_MIB = 2048


@dataclass(frozen=True)
class SuffixConfig:
    """`suffix`: token trees from the speculation memory and the request (SuffixDecoding's shape rule)."""

    depth: int = setting(16, range=AT_LEAST_1)  # deepest continuation proposed
    max_nodes: int = setting(24, range=AT_LEAST_1)  # most tree nodes verified in one step
    # at most factor x the match length nodes (SuffixDecoding's alpha)
    factor: float = setting(2.0, range=Range(0.0, low_open=True))
    min_prob: float = setting(0.1, range=PROBABILITY)  # a node at least this share of the occurrences goes through

    def __post_init__(self) -> None:
        check_fields(self, "suffix")

    @property
    def n_seq_max(self) -> int:
        return self.max_nodes + 1


@dataclass(frozen=True)
class StrategyOptions:
    """Settings of every strategy; each takes its own part, the section named after it (a request's
    `speculative` object sets the fields of its strategy's section). `memory` False: this generation
    neither consults nor updates the speculation memory (a request that must not be remembered)."""

    sps: SpsConfig = field(default_factory=SpsConfig)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    auto: AutoConfig = field(default_factory=AutoConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    memory: bool = True
