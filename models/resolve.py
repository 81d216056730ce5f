"""Model references -> local GGUF paths.

A reference is a path to a .gguf file, or `demo` / `demo-draft` for the
bundled pair (built on first use).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from models.demo import DEMO_DRAFT, DEMO_TARGET, ensure_demo_pair
from models.errors import ModelError


def resolve_model(ref: str, progress: Callable[[str], None] = lambda _msg: None) -> Path:
    if ref in (DEMO_TARGET, DEMO_DRAFT):
        pair = ensure_demo_pair(progress)
        return pair.target if ref == DEMO_TARGET else pair.draft
    path = Path(ref).expanduser()
    if path.exists():
        return path
    raise ModelError(f"{ref}: no such file (a model is a .gguf path, '{DEMO_TARGET}' or '{DEMO_DRAFT}')")
