"""The catalog of known-good draft/target pairs (packaged data: models/catalog.json).

Each model names a GGUF repo on the Hugging Face Hub and a file glob with a
`{quant}` placeholder (bartowski, unsloth and Qwen name their files
`<Model>-<QUANT>.gguf`); sizes are the approximate file sizes per quantization
as the repos list them. The RAM a pair needs is estimated as both files
(llama.cpp maps the weights) plus both KV caches at a 4096-token context plus
a fixed allowance for compute buffers and the process itself.

A model may carry its own drafter (`"drafter"`): `{"kind": "mtp", "heads": N}`
for a target whose file holds N MTP (NextN) layers after its trunk, which
draft with no draft file (backends.mtp), `"eagle3"` for an EAGLE-3 draft
file, which runs beside its target and reads its hidden states
(backends.eagle3), or `"dflash"` for a DFlash block draft file, which runs
beside its target too and drafts a block per decode from its layers
(backends.dflash). A pair names a target and a draft; its draft may be left
out where the target carries an MTP head, and `"drafter"` on a pair
("mtp", "eagle3" or "dflash") says which of them the pair drafts with when the
models do not say it themselves.

A model that thinks before answering says how (`"thinking"`): between tags,
`{"tags": [start, end], "can_disable": bool}` (Qwen3's `<think>`…`</think>`;
`"format": "tags"` may be written or left out), or in harmony's analysis
channel, `{"format": "harmony"}` (gpt-oss: its reasoning effort bounds the
thinking, which its template cannot turn off). The names are
backends.reasoning's, which finds the same from the file's template at load
(`detect_format`: a ReasoningFormat with tags, or HARMONY, whose `channels`
are harmony's). Every malformed entry is refused in one line (`CatalogError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from models.errors import ModelError

RUNTIME_OVERHEAD_GB = 0.5  # llama.cpp compute buffers + Python + the UI, measured order of magnitude
# How a pair drafts: the target's own head, an EAGLE-3 file, a DFlash file, a draft model.
MTP, EAGLE3, DFLASH, DRAFT = "mtp", "eagle3", "dflash", "draft"
DRAFTER_KINDS = (MTP, EAGLE3, DFLASH)
DRAFT_FILES = (EAGLE3, DFLASH)  # drafters that are a file of their own, made for one target's hidden states
KIND_NAMES = {MTP: "an MTP head", EAGLE3: "an EAGLE-3 draft", DFLASH: "a DFlash draft"}
# How a model thinks: a block between two tags, or gpt-oss's harmony channels (backends.reasoning, backends.harmony).
TAGS, HARMONY = "tags", "harmony"
THINKING_FORMATS = (TAGS, HARMONY)


class CatalogError(ValueError):
    """One malformed catalog entry, in one line."""


@dataclass(frozen=True)
class Drafter:
    """The drafter a catalog model carries: its own MTP head(s), or it is an EAGLE-3 or a DFlash draft."""
    kind: str  # MTP, EAGLE3 or DFLASH
    heads: int = 0  # MTP layers in the file (mtp only)


@dataclass(frozen=True)
class Thinking:
    """How a catalog model thinks: between its two tags (TAGS), or in harmony's analysis channel (HARMONY), whose
    template takes a reasoning effort and never turns the thinking off. Refuses an inconsistent one (CatalogError,
    without the model's alias)."""
    format: str  # TAGS or HARMONY
    tags: tuple[str, ...] = ()  # (start, end) for TAGS; () for HARMONY
    can_disable: bool = False  # the template turns thinking off (enable_thinking: false)

    def __post_init__(self) -> None:
        if self.format not in THINKING_FORMATS:
            raise CatalogError(f"thinking format is \"{TAGS}\" or \"{HARMONY}\", not {json.dumps(self.format)}")
        if self.format == HARMONY and self.tags:
            raise CatalogError("harmony thinking has no tags (its analysis channel is the reasoning)")
        if self.format == HARMONY and self.can_disable:
            raise CatalogError("harmony thinking cannot be turned off (gpt-oss's template takes a reasoning "
                               "effort, never enable_thinking)")
        if self.format == TAGS and (len(self.tags) != 2 or not all(isinstance(t, str) and t for t in self.tags)
                                    or self.tags[0] == self.tags[1]):
            raise CatalogError("thinking tags are a start and an end tag, two different non-empty strings")

    @property
    def note(self) -> str:
        """In words, for listings: where the model thinks, and how to turn it off or bound it."""
        if self.format == HARMONY:
            return ("thinks before answering (in harmony's analysis channel; it cannot be turned off; bound it with "
                    "--reasoning-effort low|medium|high or --reasoning-budget N)")
        off = "--no-think / F4 turn it off" if self.can_disable else "it cannot be turned off; bound it " \
            "with --reasoning-budget N"
        return f"thinks before answering ({self.tags[0]}…{self.tags[1]}; {off})"

    @property
    def label(self) -> str:
        """In a few words, for the chat app's catalog (its keys, not the CLI's flags)."""
        if self.format == HARMONY:
            return "thinks (harmony), always: F4's Thinking budget bounds it"
        return "thinks: F7 turns it off" if self.can_disable else "thinks, always: F4's Thinking budget bounds it"


@dataclass(frozen=True)
class CatalogModel:
    alias: str
    repo: str
    file: str  # glob with {quant}
    default_quant: str
    sizes_gb: tuple[tuple[str, float], ...]  # (quant, GB), largest first
    kv_gb: float
    notes: str
    # How the model thinks; None for one that does not (backends.reasoning finds the same from the file's template).
    thinking: Thinking | None = None
    drafter: Drafter | None = None

    @property
    def mtp_heads(self) -> int:
        return self.drafter.heads if self.drafter is not None and self.drafter.kind == MTP else 0

    @property
    def is_eagle3(self) -> bool:
        return self.drafter is not None and self.drafter.kind == EAGLE3

    @property
    def is_draft_file(self) -> bool:
        """An EAGLE-3 or DFlash draft: it runs only beside the target it was made for."""
        return self.drafter is not None and self.drafter.kind in DRAFT_FILES

    @property
    def thinking_note(self) -> str:
        """In words, for listings: '' for a model that does not think."""
        return "" if self.thinking is None else self.thinking.note

    @property
    def quants(self) -> tuple[str, ...]:
        return tuple(q for q, _ in self.sizes_gb)

    def quant(self, wanted: str | None) -> str:
        """The catalog's spelling of `wanted` (case-insensitive), or the default quantization."""
        if wanted is None:
            return self.default_quant
        for q in self.quants:
            if q.upper() == wanted.upper():
                return q
        # Not listed here, but the repo may still have it: the file glob decides at pull time.
        return wanted

    def pattern(self, quant: str | None = None) -> str:
        return self.file.format(quant=self.quant(quant))

    def size_gb(self, quant: str | None = None) -> float | None:
        return dict(self.sizes_gb).get(self.quant(quant))

    def ram_gb(self, quant: str | None = None) -> float | None:
        size = self.size_gb(quant)
        return None if size is None else size + self.kv_gb


@dataclass(frozen=True)
class CatalogPair:
    name: str
    target: CatalogModel
    draft: CatalogModel | None  # None: the target's own MTP head drafts
    notes: str
    drafter: str = DRAFT  # MTP, EAGLE3, DFLASH or DRAFT (a plain draft model)

    @property
    def models(self) -> tuple[CatalogModel, ...]:
        """What `models pull` fetches: the target, then the draft where there is one."""
        return (self.target,) if self.draft is None else (self.target, self.draft)

    @property
    def drafter_label(self) -> str:
        """How the pair drafts, in a few words ('' for a plain draft model)."""
        return {MTP: "MTP head inside the target", EAGLE3: "EAGLE-3 draft", DFLASH: "DFlash draft"}.get(
            self.drafter, "")

    @property
    def drafter_note(self) -> str:
        """How the pair drafts, in words, for listings."""
        if self.drafter == MTP:
            heads = self.target.mtp_heads
            return f"MTP head inside the target ({heads} layer{'s' if heads > 1 else ''}; no draft file)"
        if self.drafter == EAGLE3:
            return "EAGLE-3 draft (a -md file that reads the target's hidden states)"
        if self.drafter == DFLASH:
            return "DFlash draft (a -md file that reads the target's hidden states and drafts a block per decode)"
        return "draft model"

    def ram_gb(self, target_quant: str | None = None, draft_quant: str | None = None) -> float | None:
        """Approximate memory for running the pair (both models, or the target and its head), 4096-token context."""
        t = self.target.ram_gb(target_quant)
        d = 0.0 if self.draft is None else self.draft.ram_gb(draft_quant)
        return None if t is None or d is None else t + d + RUNTIME_OVERHEAD_GB


@dataclass(frozen=True)
class Catalog:
    models: tuple[CatalogModel, ...]
    pairs: tuple[CatalogPair, ...]

    def model(self, alias: str) -> CatalogModel | None:
        return next((m for m in self.models if m.alias == alias.lower()), None)

    def pair(self, name: str) -> CatalogPair | None:
        return next((p for p in self.pairs if p.name == name.lower()), None)

    def by_repo(self, repo: str) -> CatalogModel | None:
        """The catalog model of a repo; where a repo holds a model and its EAGLE-3 or DFlash draft, the model."""
        same = [m for m in self.models if m.repo.lower() == repo.lower()]
        return next((m for m in same if not m.is_draft_file), same[0] if same else None)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pairs) + tuple(m.alias for m in self.models)


