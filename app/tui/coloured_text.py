"""The speculation view's text as Statics of whole lines, all but the last frozen (app.tui.transcript's answers and
app.tui.thinking's reasoning show their tokens in it)."""

from __future__ import annotations

from rich._wrap import divide_line
from rich.text import Text
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Static

PLACEHOLDER = "…"  # shown until the first token arrives


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
