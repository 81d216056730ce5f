"""`specchat chat` (and `specchat` alone): open the chat app.

The saved settings (app.settings) are the starting point; flags given on the
command line override them and are saved, the way a user expects a chat app
to remember the last model and strategy.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from app.settings import Settings, load_settings, with_path

# argparse dest -> paths in Settings it sets (--draft-max is K for sps and lookup alike, as in `run`).
FLAG_PATHS: dict[str, tuple[str, ...]] = {
    "model": ("target",),
    "model_draft": ("draft",),
    "strategy": ("strategy",),
    "system": ("system_prompt",),
    "max_tokens": ("params.max_tokens",),
    "temp": ("params.temperature",),
    "top_k": ("params.top_k",),
    "top_p": ("params.top_p",),
    "min_p": ("params.min_p",),
    "seed": ("params.seed",),
    "stop": ("params.stop",),
    "draft_max": ("options.sps.draft_max", "options.lookup.draft_max"),
    "draft_p_min": ("options.sps.p_min", "options.tree.p_min"),
    "lookahead_window": ("options.lookahead.window",),
    "lookahead_ngram": ("options.lookahead.ngram",),
    "lookahead_guesses": ("options.lookahead.guesses",),
    "lookahead_seed_prompt": ("options.lookahead.seed_pool_from_prompt",),
    "lookup_ngram_max": ("options.lookup.ngram_max",),
    "lookup_ngram_min": ("options.lookup.ngram_min",),
    "tree_depth": ("options.tree.depth",),
    "tree_top_k": ("options.tree.top_k",),
    "tree_nodes": ("options.tree.nodes",),
    "tree_shape": ("options.tree.shape",),
    "draft_p_split": ("options.tree.p_split",),
    "ctx_size": ("n_ctx",),
    "threads": ("threads",),
    "gpu_layers": ("n_gpu_layers",),
    "gpu_layers_draft": ("n_gpu_layers_draft",),
}


def settings_from_flags(saved: Settings, args: argparse.Namespace) -> Settings:
    """`saved` with every flag the user gave applied (flags left out are None)."""
    out = saved
    for dest, paths in FLAG_PATHS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "stop":
            value = tuple(value)
        for path in paths:
            out = with_path(out, path, value)
    if getattr(args, "no_adaptive", None):
        out = with_path(out, "options.sps.adaptive", False)
    if args.model is not None and args.model_draft is None:
        out = replace(out, draft=None)  # a new target does not keep the old target's draft
    return out


def chat(args: argparse.Namespace) -> int:
    from app.cli import UserError
    from app.tui import make_app  # Textual loads only for the chat app

    saved, warning = load_settings()
    try:
        settings = settings_from_flags(saved, args) if args.command == "chat" else saved
    except ValueError as e:
        raise UserError(str(e)) from None
    make_app(settings, warning=warning).run()
    return 0
