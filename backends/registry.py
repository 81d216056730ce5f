"""One entry per strategy: every fact about a strategy lives here, as llama.cpp's
common_speculative types or vLLM's proposer registry keep them in one place.

An entry holds the name, the help line, whether it needs a draft model, the
sequence ids its contexts need, its label in the flag vocabulary (bench rows,
the chat app's stats bar), the settings grid `bench --sweep` tries, and how to
build it on an engine. Adding a strategy is one entry here plus its module,
and, if it has settings, their dataclass in backends.config as a section of
StrategyOptions named after it: each field declares there its flag, its F4
label, its range and words (backends.settings_schema), and the command line,
the settings file, the chat app's settings panel and the server's
`speculative` object take it from that declaration.

This module imports no llama.cpp: the command line and the chat app's
settings read it at start-up; the strategy modules are imported only when a
strategy is built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from backends.config import AutoConfig, StrategyOptions, TreeConfig

if TYPE_CHECKING:
    from backends.slot import Slot
    from backends.strategies.base import Strategy


@dataclass(frozen=True)
class StrategySpec:
    name: str
    help: str
    needs_draft: bool
    build: Callable[["Slot", StrategyOptions], "Strategy"]  # the strategy on one sequence's slot
    label: Callable[[StrategyOptions], str]
    n_seq: Callable[[StrategyOptions], int] = lambda _o: 1
    sweep: Callable[[StrategyOptions], list[StrategyOptions]] = lambda _o: []
    uses_draft: bool = False  # loads the draft model when one is given (always, when it needs one)
    # Bounded by what its speculation realises (backends.realised): alone, it is driven through a scheduler of one
    # whose ticks are timed and counted, as under load. The others' ticks would say nothing of its choices.
    realised: bool = False

    def __post_init__(self) -> None:
        if self.needs_draft:
            object.__setattr__(self, "uses_draft", True)


def require_draft(name: str, has_draft: bool) -> None:
    """ModelError (one line) when strategy `name` needs a draft model and none is given."""
    if REGISTRY[name].needs_draft and not has_draft:
        from models.errors import ModelError

        raise ModelError(f"strategy '{name}' needs a draft model (-md DRAFT), or use -s ar")


def _draft(slot: "Slot", name: str):
    require_draft(name, slot.draft is not None)
    return slot.draft


def _build_ar(slot: "Slot", o: StrategyOptions) -> "Strategy":
    from backends.strategies.ar import Autoregressive

    return Autoregressive(slot.target)


def _build_sps(slot: "Slot", o: StrategyOptions) -> "Strategy":
    from backends.strategies.sps import SpeculativeSampling

    return SpeculativeSampling(slot.target, _draft(slot, "sps"), o.sps)


def _build_lookahead(slot: "Slot", o: StrategyOptions) -> "Strategy":
    from backends.strategies.lookahead import LookaheadDecoding

    return LookaheadDecoding(slot.target, o.lookahead)


def _build_lookup(slot: "Slot", o: StrategyOptions) -> "Strategy":
    from backends.strategies.lookup import PromptLookup

    return PromptLookup(slot.target, o.lookup)


def _build_tree(slot: "Slot", o: StrategyOptions) -> "Strategy":
    from backends.strategies.tree import TreeSpeculation

    return TreeSpeculation(slot.target, _draft(slot, "tree"), o.tree, slot.device_cost)


def _build_suffix(slot: "Slot", o: StrategyOptions) -> "Strategy":
    from backends.strategies.suffix import SuffixSpeculation

    return SuffixSpeculation(slot.target, slot.memory() if o.memory else None, o.suffix)


def _build_auto(slot: "Slot", o: StrategyOptions) -> "Strategy":
    from backends.strategies.auto import AutoDecoding

    return AutoDecoding(slot, o)


def _sps_label(o: StrategyOptions) -> str:
    s = o.sps
    return f"sps K={s.draft_max} p_min={s.p_min}" + ("" if s.adaptive else " fixed")


def _lookahead_label(o: StrategyOptions) -> str:
    la = o.lookahead
    return f"lookahead W={la.window} N={la.ngram} G={la.guesses}" + (" seeded" if la.seed_pool_from_prompt else "")


def _tree_label(o: StrategyOptions) -> str:
    t = o.tree
    shape = " static" if t.shape == "static" else ""
    split = f" ps={t.p_split}" if t.shape == "static" and t.p_split != TreeConfig.p_split else ""
    return f"tree{shape} D={t.depth} k={t.top_k} M={t.nodes}{split}"


def _auto_label(o: StrategyOptions) -> str:
    a = o.auto
    off = [name for name, on in (("draft", a.draft), ("lookup", a.lookup), ("lookahead", a.lookahead)) if not on]
    k = f" K<={a.draft_max}" if a.draft_max != AutoConfig.draft_max else ""
    return "auto" + k + (f" without {'/'.join(off)}" if off else "")


def _grid(o: StrategyOptions, field: str, values: list[dict[str, object]]) -> list[StrategyOptions]:
    return [replace(o, **{field: replace(getattr(o, field), **v)}) for v in values]


REGISTRY: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec(
        "auto", "chooses every step between plain decoding, prompt lookup, lookahead and the draft model, "
                "from measured cost and live acceptance",
        needs_draft=False, build=_build_auto, label=_auto_label,
        n_seq=lambda o: max(o.lookahead.n_seq_max if o.auto.lookahead else 1,
                            o.auto.memory_paths + 1 if o.auto.memory and o.memory else 1), uses_draft=True,
        realised=True,
        sweep=lambda o: _grid(o, "auto", [{"draft": False}, {"lookup": False}, {"lookahead": False},
                                          {"draft_max": 6}]),
    ),
    StrategySpec("ar", "plain decoding", needs_draft=False, build=_build_ar, label=lambda _o: "ar"),
    StrategySpec(
        "sps", "draft-model speculative sampling", needs_draft=True, build=_build_sps, label=_sps_label,
        sweep=lambda o: _grid(o, "sps", [{"draft_max": k, "p_min": p} for k in (2, 3, 4, 6, 8) for p in (0.0, 0.4)]),
    ),
    StrategySpec(
        "lookahead", "lookahead decoding (Jacobi window + n-gram pool)", needs_draft=False, build=_build_lookahead,
        label=_lookahead_label, n_seq=lambda o: o.lookahead.n_seq_max,
        sweep=lambda o: _grid(o, "lookahead", [{"window": w, "ngram": n, "guesses": g} for w, n, g in
                                               ((2, 3, 2), (3, 3, 2), (4, 3, 4), (2, 4, 2), (8, 4, 8), (15, 5, 15))]),
    ),
    StrategySpec(
        "lookup", "prompt lookup decoding", needs_draft=False, build=_build_lookup,
        label=lambda o: f"lookup K={o.lookup.draft_max} n<={o.lookup.ngram_max}",
        sweep=lambda o: _grid(o, "lookup", [{"draft_max": k, "ngram_max": n}
                                            for k, n in ((4, 3), (10, 3), (16, 3), (10, 2))]),
    ),
    StrategySpec(
        "suffix", "token trees from the speculation memory of earlier outputs and the request (SuffixDecoding)",
        needs_draft=False, build=_build_suffix, n_seq=lambda o: o.suffix.n_seq_max,
        label=lambda o: f"suffix D={o.suffix.depth} M={o.suffix.max_nodes}" + ("" if o.memory else " no memory"),
        sweep=lambda o: _grid(o, "suffix", [{"max_nodes": m, "factor": f} for m, f in ((8, 1.0), (24, 4.0), (48, 4.0))]),
    ),
    StrategySpec(
        "tree", "token-tree speculation (EAGLE-2 dynamic tree, SpecInfer verification)", needs_draft=True,
        build=_build_tree, label=_tree_label, n_seq=lambda o: max(o.tree.target_seqs, o.tree.draft_seqs),
        # nodes "auto" picks M per step from the measured cost curve.
        sweep=lambda o: _grid(o, "tree", [{"depth": d, "top_k": k, "nodes": m, "shape": shape} for d, k, m, shape in (
            (3, 2, 6, "dynamic"), (5, 2, 10, "dynamic"), (4, 3, 12, "dynamic"), (6, 2, 12, "dynamic"),
            (4, 2, "auto", "dynamic"), (5, 3, "auto", "dynamic"), (6, 4, 12, "static"), (8, 4, "auto", "static"))]),
    ),
)}

STRATEGIES: tuple[str, ...] = tuple(REGISTRY)
NEEDS_DRAFT = frozenset(name for name, spec in REGISTRY.items() if spec.needs_draft)
DEFAULT_STRATEGY = "auto"


def spec(name: str) -> StrategySpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}") from None


def n_seq_needed(strategy: str, options: StrategyOptions) -> int:
    """Sequence ids the contexts need: lookahead W+G+1, a tree one per path (and per drafted node)."""
    return spec(strategy).n_seq(options)


def strategy_label(name: str, options: StrategyOptions) -> str:
    """A strategy and the settings it runs with, in the CLI's flag vocabulary."""
    return spec(name).label(options)
