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

from rich._wrap import divide_line
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.geometry import Size
from textual.widget import Widget
from textual.widgets import Markdown, Static

from app.render import TRUECOLOR, token_style
from backends.events import REJECTED, Token

PLACEHOLDER = "…"  # shown until the first token arrives


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


def live_cut(plain: str, width: int, chunk: int) -> int:
    """Where to cut the live text `plain` (shown `width` cells wide) so that its beginning can be frozen: an
    offset at which a shown line begins, past the first, or 0 for no cut while `plain` is `chunk` or shorter.

    The cut is at the start of the last line shown: after the last newline, or, in a last paragraph longer
    than `chunk`, at the start of its last wrapped line. Wrapping is greedy (rich's `divide_line`, which
    Textual uses), so text appended later changes only the last line: the lines before the cut are final,
    and the text after it wraps as it would in one widget.
    """
    if len(plain) <= chunk:
        return 0
    start = plain.rfind("\n") + 1  # the last paragraph's start
    paragraph = plain[start:]
    if len(paragraph) > chunk and "\t" not in paragraph:  # tabs are expanded before wrapping: cut at newlines
        offsets = divide_line(paragraph, width, fold=True)
        if offsets:
            return start + offsets[-1]
    return start


class ColouredText(Widget):
    """The speculation view's text, in `Static`s of whole lines: all but the last one never change again.

    A `Static` re-wraps its whole text on every update, so one `Static` for a whole answer costs time
    quadratic in the answer's length (on a long answer the UI took a large share of a core from generation:
    docs/results.md, "Figures behind design choices"). Once the live part holds more than CHUNK characters, its lines but the last
    move into a `Static` of their own (`live_cut`), and later updates re-wrap only the text after them. The
    cuts depend on the width; when it changes, the text is cut again.
    """

    DEFAULT_CSS = """
    ColouredText {
        height: auto;
        layout: vertical;
    }
    """
    CHUNK = 1000

    def __init__(self) -> None:
        super().__init__()
        self.text = Text()  # the whole text
        self._live_text = Text()  # its end, not yet frozen
        self._live = Static(PLACEHOLDER, markup=False)
        self._cut_at_width = 0

    def compose(self) -> ComposeResult:
        yield self._live

    def append(self, text: str, style: str | None = None) -> None:
        self.text.append(text, style=style)
        self._live_text.append(text, style=style)

    @property
    def pieces(self) -> list[Text]:
        """The text as shown: the frozen pieces, then the live one."""
        return [w.content for w in self.query_children(Static) if w is not self._live] + [self._live_text]

    def on_resize(self) -> None:
        if self.size.width != self._cut_at_width and len(self.children) > 1:
            self.remove_children([w for w in self.children if w is not self._live])
            self._live_text = self.text.copy()
            self.show()

    def show(self) -> None:
        width = self.size.width
        cut = live_cut(self._live_text.plain, width, self.CHUNK) if self.is_mounted and width else 0
        if cut:
            done, self._live_text = self._live_text.divide([cut])
            # A cut after a newline drops it (the next Static begins a line); one inside a paragraph drops
            # the spaces the wrap would have hidden at the end of that line (a struck-out space would show).
            if done.plain.endswith("\n"):
                done.right_crop(1)
            else:
                done.rstrip()
            self.mount(Static(done, markup=False), before=self._live)
            self._cut_at_width = width
        self._live.update(self._live_text if self.text else PLACEHOLDER)


class AnswerView(Widget):
    """One answer: `ColouredText` for the speculation view (and the placeholder), a `Markdown` for the other."""

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

    def compose(self) -> ComposeResult:
        yield self.spec
        yield self.markdown

    def on_mount(self) -> None:
        self._show()

    @property
    def output_text(self) -> str:
        return "".join(self._output)

    def add_tokens(self, tokens: Iterable[Token]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            self.spec.append(tok.text, token_style(tok, TRUECOLOR))
            if tok.kind != REJECTED:
                self._output.append(tok.text)
        self._show()

    def finish(self, tail: str) -> None:
        """The end of the answer: the text no token carried (also a saved answer, shown with no tokens)."""
        self.spec.append(tail)
        self._output.append(tail)
        self._show()

    def set_view(self, speculation_view: bool) -> None:
        self.speculation_view = speculation_view
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
