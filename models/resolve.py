"""Model references -> local GGUF paths (and, for models not downloaded yet, what to pull).

A reference is one of:
  - `demo` / `demo-draft`: the bundled pair (built on first use);
  - an alias in the local store (models.store): pulled or derived models;
  - a catalog alias (models/catalog.json), optionally with a quantization:
    `qwen2.5-7b-instruct`, `qwen2.5-7b-instruct:Q8_0`; a catalog pair name
    (`qwen2.5`) names both models for `models pull`, and a pair that drafts
    with its target's own MTP head (`qwen3.5-mtp`) names the target alone, so
    it also resolves to that file;
  - `hf:OWNER/REPO[:QUANT]` or `hf:OWNER/REPO:FILE.gguf`;
  - a path to a .gguf file.
Catalog and hf: references resolve from the local Hugging Face cache only (no
network, so they work offline); when absent the error says how to pull them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from models.catalog import CatalogModel, load_catalog
from models.demo import CHAT_DRAFT, CHAT_TARGET, DEMO_DRAFT, DEMO_TARGET, Quantize, ensure_demo_pair, recipe_for
from models.errors import ModelError
from models.gguf_info import GGUFInfo, validate_gguf
from models.hub import HubModel, cached_ggufs, match_files, pick_file
from models.remote_header import remote_model_header
from models.store import ModelStore

HF_PREFIX = "hf:"
REF_HELP = (f"a model is a .gguf path, a bundled demo model ('{CHAT_TARGET}', '{CHAT_DRAFT}', '{DEMO_TARGET}', "
            f"'{DEMO_DRAFT}'), an alias from `specchat models list`, "
            "a catalog alias from `specchat models pairs`, or hf:OWNER/REPO[:QUANT]")


def _quant_pattern(quant: str | None) -> str | None:
    if quant is None:
        return None
    return quant if quant.lower().endswith(".gguf") else f"*{quant}*.gguf"


def _catalog_model(model: CatalogModel, quant: str | None) -> HubModel:
    q = model.quant(quant)
    alias = model.alias if q == model.default_quant else f"{model.alias}:{q}"
    return HubModel(alias, model.repo, model.pattern(q), q)


def hub_models(ref: str, quant: str | None = None) -> tuple[HubModel, ...] | None:
    """What a catalog or hf: reference names on the Hub (a pair: target then draft, or the target alone where its
    MTP head drafts); None for other references.

    `quant` overrides the reference's own; for a pair it applies to the target.
    """
    catalog = load_catalog()
    if ref.startswith(HF_PREFIX):
        repo, _, ref_quant = ref[len(HF_PREFIX):].partition(":")
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise ModelError(f"{ref}: expected hf:OWNER/REPO[:QUANT]")
        q = quant or ref_quant or None
        known = catalog.by_repo(repo)
        if q is None and known is not None:  # a catalog repo: its default quantization
            return (HubModel(f"{HF_PREFIX}{repo}", repo, known.pattern(), known.default_quant),)
        alias = f"{HF_PREFIX}{repo}" + (f":{q}" if q else "")
        return (HubModel(alias, repo, _quant_pattern(q), None if q and q.lower().endswith(".gguf") else q),)
    name, _, ref_quant = ref.partition(":")
    q = quant or ref_quant or None
    pair = catalog.pair(name)
    if pair is not None:
        return tuple(_catalog_model(m, q if m is pair.target else None) for m in pair.models)
    model = catalog.model(name)
    return None if model is None else (_catalog_model(model, q),)


def single_hub_model(ref: str) -> HubModel | None:
    models = hub_models(ref)
    if models is not None and len(models) > 1:
        raise ModelError(f"{ref} is a pair: name its target ({models[0].alias}) or its draft ({models[1].alias})")
    return None if models is None else models[0]


def cached_model(model: HubModel) -> Path | None:
    """The model's file in the local HF cache, or None when it is not there."""
    files = cached_ggufs(model.repo)
    names = [f.filename for f in files]
    if not match_files(names, model.pattern):
        return None
    name = pick_file(model.repo, names, model.pattern)
    return next(f.path for f in files if f.filename == name)


def resolve_local(ref: str, progress: Callable[[str], None] = lambda _msg: None,
                  quantize: Quantize | None = None) -> Path | None:
    """The local file `ref` names; None for a catalog or hf: model that is not downloaded yet.

    A demo pair not built yet is built with `quantize` (llama.cpp's quantizer, passed in by the app).
    """
    recipe = recipe_for(ref)
    if recipe is not None:
        pair = recipe.paths()
        if not (pair.target.exists() and pair.draft.exists()):
            if quantize is None:
                raise ModelError(f"{ref} is not built yet: `specchat chat -m {recipe.target_alias}` builds it")
            pair = ensure_demo_pair(progress, quantize, recipe)
        return pair.target if ref == recipe.target_alias else pair.draft
    stored = ModelStore().get(ref)
    if stored is not None and stored.path.exists():
        return stored.path
    model = single_hub_model(ref)
    if model is not None:
        return cached_model(model)
    path = Path(ref).expanduser()
    if path.exists():
        return path
    raise ModelError(f"{ref}: no such file ({REF_HELP})")


def resolve_model(ref: str, progress: Callable[[str], None] = lambda _msg: None,
                  quantize: Quantize | None = None) -> Path:
    path = resolve_local(ref, progress, quantize)
    if path is None:
        raise ModelError(f"{ref} is not downloaded yet: run `specchat models pull {ref}`")
    return path


@dataclass(frozen=True)
class ModelHeader:
    info: GGUFInfo
    source: str  # "local" or how much of the remote file was read


def model_header(ref: str, progress: Callable[[str], None] = lambda _msg: None,
                 offline: bool | None = None, quantize: Quantize | None = None) -> ModelHeader:
    """The GGUF header of a reference: from the local file, or read remotely before anything is downloaded."""
    path = resolve_local(ref, progress, quantize)
    if path is not None:
        return ModelHeader(validate_gguf(path), "local")
    model = single_hub_model(ref)
    assert model is not None  # resolve_local returns None only for hub models
    remote = remote_model_header(model, offline)
    return ModelHeader(remote.info, f"remote header: read {remote.bytes_read} of {remote.size} bytes")
