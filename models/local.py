"""The GGUF files on this machine: the alias store, the demo pair, and the Hugging Face cache.

Each is listed once (by resolved path) under the name `resolve_model` accepts,
with its header (or why it is unusable), and `drafts_for` applies llama.cpp's
compatibility rules (models.compat) to say which can speculate for which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from models.compat import check_pair
from models.demo import RECIPES
from models.errors import ModelError
from models.gguf_info import GGUFInfo, validate_gguf
from models.hub import cached_ggufs
from models.resolve import HF_PREFIX
from models.store import ModelStore


@dataclass(frozen=True)
class LocalModel:
    """A GGUF on this machine under the name that resolves to it; `problem` when it is unusable."""

    name: str
    path: Path
    info: GGUFInfo | None
    problem: str | None


def local_models() -> tuple[list[LocalModel], str | None]:
    """Store entries, the demo pair (if built) and GGUF files in the HF cache, each once; plus a store warning."""
    store = ModelStore()
    named: list[tuple[str, Path]] = [(m.alias, m.path) for m in store.all().values()]
    for recipe in RECIPES:
        try:
            pair = recipe.paths()
        except ModelError:  # its package is not installed
            continue
        named += [(recipe.target_alias, pair.target), (recipe.draft_alias, pair.draft)]
    named += [(f"{HF_PREFIX}{f.repo}:{f.filename}", f.path) for f in cached_ggufs() if f.path is not None]
    seen: set[Path] = set()
    out: list[LocalModel] = []
    for name, path in named:
        if not path.exists() or path.resolve() in seen:
            continue
        seen.add(path.resolve())
        try:
            out.append(LocalModel(name, path, validate_gguf(path), None))
        except ModelError as e:
            out.append(LocalModel(name, path, None, str(e)))
    return out, store.warning


def drafts_for(target: LocalModel, models: list[LocalModel]) -> list[str]:
    """Smaller models that can speculate for `target` (llama.cpp's compatibility rules)."""
    t = target.info
    assert t is not None
    return [d.name for d in models
            if d is not target and d.info is not None and d.info.size_bytes < t.size_bytes and check_pair(t, d.info).ok]
