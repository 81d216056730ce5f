"""`specchat chat` (and `specchat` alone): open the chat app.

The saved settings (app.settings) are the starting point; flags given on the
command line override them and are saved, the way a user expects a chat app
to remember the last model and strategy.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

from app.errors import UserError
from app.settings import Settings, apply_flags, load_settings


def settings_from_flags(saved: Settings, args: argparse.Namespace) -> Settings:
    """`saved` with every flag the user gave applied (flags left out are None)."""
    out = apply_flags(saved, args)
    if args.model is not None and args.model_draft is None:
        out = replace(out, draft=None)  # a new target does not keep the old target's draft
    return out


# What Textual's Linux driver writes when it leaves application mode: bracketed paste, mouse reporting,
# the Kitty keyboard protocol, focus events off; line wrap on; the main screen and the cursor back.
_LEAVE_APP_MODE = ("\x1b[?2004l\x1b[?1000l\x1b[?1003l\x1b[?1015l\x1b[?1006l\x1b[?7h\x1b[<u"
                   "\x1b[?1049l\x1b[?25h\x1b[?1004l")


def _restore_terminal_on_fatal_exit() -> None:
    """If llama.cpp aborts mid-run (a lost RPC server), put the terminal back before the process leaves.

    Nothing of Textual's own shutdown runs then: the abort happens on the
    decoding thread and ends the process at once, so the terminal would stay
    in raw mode on the alternate screen.
    """
    import os
    import sys

    from backends.llama_process import on_fatal_exit

    fd = next((f.fileno() for f in (sys.__stderr__, sys.__stdout__, sys.__stdin__)
               if f is not None and f.isatty()), None)
    if fd is None:
        return
    try:
        import termios

        saved = termios.tcgetattr(fd)
    except (ImportError, OSError):
        saved = None

    def restore() -> None:
        os.write(fd, _LEAVE_APP_MODE.encode())
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSANOW, saved)

    on_fatal_exit(restore)


def chat(args: argparse.Namespace) -> int:
    from app.tui import make_app  # Textual loads only for the chat app

    saved, warning = load_settings()
    try:
        settings = settings_from_flags(saved, args) if args.command == "chat" else saved
    except ValueError as e:
        raise UserError(str(e)) from None
    resume = getattr(args, "resume", None)
    if resume is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", resume):
        raise UserError(f"--resume {resume!r}: not a conversation id (see F5 in the app), or 'last'")
    _restore_terminal_on_fatal_exit()
    make_app(settings, warning=warning, resume=resume).run()
    return 0
