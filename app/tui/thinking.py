"""A thinking model's reasoning in the transcript: its own block above the answer.

As in oterm and LM Studio: the block streams, dim, while the model thinks;
once the answer starts it folds to one line ("Thought for 42 tokens, 1.3 s")
and a click on it (or Ctrl+O for the last one) expands or folds it again. A
turn that ends inside the thinking (no answer: cancelled, or the model never
closed the block) leaves it open, since there is nothing else to read. A
turn with no reasoning text has no block.

In the speculation view (F3) the reasoning's tokens carry the answer's
colours (app.render.token_style: accepted drafts green, rejected drafts red
and struck through, ...), dimmed; otherwise it is the plain text, dimmed.
The tokens arrive labelled by backends.reasoning: `Token.reasoning` is the
reasoning text a token releases, and a rejected draft token's `channel` says
whether its piece was shown in the reasoning or the answer.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.widget import Widget
from textual.widgets import Static

from app.render import TRUECOLOR, token_style
from app.tui.coloured_text import ColouredText
from backends.events import REJECTED, Done, Token

BODY_STYLE = "dim italic"


def thinks(tok: Token) -> bool:
    """An output token of the reasoning (its text, or text it held back, is the reasoning's)."""
    return tok.kind != REJECTED and (tok.channel == "reasoning" or bool(tok.reasoning))


def answers(tok: Token) -> bool:
    """An output token of the answer (the first one after the reasoning ends the thinking)."""
    return tok.kind != REJECTED and tok.channel == "content"


def answer_tail(shown: str, done: Done) -> str:
    """The answer's text no token carried: `Done.tail`, or all that `Done.text` has past what was shown (a
    thinking model's Done can carry answer text that neither a token nor its tail did)."""
    if done.text.startswith(shown + done.tail) and len(done.text) > len(shown + done.tail):
        return done.text[len(shown):]
    return done.tail


def thought_label(tokens: int, seconds: float | None) -> str:
    if not tokens:
        return "Thoughts"
    took = f", {seconds:.1f} s" if seconds is not None else ""
    return f"Thought for {tokens} token{'s' if tokens != 1 else ''}{took}"


class ThinkingBlock(Widget):
    """The reasoning of one answer: a one-line header (click: expand or fold) over the dimmed text."""

    DEFAULT_CSS = """
    ThinkingBlock {
        height: auto;
        layout: vertical;
        margin-bottom: 1;
    }
    ThinkingBlock > #thinking-header {
        color: $text-muted;
        text-style: italic;
    }
    ThinkingBlock:hover > #thinking-header {
        color: $text;
    }
    """

    def __init__(self, speculation_view: bool) -> None:
        super().__init__()
        self.speculation_view = speculation_view
        self.header = Static("", id="thinking-header", markup=False)
        self.body = ColouredText()
        self._pieces: list[tuple[str, Token | None]] = []  # the reasoning's pieces, rejected drafts' too
        self.text = ""  # the reasoning (no rejected drafts)
        self.tokens = 0  # the reasoning's output tokens
        self.thinking = True  # the model is still thinking
        self.seconds: float | None = None  # how long it thought
        self.expanded = True
        self._chosen = False  # the user expanded or folded it: it stays as they left it
        self.dirty = True  # something to show since the last refresh_view
        self._show_header()

    def compose(self) -> ComposeResult:
        yield self.header
        yield self.body

    @property
    def started(self) -> bool:
        return bool(self.tokens or self.text)

    @property
    def visible(self) -> bool:
        """Whether the block is shown: it has reasoning to show."""
        return bool(self.text.strip())

    def add(self, tok: Token) -> None:
        """A token of the answer's stream: its reasoning part (a rejected draft: its piece if it was shown
        in the reasoning); the first answer token after the reasoning ends the thinking."""
        if tok.kind == REJECTED:
            if tok.channel == "reasoning":
                self._append(tok.text, tok)
            return
        if tok.channel == "reasoning":
            self.tokens += 1
            self.dirty = True
        if tok.reasoning:
            self._append(tok.reasoning, tok)

    def add_text(self, text: str) -> None:
        """Reasoning no token carried (what the model's Done says was held back; a saved answer's)."""
        if text:
            self._append(text, None)

    def _append(self, text: str, tok: Token | None) -> None:
        self._pieces.append((text, tok))
        self.dirty = True
        if tok is None or tok.kind != REJECTED:
            self.text += text
        style = self._style(tok)
        if style is not None:
            self.body.append(text, style)

    def _style(self, tok: Token | None) -> str | None:
        """A piece's style in the current view; None: not shown (a rejected draft outside the speculation view)."""
        if not self.speculation_view:
            return None if tok is not None and tok.kind == REJECTED else BODY_STYLE
        return f"{BODY_STYLE} {token_style(tok, TRUECOLOR)}".strip() if tok is not None else BODY_STYLE

    def end(self, seconds: float | None, answered: bool = True) -> None:
        """The thinking is over: folded to its header once there is an answer to read (unless the user chose)."""
        if not self.thinking:
            return
        self.thinking = False
        self.seconds = seconds
        if answered and not self._chosen:
            self.expanded = False
        self.refresh_view()

    def toggle(self) -> None:
        self._chosen = True
        self.expanded = not self.expanded
        self.refresh_view()

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.toggle()

    def set_view(self, speculation_view: bool) -> None:
        """The speculation view on or off: the text again, in the other view's styles."""
        if speculation_view == self.speculation_view:
            return
        self.speculation_view = speculation_view
        old, self.body = self.body, ColouredText()
        for text, tok in self._pieces:
            style = self._style(tok)
            if style is not None:
                self.body.append(text, style)
        if old.is_mounted:
            old.remove()
            self.mount(self.body)
        self.refresh_view()

    def _show_header(self) -> None:
        if self.thinking:
            label = f"Thinking… {self.tokens} token{'s' if self.tokens != 1 else ''}" if self.tokens else "Thinking…"
        else:
            label = thought_label(self.tokens, self.seconds)
        self.header.update(Text(f"{'▼' if self.expanded else '▶'} {label}"))

    def refresh_view(self) -> None:
        """Show what was added: the header, and the text while expanded."""
        self.dirty = False
        self._show_header()
        self.body.display = self.expanded
        if self.expanded:
            self.body.show()
