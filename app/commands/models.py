"""`specchat models ...`: list, pull, pairs, info, check, derive.

Results go to stdout, download progress to stderr. User errors raise
ModelError (one line, exit 1 in app.cli); `check` and `derive` print their
verdict and exit 1 when the pair cannot speculate. `derive` re-quantizes with
llama.cpp's llama_model_quantize (backends.llama.quantize), imported here so
that models/ stays free of llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.errors import print_progress
from app.loading import quantize
from app.units import format_size
from models.catalog import MTP, CatalogModel, CatalogPair, load_catalog
from models.compat import PairCheck, check_pair
from models.drafters import describe_drafters, mtp_heads
from models.errors import ModelError
from models.gguf_info import GGUFInfo, validate_gguf
from models.hub import Progress, pull
from models.local import drafts_for, local_models
from models.paths import data_dir
from models.resolve import hub_models, model_header, resolve_model
from models.store import ModelStore, StoredModel

EXIT_INCOMPATIBLE = 1


def add_models_parser(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser]) -> None:
    models = sub.add_parser("models", help="list, download, check and derive models")
    cmd = models.add_subparsers(dest="models_command", parser_class=parser_class, required=True,
                                metavar="{list,pull,pairs,info,check,derive}")
    cmd.add_parser("list", help="local models: size, architecture, quantization, which pair with which")
    p = cmd.add_parser("pull", help="download a catalog model or pair (for a pair whose target drafts with its own MTP "
                       "head, the target alone), or hf:OWNER/REPO[:QUANT], into the HF cache")
    p.add_argument("ref", help="catalog pair (e.g. qwen2.5), catalog model (e.g. qwen2.5-7b-instruct) or hf:OWNER/REPO[:QUANT]")
    p.add_argument("--quant", default=None, help="quantization, e.g. Q8_0 (for a pair: the target's)")
    p.add_argument("--offline", action="store_true", help="use the local HF cache only (as HF_HUB_OFFLINE=1)")
    cmd.add_parser("pairs", help="the catalog of known-good pairs: how each drafts (a draft model, an EAGLE-3 draft, "
                   "the target's MTP head), sizes, quantizations, RAM")
    i = cmd.add_parser("info", help="GGUF metadata of a local model, or of a remote one from its header alone (a "
                       "catalog model: how it thinks, too)")
    i.add_argument("ref")
    i.add_argument("--json", action="store_true", help="one JSON object")
    i.add_argument("--offline", action="store_true", help="local models only")
    c = cmd.add_parser("check", help="can DRAFT speculate for TARGET? (remote models: header only, nothing downloaded)")
    c.add_argument("target")
    c.add_argument("draft")
    c.add_argument("--offline", action="store_true", help="local models only")
    d = cmd.add_parser("derive", help="make a self-draft: re-quantize a model (e.g. an F16 or Q8_0 target to Q3_K_M)")
    d.add_argument("ref", help="the source model")
    d.add_argument("quant", help="target quantization: Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0, Q3_K_M, Q2_K, F16, F32")
    d.add_argument("--alias", default=None, help="store alias (default: <source>-<quant>)")
    d.add_argument("-o", "--output", default=None, help="output .gguf (default: <data dir>/derived/)")


def _offline(args: argparse.Namespace) -> bool | None:
    return True if getattr(args, "offline", False) else None  # None: huggingface_hub's HF_HUB_OFFLINE decides


class StderrBar:
    """Download progress on stderr: one line redrawn in place on a terminal, 10% steps otherwise (logs, pipes)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.shown: dict[str, int] = {}

    def __call__(self, p: Progress) -> None:
        frac = p.fraction
        step = -1 if frac is None else int(frac * 10)
        if not self.tty and self.shown.get(p.filename) == step:
            return
        self.shown[p.filename] = step
        line = f"{p.filename}: {format_size(p.done)}"
        if frac is not None:
            line += f" of {format_size(p.total)} {frac * 100:5.1f}%"
        if self.tty:
            width = 30
            bar = "#" * int((frac or 0) * width)
            end = "\n" if frac == 1.0 else ""
            print(f"\r[{bar:<{width}}] {line}\x1b[K", end=end, file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def _verdict(target: str, draft: str, result: PairCheck) -> str:
    if result.ok:
        return f"compatible: {draft} can speculate for {target}"
    return f"incompatible: {draft} cannot speculate for {target}:\n" + "\n".join(f"  - {p}" for p in result.problems)


# --- pull -----------------------------------------------------------------------------------------------------------

def _pull(args: argparse.Namespace) -> int:
    models = hub_models(args.ref, args.quant)
    if models is None:
        raise ModelError(f"{args.ref}: not a catalog pair or model, nor hf:OWNER/REPO[:QUANT] (see `specchat models pairs`)")
    bar = StderrBar()
    pulled: list[StoredModel] = []
    for model in models:
        print_progress(f"pulling {model.alias} from {model.repo}")
        stored = pull(model, progress=bar, offline=_offline(args))
        pulled.append(stored)
        print(f"{stored.alias}: {stored.path}")
    if len(pulled) == 2:
        target, draft = pulled
        result = check_pair(validate_gguf(target.path), validate_gguf(draft.path))
        print(_verdict(target.alias, draft.alias, result))
        return 0 if result.ok else EXIT_INCOMPATIBLE
    pair = None if args.ref.startswith("hf:") else load_catalog().pair(args.ref.partition(":")[0])
    if pair is not None and pair.drafter == MTP:
        return _check_head(pair, pulled[0])
    return 0


def _check_head(pair: CatalogPair, target: StoredModel) -> int:
    """A pair that drafts with its target's MTP head: does the file pulled carry one that llama.cpp runs?"""
    info = validate_gguf(target.path)
    heads = mtp_heads(info)
    if not heads:
        print(f"incompatible: {target.alias} carries no MTP head to draft with ({describe_drafters(info)})")
        return EXIT_INCOMPATIBLE
    print(f"compatible: {target.alias} drafts with its own MTP head ({heads} layer{'s' if heads > 1 else ''}); "
          f"no draft file: `specchat chat -m {pair.name}`")
    return 0


# --- list -----------------------------------------------------------------------------------------------------------

def _list(args: argparse.Namespace) -> int:
    models, warning = local_models()
    if warning:
        print_progress(f"specchat: warning: {warning}")
    if not models:
        print("no local models yet: `specchat models pairs` lists what `specchat models pull` can fetch")
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'NAME':<{width}}  {'SIZE':>9}  {'ARCH':<10} {'QUANT':<8} PATH")
    for m in models:
        if m.info is None:
            print(f"{m.name:<{width}}  {format_size(m.path.stat().st_size):>9}  unusable: {m.problem}")
            continue
        print(f"{m.name:<{width}}  {format_size(m.info.size_bytes):>9}  {m.info.architecture:<10} "
              f"{m.info.quantization or '?':<8} {m.path}")
    pairs = [(m.name, drafts_for(m, models)) for m in models if m.info is not None]
    pairs = [(t, ds) for t, ds in pairs if ds]
    print("\npairs (target <- drafts that can speculate for it):")
    for target, drafts in pairs:
        print(f"  {target} <- {', '.join(drafts)}")
    if not pairs:
        print("  none")
    return 0


