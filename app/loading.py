"""Opening an engine: the one way `run`, `demo`, `bench`, the chat app and the server load models.

Model references (paths, `demo`, aliases, `hf:`) resolve to files, the draft
is checked against the target and both are loaded with the settings' context,
batch, thread and offload choices.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from app.settings import Settings
from models.resolve import resolve_model

if TYPE_CHECKING:
    from backends.engine import Engine


def quantize(src: Path, dst: Path, quant: str) -> None:
    """llama.cpp's quantizer, loaded only when a demo pair or a derived draft is built."""
    from backends.llama import quantize as llama_quantize

    llama_quantize(src, dst, quant)


def open_engine(settings: Settings, n_seq_max: int, progress: Callable[[str], None] = lambda _msg: None,
                with_draft: bool = True, announce: bool = False, n_parallel: int = 1) -> Engine:
    """Load `settings.target` (and `settings.draft` unless with_draft is False) with room for n_seq_max sequences
    in each of `n_parallel` slots (sequences decoded together: `specchat serve --parallel`).

    `progress` hears about builds and resolution (the demo pair's first build);
    with `announce` also which files are being loaded (the chat app's status line).
    """
    from backends.engine import Engine, EngineConfig  # llama.cpp loads here, not at import

    if settings.target is None:
        raise ValueError("no target model is set (-m MODEL)")
    target = resolve_model(settings.target, progress, quantize)
    draft = resolve_model(settings.draft, progress, quantize) if settings.draft and with_draft else None
    if announce:
        progress(f"loading {target.name}" + (f" + {draft.name}" if draft else ""))
    return Engine(EngineConfig(
        target=target, draft=draft, n_ctx=settings.n_ctx, n_batch=settings.n_batch, threads=settings.threads,
        n_gpu_layers=settings.n_gpu_layers, n_gpu_layers_draft=settings.n_gpu_layers_draft, rpc=settings.rpc,
        n_seq_max=n_seq_max, n_parallel=n_parallel, mtp=settings.mtp and with_draft,
        memory=settings.memory, memory_size=settings.memory_size,
    ))
