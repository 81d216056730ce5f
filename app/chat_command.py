"""`specchat chat` (and `specchat` alone): open the chat app.

The saved settings (app.settings) are the starting point; flags given on the
command line override them and are saved, the way a user expects a chat app
to remember the last model and strategy.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from app.errors import UserError
from app.settings import Settings, apply_flags, load_settings


def settings_from_flags(saved: Settings, args: argparse.Namespace) -> Settings:
    """`saved` with every flag the user gave applied (flags left out are None)."""
    out = apply_flags(saved, args)
    if args.model is not None and args.model_draft is None:
        out = replace(out, draft=None)  # a new target does not keep the old target's draft
    return out


def chat(args: argparse.Namespace) -> int:
    from app.tui import make_app  # Textual loads only for the chat app

    saved, warning = load_settings()
    try:
        settings = settings_from_flags(saved, args) if args.command == "chat" else saved
    except ValueError as e:
        raise UserError(str(e)) from None
    make_app(settings, warning=warning).run()
    return 0