# --- pairs ----------------------------------------------------------------------------------------------------------

def _model_line(role: str, m: CatalogModel, width: int) -> str:
    others = ", ".join(f"{q} {gb:.2f}" for q, gb in m.sizes_gb)
    return (f"  {role:<6} {m.alias:<{width}} {m.default_quant:<7} {m.size_gb() or 0:5.2f} GB  "
            f"{m.repo}  (GB per quant: {others})")


def _pairs(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    width = max(len(m.alias) for m in catalog.models)
    for pair in catalog.pairs:
        print(f"{pair.name}: ~{pair.ram_gb():.1f} GB RAM at the default quants, 4k context. {pair.notes}")
        print(_model_line("target", pair.target, width))
        if pair.draft is not None:
            print(_model_line("draft", pair.draft, width))
        print(f"  drafts with: {pair.drafter_note}")
        if pair.target.thinking_note:
            print(f"  the target {pair.target.thinking_note}")
        print()
    print("pull a pair with `specchat models pull NAME` (a pair with an MTP head: its target alone), one model with "
          "`specchat models pull ALIAS [--quant Q]`")
    return 0


# --- info / check ---------------------------------------------------------------------------------------------------

def _catalog_thinking(ref: str) -> dict[str, str]:
    """`{"thinking": note}` where `ref` is a catalog model that thinks (models.catalog.Thinking.note), else {}."""
    model = load_catalog().model(ref.partition(":")[0])
    return {"thinking": model.thinking_note} if model is not None and model.thinking_note else {}


def _info(args: argparse.Namespace) -> int:
    header = model_header(args.ref, print_progress, _offline(args), quantize)
    data = {**header.info.summary(), "drafters": describe_drafters(header.info), **_catalog_thinking(args.ref),
            "source": header.source}
    if args.json:
        print(json.dumps(data))
    else:
        for key, value in data.items():
            print(f"{key}: {value}")
    return 0


def _check(args: argparse.Namespace) -> int:
    target = model_header(args.target, print_progress, _offline(args), quantize)
    draft = model_header(args.draft, print_progress, _offline(args), quantize)
    for role, ref, h in (("target", args.target, target), ("draft", args.draft, draft)):
        print(f"{role}: {ref} = {h.info.path.name} ({h.info.architecture}, {h.info.vocab_size} tokens; {h.source})")
    result = check_pair(target.info, draft.info)
    print(_verdict(args.target, args.draft, result))
    return 0 if result.ok else EXIT_INCOMPATIBLE


# --- derive ---------------------------------------------------------------------------------------------------------

def _base_name(ref: str, path: Path, info: GGUFInfo) -> str:
    """`demo`, `qwen2.5-7b-instruct`: the alias itself; a path or hf: ref: the file stem without its quant suffix."""
    if "/" not in ref and ":" not in ref and not ref.lower().endswith(".gguf"):
        return ref
    stem = path.stem
    suffix = f"-{info.quantization}".lower()
    return stem[: -len(suffix)] if info.quantization and stem.lower().endswith(suffix) else stem


def _derive(args: argparse.Namespace) -> int:
    from backends.llama import QUANT_TYPES, quantize  # llama.cpp only for this command

    quant = args.quant.upper()
    if quant not in QUANT_TYPES:
        raise ModelError(f"unknown quantization {args.quant!r}; choose one of {', '.join(QUANT_TYPES)}")
    src = resolve_model(args.ref, print_progress, quantize)
    source = validate_gguf(src)
    name = _base_name(args.ref, src, source)
    out = Path(args.output).expanduser() if args.output else data_dir() / "derived" / f"{name}-{quant}.gguf"
    if out.exists() and out.resolve() == src.resolve():
        raise ModelError(f"{out}: the output would overwrite the source model")
    out.parent.mkdir(parents=True, exist_ok=True)
    print_progress(f"deriving {out.name} from {src.name} ({source.quantization} -> {quant}) with llama_model_quantize")
    quantize(src, out, quant)
    derived = validate_gguf(out)
    alias = args.alias or f"{name}-{quant.lower()}"
    ModelStore().add(StoredModel(alias, out.resolve(), quant=derived.quantization, derived_from=str(src)))
    print(f"{alias}: {out} ({format_size(derived.size_bytes)}, {derived.quantization}; "
          f"source {format_size(source.size_bytes)}, {source.quantization})")
    result = check_pair(source, derived)
    print(_verdict(args.ref, alias, result))
    return 0 if result.ok else EXIT_INCOMPATIBLE


COMMANDS = {"list": _list, "pull": _pull, "pairs": _pairs, "info": _info, "check": _check, "derive": _derive}


def run_models(args: argparse.Namespace) -> int:
    return COMMANDS[args.models_command](args)
