"""The catalog of known-good draft/target pairs (packaged data: models/catalog.json).

Each model names a GGUF repo on the Hugging Face Hub and a file glob with a
`{quant}` placeholder (bartowski, unsloth and Qwen name their files
`<Model>-<QUANT>.gguf`); sizes are the approximate file sizes per quantization
as the repos list them. The RAM a pair needs is estimated as both files
(llama.cpp maps the weights) plus both KV caches at a 4096-token context plus
a fixed allowance for compute buffers and the process itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from models.errors import ModelError

RUNTIME_OVERHEAD_GB = 0.5  # llama.cpp compute buffers + Python + the UI, measured order of magnitude


@dataclass(frozen=True)
class CatalogModel:
    alias: str
    repo: str
    file: str  # glob with {quant}
    default_quant: str
    sizes_gb: tuple[tuple[str, float], ...]  # (quant, GB), largest first
    kv_gb: float
    notes: str
    # A thinking model's tags (start, end) and whether its template turns thinking off; () for one that does not
    # think (backends.reasoning finds the same from the file's template at load).
    thinking: tuple[str, ...] = ()
    thinking_can_disable: bool = False

    @property
    def thinking_note(self) -> str:
        """In words, for listings: '' for a model that does not think."""
        if not self.thinking:
            return ""
        off = "--no-think / F4 turn it off" if self.thinking_can_disable else "it cannot be turned off; bound it " \
            "with --reasoning-budget"
        return f"thinks before answering ({self.thinking[0]}…{self.thinking[1]}; {off})"

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
    draft: CatalogModel
    notes: str

    def ram_gb(self, target_quant: str | None = None, draft_quant: str | None = None) -> float | None:
        """Approximate memory for running both models together, at a 4096-token context."""
        t, d = self.target.ram_gb(target_quant), self.draft.ram_gb(draft_quant)
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
        return next((m for m in self.models if m.repo.lower() == repo.lower()), None)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pairs) + tuple(m.alias for m in self.models)


def _model(alias: str, raw: dict[str, Any]) -> CatalogModel:
    sizes = sorted(raw["sizes_gb"].items(), key=lambda kv: -kv[1])
    model = CatalogModel(
        alias=alias, repo=raw["repo"], file=raw["file"], default_quant=raw["default_quant"],
        sizes_gb=tuple((q, float(gb)) for q, gb in sizes), kv_gb=float(raw["kv_gb"]), notes=raw.get("notes", ""),
        thinking=tuple(raw.get("thinking", {}).get("tags", ())),
        thinking_can_disable=bool(raw.get("thinking", {}).get("can_disable", False)),
    )
    if model.thinking and len(model.thinking) != 2:
        raise ValueError(f"catalog model {alias}: thinking tags are a start and an end tag")
    if "{quant}" not in model.file or model.default_quant not in model.quants:
        raise ValueError(f"catalog model {alias}: file needs {{quant}} and default_quant must be listed in sizes_gb")
    return model


def parse_catalog(data: dict[str, Any]) -> Catalog:
    models = {alias: _model(alias, raw) for alias, raw in data["models"].items()}
    pairs = tuple(
        CatalogPair(p["name"], models[p["target"]], models[p["draft"]], p.get("notes", "")) for p in data["pairs"]
    )
    clash = set(models) & {p.name for p in pairs}
    if clash:
        raise ValueError(f"catalog names used for both a model and a pair: {sorted(clash)}")
    return Catalog(tuple(models.values()), pairs)


@lru_cache(maxsize=1)
def load_catalog() -> Catalog:
    """The packaged catalog (read once)."""
    try:
        text = resources.files("models").joinpath("catalog.json").read_text(encoding="utf-8")
        return parse_catalog(json.loads(text))
    except (OSError, ValueError, KeyError, TypeError) as e:  # a broken install, not a user mistake we can fix
        raise ModelError(f"the packaged model catalog is unreadable: {e}") from None
