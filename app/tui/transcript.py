"""The conversation as the user sees it: their messages, the answers, and notes.

An answer keeps every token event, so the speculation view can be turned on
and off at any time: on, each token is coloured by its origin as in the
figure of Leviathan et al. 2023 (accepted draft green, rejected draft red and
struck through, the target's correction blue, the target's own tokens in the
default colour; app.render.token_style, shared with the CLI); off, the
output text is rendered as Markdown.
"""

from __future__ import annotations

from typing import Iterable

from rich.markdown import Markdown
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from app.render import TRUECOLOR, token_style
from backends.events import REJECTED, Token


class UserMessage(Static):
    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False)


class Note(Static):
    """A line from the app itself: an error, a cancelled turn, a model loaded."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__(text, markup=False, classes=kind)


class AnswerView(Static):
    def __init__(self, speculation_view: bool) -> None:
        super().__init__("…")
        self.speculation_view = speculation_view
        self.tokens: list[Token] = []
        self.tail = ""
        self._coloured = Text()

    @property
    def output_text(self) -> str:
        return "".join(t.text for t in self.tokens if t.kind != REJECTED) + self.tail

    def add_tokens(self, tokens: Iterable[Token]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            self._coloured.append(tok.text, style=token_style(tok, TRUECOLOR))
        self._show()

    def finish(self, tail: str) -> None:
        self.tail = tail
        self._coloured.append(tail)
        self._show()

    def set_view(self, speculation_view: bool) -> None:
        self.speculation_view = speculation_view
        self._show()

    @property
    def coloured(self) -> Text:
        """The speculation view: every token, rejected ones included, styled by origin."""
        return self._coloured

    def view_renderable(self) -> Text | Markdown | str:
        if self.speculation_view:
            return self._coloured if self._coloured else "…"
        text = self.output_text  # joined only for the Markdown view, not on every streamed update
        return Markdown(text) if text.strip() or self._coloured else "…"

    def _show(self) -> None:
        self.update(self.view_renderable())


class Transcript(VerticalScroll):
    """Messages in order; follows the newest one unless the user scrolled up to read."""

    def _follow(self) -> None:
        if self.max_scroll_y - self.scroll_y <= 2:
            self.call_after_refresh(self.scroll_end, animate=False)

    def add(self, widget: Static) -> Static:
        self.mount(widget)
        self._follow()
        return widget

    def changed(self) -> None:
        self._follow()

    def answers(self) -> list[AnswerView]:
        return list(self.query(AnswerView))
