"""The conversation as the user sees it: their messages, the answers, and notes.

An answer keeps every token event, so the speculation view can be turned on
and off at any time: on, each token is coloured by its origin as in the
figure of Leviathan et al. 2023 (accepted draft green, rejected draft red and
struck through, the target's correction blue, the target's own tokens in the
default colour; app.render.token_style, shared with the CLI); off, the
output text is rendered as Markdown.

The Markdown view is Textual's `Markdown` widget fed through a
`MarkdownStream`: each streamed batch appends only its new text, and the
widget re-parses only from its last top-level block, so an answer costs
about linear time to show. Re-rendering the whole answer as one Markdown
document on every batch (as a `Static` must) costs time quadratic in the
answer's length, and on a 2-core machine that time is taken from
generation. Even so each append re-lays out and repaints the blocks on
screen, so a streaming Markdown answer is updated at most once a second
(MARKDOWN_EVERY), the first text and the end at once. Each view is kept up to
date only while it is shown: the Markdown widget catches up with one append
when the user switches to it.

The transcript follows its end while content grows, unless the user has
scrolled up to read; it decides when the content's height changes, since a
Markdown answer grows only once its stream's append has run.
"""

from __future__ import annotations

import time
from typing import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from app.render import TRUECOLOR, token_style
from backends.events import REJECTED, Token

PLACEHOLDER = "…"  # shown until the first token arrives
# Least seconds between two updates of a streaming Markdown answer. Each update re-lays out and repaints
# the Markdown blocks on screen, about three times what the speculation view's update costs; on a 2-core
# machine that time is taken from generation (at the stream's 0.25 s it cost 12% of the tokens/s on a
# 1,000-token answer, tests/perf/tui_overhead.py --view markdown). The first text and the end show at once.
MARKDOWN_EVERY = 1.0
FOLLOW_SLACK = 2  # lines from the end within which the transcript still follows new content


class UserMessage(Static):
    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False)


class Note(Static):
    """A line from the app itself: an error, a cancelled turn, a model loaded."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__(text, markup=False, classes=kind)


def unsent(pieces: list[str], sent: int) -> tuple[str, int]:
    """The text of `pieces` after the first `sent`, and the new count sent."""
    return "".join(pieces[sent:]), len(pieces)


class AnswerView(Widget):
    """One answer: a `Static` for the speculation view (and the placeholder), a `Markdown` for the other."""

    DEFAULT_CSS = """
    AnswerView {
        height: auto;
        layout: vertical;
    }
    AnswerView > Markdown {
        padding: 0;
    }
    AnswerView > Markdown > MarkdownParagraph:last-child {
        margin-bottom: 0;
    }
    """

    def __init__(self, speculation_view: bool) -> None:
        super().__init__()
        self.speculation_view = speculation_view
        self.tokens: list[Token] = []
        self._coloured = Text()
        self._output: list[str] = []  # the output text in pieces: accepted and target tokens, then the tail
        self._sent = 0  # pieces of _output already written to the Markdown widget
        self._stream: MarkdownStream | None = None
        self._markdown_sent_at = float("-inf")  # time.monotonic() of the last Markdown update
        self._markdown_timer: Timer | None = None
        self._finished = False
        self.spec = Static(PLACEHOLDER, markup=False)
        self.markdown = Markdown()

    def compose(self) -> ComposeResult:
        yield self.spec
        yield self.markdown

    def on_mount(self) -> None:
        self._show()

    async def on_unmount(self) -> None:
        if self._stream is not None:
            await self._stream.stop()

    @property
    def output_text(self) -> str:
        return "".join(self._output)

    def add_tokens(self, tokens: Iterable[Token]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            self._coloured.append(tok.text, style=token_style(tok, TRUECOLOR))
            if tok.kind != REJECTED:
                self._output.append(tok.text)
        self._show()

    def finish(self, tail: str) -> None:
        """The end of the answer: the text no token carried (also a saved answer, shown with no tokens)."""
        self._coloured.append(tail)
        self._output.append(tail)
        self._finished = True
        self._show_now()

    def set_view(self, speculation_view: bool) -> None:
        self.speculation_view = speculation_view
        self._show_now()

    def _show_now(self) -> None:
        """Show what there is without waiting for the next Markdown update."""
        if self._markdown_timer is not None:
            self._markdown_timer.stop()
            self._markdown_timer = None
        self._markdown_sent_at = float("-inf")
        self._show()

    @property
    def coloured(self) -> Text:
        """The speculation view: every token, rejected ones included, styled by origin."""
        return self._coloured

    @property
    def showing_markdown(self) -> bool:
        return not self.speculation_view and bool(self._coloured)

    def _show(self) -> None:
        markdown = self.showing_markdown
        self.spec.display = not markdown
        self.markdown.display = markdown
        if markdown:
            if self._sent < len(self._output) and self._markdown_timer is None:
                wait = MARKDOWN_EVERY - (time.monotonic() - self._markdown_sent_at)
                if wait <= 0 or self._finished:
                    self._markdown_sent_at = time.monotonic()
                    self.call_later(self._send_markdown)
                else:  # the tokens arriving meanwhile go with this update
                    self._markdown_timer = self.set_timer(wait, self._markdown_due)
        else:
            self.spec.update(self._coloured if self._coloured else PLACEHOLDER)

    def _markdown_due(self) -> None:
        self._markdown_timer = None
        self._show()

    async def _send_markdown(self) -> None:
        """Append what the Markdown widget has not seen yet (runs in this widget's queue: in order, once mounted)."""
        if not self.showing_markdown or self._sent == len(self._output):
            return
        fragment, self._sent = unsent(self._output, self._sent)
        if self._stream is None:
            self._stream = Markdown.get_stream(self.markdown)
        await self._stream.write(fragment)


def was_at_end(scroll_y: float, content_height: int, view_height: int, slack: int = FOLLOW_SLACK) -> bool:
    """Whether a view scrolled to `scroll_y` showed the end of content `content_height` lines tall."""
    return content_height - view_height - scroll_y <= slack


class Transcript(VerticalScroll):
    """Messages in order; follows the newest one unless the user scrolled up to read.

    Following is decided when the content grows (a message mounted, an answer's text
    laid out), against the height before the growth: a Markdown answer grows when its
    stream's append has run, after the batch of tokens that caused it.
    """

    def watch_virtual_size(self, old: Size, new: Size) -> None:
        if new.height > old.height and was_at_end(self.scroll_y, old.height, self.scrollable_content_region.height):
            self.scroll_end(animate=False)

    def add(self, widget: Widget) -> Widget:
        self.mount(widget)
        return widget

    def answers(self) -> list[AnswerView]:
        return list(self.query(AnswerView))