def _drafter(alias: str, raw: Any) -> Drafter | None:
    """`"eagle3"`, `"dflash"`, `"mtp"` (one head), `{"kind": "mtp", "heads": N}`, `{"kind": "eagle3"}` or
    `{"kind": "dflash"}`."""
    if raw is None:
        return None
    spec = {"kind": raw} if isinstance(raw, str) else raw
    if not isinstance(spec, dict) or spec.get("kind") not in DRAFTER_KINDS:
        raise CatalogError(f"catalog model {alias}: drafter is \"eagle3\", \"dflash\" or "
                           f"{{\"kind\": \"mtp\", \"heads\": N}}, not {json.dumps(raw)}")
    extra = set(spec) - {"kind", "heads"}
    if extra:
        raise CatalogError(f"catalog model {alias}: unknown drafter field(s) {', '.join(sorted(extra))}")
    if spec["kind"] in DRAFT_FILES:
        if "heads" in spec:
            raise CatalogError(f"catalog model {alias}: {KIND_NAMES[spec['kind']]} has no heads (only an MTP "
                               "drafter does)")
        return Drafter(spec["kind"])
    heads = spec.get("heads", 1)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise CatalogError(f"catalog model {alias}: an MTP drafter's heads is a whole number from 1, "
                           f"not {json.dumps(heads)}")
    return Drafter(MTP, heads)


