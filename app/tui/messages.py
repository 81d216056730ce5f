"""Every message the chat app's workers post to its screen: one place to find what can arrive.

The model's load and the turns run on the app's one llama.cpp thread
(app.tui.chat_screen); they report back only through these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.message import Message

from backends.events import Done, Prefilled, Token

if TYPE_CHECKING:
    from app.tui.streaming import LiveStats
    from backends.engine import Engine


class LoadProgress(Message):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class ModelLoaded(Message):
    def __init__(self, engine: "Engine") -> None:
        super().__init__()
        self.engine = engine


class LoadFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class BaselineMeasured(Message):
    def __init__(self, tokens_per_second: float) -> None:
        super().__init__()
        self.tokens_per_second = tokens_per_second


class TurnFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class TokensArrived(Message):
    """A batch of tokens; `thought`: the seconds a thinking model thought, once its answer has started."""

    def __init__(self, tokens: tuple[Token, ...], live: "LiveStats", thought: float | None = None) -> None:
        super().__init__()
        self.tokens = tokens
        self.live = live
        self.thought = thought


class PromptDecoded(Message):
    def __init__(self, prefilled: Prefilled) -> None:
        super().__init__()
        self.prefilled = prefilled


class TurnFinished(Message):
    def __init__(self, done: Done, live: "LiveStats") -> None:
        super().__init__()
        self.done = done
        self.live = live  # its final figures, the plain steps' timing with them
