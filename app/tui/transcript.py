"""The conversation as the user sees it: their messages, the answers, and notes.

An answer keeps every token event, so the speculation view can be turned on
and off at any time: on, each token is coloured by its origin as in the
figure of Leviathan et al. 2023 (accepted draft green, rejected draft red and
struck through, the target's correction blue, the target's own tokens in the
default colour; app.render.token_style, shared with the CLI); off, the
output text is rendered as Markdown.

The Markdown view is Textual's `Markdown` widget fed by `Markdown.append`:
each streamed batch appends only its new text, and the widget re-parses
only from its last top-level block, so an answer costs about linear time to
show. Re-rendering the whole answer as one Markdown document on every batch
(as a `Static` must) costs time quadratic in the answer's length, and on a
2-core machine that time is taken from generation. Even so each append
re-lays out and repaints the blocks on screen, so batches come as far apart
as their measured cost needs (app.tui.streaming.Pacer), and each batch that
arrives is shown at once. Textual's `MarkdownStream` wraps the same append
in a task of its own, to coalesce fragments that arrive faster than they
render; batches arrive a quarter of a second or more apart, there is nothing
to coalesce, and the task's hop cost a frame of its own per batch. Each view
is kept up to date only while it is shown: the Markdown widget catches up
with one append when the user switches to it.

The transcript follows its end while content grows, unless the user has
scrolled up to read: once it overflows it is anchored (Textual's
`Widget.anchor`), so the scroll to the end happens in the same layout pass
as the growth, not in a frame of its own after it.
"""

from __future__ import annotations

from typing import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.widget import Widget
from textual.widgets import Markdown, Static

from app.render import TRUECOLOR, token_style
from app.tui.coloured_text import PLACEHOLDER, ColouredText, live_cut
from app.tui.thinking import ThinkingBlock, answers
from backends.events import REJECTED, Token

__all__ = ["PLACEHOLDER", "AnswerView", "ColouredText", "Note", "Transcript", "UserMessage", "live_cut", "unsent"]


class UserMessage(Static):
    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False)
        self.text = text


class Note(Static):
    """A line from the app itself: an error, a cancelled turn, a model loaded."""

    def __init__(self, text: str, kind: str) -> None:
        super().__init__(text, markup=False, classes=kind)


def unsent(pieces: list[str], sent: int) -> tuple[str, int]:
    """The text of `pieces` after the first `sent`, and the new count sent."""
    return "".join(pieces[sent:]), len(pieces)


class AnswerView(Widget):
    """One answer: `ColouredText` for the speculation view (and the placeholder), a `Markdown` for the other;
    above them a thinking model's reasoning (app.tui.thinking), mounted once it has text."""

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
        self._output: list[str] = []  # the output text in pieces: accepted and target tokens, then the tail
        self._sent = 0  # pieces of _output already written to the Markdown widget
        self.spec = ColouredText()
        self.markdown = Markdown()
        self.thinking = ThinkingBlock(speculation_view)

    def compose(self) -> ComposeResult:
        if self.thinking.visible:  # a saved answer's, given before the view was mounted
            yield self.thinking
        yield self.spec
        yield self.markdown

    def on_mount(self) -> None:
        self._show()

    @property
    def output_text(self) -> str:
        return "".join(self._output)

    def add_tokens(self, tokens: Iterable[Token], thought: float | None = None) -> None:
        """A batch of the stream; `thought`: how long a thinking model thought, once its answer has started."""
        block = self.thinking
        for tok in tokens:
            self.tokens.append(tok)
            block.add(tok)
            if tok.kind == REJECTED and tok.channel == "reasoning":
                continue  # a draft of the reasoning: shown in it
            if answers(tok) and block.started:
                block.end(thought)
            self.spec.append(tok.text, token_style(tok, TRUECOLOR))
            if tok.kind != REJECTED:
                self._output.append(tok.text)
        self._show_thinking()
        self._show()

    def finish(self, tail: str, reasoning: str = "", thought: float | None = None) -> None:
        """The end of the answer: the text no token carried (also a saved answer, shown with no tokens), and
        the whole reasoning (what of it no token carried is added); `thought`: how long the thinking took."""
        block = self.thinking
        if reasoning.startswith(block.text):
            block.add_text(reasoning[len(block.text):])
        self.spec.append(tail)
        self._output.append(tail)
        if block.started:
            block.end(thought, answered=bool(self.output_text.strip()) or not block.tokens)
        self._show_thinking()
        self._show()

    def _show_thinking(self) -> None:
        block = self.thinking
        if not block.visible:
            return
        if block.parent is None and self.spec.parent is self:  # else compose yields it
            self.mount(block, before=self.spec)
        if block.dirty:
            block.refresh_view()

    def toggle_thinking(self) -> bool:
        """Expand or fold the reasoning; False when there is none."""
        if not self.thinking.visible:
            return False
        self.thinking.toggle()
        return True

    def set_view(self, speculation_view: bool) -> None:
        self.speculation_view = speculation_view
        self.thinking.set_view(speculation_view)
        self._show()

    @property
    def coloured(self) -> Text:
        """The speculation view: every token, rejected ones included, styled by origin."""
        return self.spec.text

    @property
    def showing_markdown(self) -> bool:
        return not self.speculation_view and bool(self.spec.text)

    def _show(self) -> None:
        markdown = self.showing_markdown
        self.spec.display = not markdown
        self.markdown.display = markdown
        if markdown:
            if self._sent < len(self._output):
                self.call_later(self._send_markdown)  # batches added before it runs go with it
        else:
            self.spec.show()

    async def _send_markdown(self) -> None:
        """Append what the Markdown widget has not seen yet (runs in this widget's queue: in order, once mounted)."""
        if not self.showing_markdown or self._sent == len(self._output):
            return
        fragment, self._sent = unsent(self._output, self._sent)
        await self.markdown.append(fragment)


class Transcript(VerticalScroll):
    """Messages in order; follows the newest one unless the user scrolled up to read.

    Anchored once its content overflows: Textual then keeps it scrolled to the end whenever it
    lays it out, until the user scrolls away (which releases the anchor), and again once they
    scroll back to the end. Not before: an anchored view shorter than its content region shows
    the content at the bottom, and a new chat starts at the top.
    """

    def watch_virtual_size(self, old: Size, new: Size) -> None:
        overflows = new.height > self.scrollable_content_region.height
        if overflows != self.is_anchored:
            self.anchor(overflows)

    def add(self, widget: Widget) -> Widget:
        self.mount(widget)
        return widget

    def answers(self) -> list[AnswerView]:
        return list(self.query(AnswerView))
