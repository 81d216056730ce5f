"""What every front end (CLI, chat app, server) says when something goes wrong.

One classification for all of them: a *user error* is something the user can
fix (a missing or malformed model, an incompatible pair, a bad flag or
setting, a prompt that does not fit, a chat template that fails); anything
else is a failure at run time. The CLI prints one line and exits 1 or 2, the
chat app shows the line in the transcript, the server answers 400 or 500.
"""

from __future__ import annotations

import sys

from app.chat_template import ChatTemplateError
from backends.errors import PromptError
from models.errors import ModelError

EXIT_OK = 0
EXIT_USER = 1
EXIT_RUNTIME = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool whose reader went away


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit 1."""


# Exceptions whose message is already a sentence for the user.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError, ModelError, PromptError, ChatTemplateError, ValueError)


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, USER_ERRORS)


def describe(e: BaseException) -> str:
    """One line for the user: the message of a user error, the type and message of anything else."""
    if is_user_error(e) or isinstance(e, OSError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def error_line(message: str) -> str:
    return f"specchat: error: {message}"


def print_error(message: str) -> None:
    print(error_line(message), file=sys.stderr, flush=True)


def print_progress(message: str) -> None:
    """A progress line on stderr (building the demo pair, loading, measuring), so stdout stays the answer."""
    print(message, file=sys.stderr, flush=True)