def _thinking(alias: str, raw: Any) -> Thinking | None:
    """`{"tags": [start, end], "can_disable": bool}` (`"format": "tags"` optional) or `{"format": "harmony"}`."""
    if raw is None:
        return None
    shape = "{\"tags\": [start, end], \"can_disable\": true|false} or {\"format\": \"harmony\"}"
    if not isinstance(raw, dict):
        raise CatalogError(f"catalog model {alias}: thinking is {shape}, not {json.dumps(raw)}")
    extra = set(raw) - {"format", "tags", "can_disable"}
    if extra:
        raise CatalogError(f"catalog model {alias}: unknown thinking field(s) {', '.join(sorted(extra))}")
    tags, can_disable = raw.get("tags", []), raw.get("can_disable", False)
    if not isinstance(tags, list) or not isinstance(can_disable, bool):
        raise CatalogError(f"catalog model {alias}: thinking is {shape}, not {json.dumps(raw)}")
    try:
        return Thinking(raw.get("format", TAGS), tuple(tags), can_disable)
    except CatalogError as e:
        raise CatalogError(f"catalog model {alias}: {e}") from None


def _model(alias: str, raw: Any) -> CatalogModel:
    if not isinstance(raw, dict):
        raise CatalogError(f"catalog model {alias}: an object with repo, file, default_quant, sizes_gb and kv_gb")
    missing = [k for k in ("repo", "file", "default_quant", "sizes_gb", "kv_gb") if k not in raw]
    if missing:
        raise CatalogError(f"catalog model {alias}: missing {', '.join(missing)}")
    if not isinstance(raw["sizes_gb"], dict) or not raw["sizes_gb"] or not all(
            isinstance(gb, (int, float)) and not isinstance(gb, bool) for gb in raw["sizes_gb"].values()):
        raise CatalogError(f"catalog model {alias}: sizes_gb maps each quantization to its file size in GB")
    sizes = sorted(raw["sizes_gb"].items(), key=lambda kv: -kv[1])
    model = CatalogModel(
        alias=alias, repo=raw["repo"], file=raw["file"], default_quant=raw["default_quant"],
        sizes_gb=tuple((q, float(gb)) for q, gb in sizes), kv_gb=float(raw["kv_gb"]), notes=raw.get("notes", ""),
        thinking=_thinking(alias, raw.get("thinking")),
        drafter=_drafter(alias, raw.get("drafter")),
    )
    if "{quant}" not in model.file or model.default_quant not in model.quants:
        raise CatalogError(f"catalog model {alias}: file needs {{quant}} and default_quant must be listed in "
                           "sizes_gb")
    return model


def _pair(raw: Any, models: dict[str, CatalogModel]) -> CatalogPair:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise CatalogError(f"catalog pair {json.dumps(raw)}: needs a name")
    name = raw["name"]
    if "target" not in raw:
        raise CatalogError(f"catalog pair {name}: needs a target")
    picked = {}
    for role in ("target", "draft"):
        if raw.get(role) is not None:
            if raw[role] not in models:
                raise CatalogError(f"catalog pair {name}: its {role} {raw[role]!r} is not a catalog model")
            picked[role] = models[raw[role]]
    target, draft = picked["target"], picked.get("draft")
    said = raw.get("drafter")
    if said is not None and said not in DRAFTER_KINDS:
        raise CatalogError(f"catalog pair {name}: drafter is \"mtp\", \"eagle3\" or \"dflash\", not {json.dumps(said)}")
    if target.is_draft_file:
        raise CatalogError(f"catalog pair {name}: its target {target.alias} is {KIND_NAMES[target.drafter.kind]}, "
                           "which runs only beside a target")
    if draft is None:
        if said in DRAFT_FILES:
            raise CatalogError(f"catalog pair {name}: {KIND_NAMES[said].removesuffix(' draft')} pair names its draft")
        if not target.mtp_heads:
            raise CatalogError(f"catalog pair {name}: no draft, and its target {target.alias} carries no MTP head "
                               "(name a draft, or give the target a drafter {\"kind\": \"mtp\"})")
        return CatalogPair(name, target, None, raw.get("notes", ""), MTP)
    if said == MTP:
        raise CatalogError(f"catalog pair {name}: it drafts with the target's MTP head, so it names no draft")
    if said in DRAFT_FILES and draft.drafter is not None and draft.drafter.kind != said:
        what = "carries an MTP head" if draft.drafter.kind == MTP else f"is {KIND_NAMES[draft.drafter.kind]}"
        raise CatalogError(f"catalog pair {name}: its draft {draft.alias} {what}, not {KIND_NAMES[said]}")
    kind = draft.drafter.kind if draft.is_draft_file else said or DRAFT
    return CatalogPair(name, target, draft, raw.get("notes", ""), kind)


def parse_catalog(data: Any) -> Catalog:
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict) \
            or not isinstance(data.get("pairs"), list):
        raise CatalogError("the catalog is an object with \"models\" (alias -> model) and \"pairs\" (a list)")
    models = {alias: _model(alias, raw) for alias, raw in data["models"].items()}
    pairs = tuple(_pair(p, models) for p in data["pairs"])
    names = [p.name for p in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CatalogError(f"catalog pair names used twice: {twice}")
    clash = set(models) & set(names)
    if clash:
        raise CatalogError(f"catalog names used for both a model and a pair: {sorted(clash)}")
    return Catalog(tuple(models.values()), pairs)


@lru_cache(maxsize=1)
def load_catalog() -> Catalog:
    """The packaged catalog (read once)."""
    try:
        text = resources.files("models").joinpath("catalog.json").read_text(encoding="utf-8")
        return parse_catalog(json.loads(text))
    except (OSError, ValueError, KeyError, TypeError) as e:  # a broken install, not a user mistake we can fix
        raise ModelError(f"the packaged model catalog is unreadable: {e}") from None
