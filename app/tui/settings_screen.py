"""The settings panel: models, strategy and its knobs, sampling, system prompt.

Each field names a path into `app.settings.Settings` (e.g.
`options.sps.draft_max`); its type comes from the current value, and the
dataclasses' own checks validate the result, so the panel has no rules of its
own to drift from the CLI's. Changes apply from the next turn.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, Switch

from app.settings import Settings, get_path, with_path
from backends.registry import STRATEGIES
from backends.config import AUTO

# (path in Settings, label); the strategy is a Select, booleans are Switches.
FIELDS: tuple[tuple[str, str], ...] = (
    ("target", "Target model"),
    ("draft", "Draft model"),
    ("strategy", "Strategy"),
    ("params.max_tokens", "Max tokens"),
    ("params.temperature", "Temperature"),
    ("params.top_p", "Top-p"),
    ("params.top_k", "Top-k"),
    ("params.min_p", "Min-p"),
    ("params.seed", "Seed"),
    ("options.sps.draft_max", "sps: K"),
    ("options.sps.p_min", "sps: p_min"),
    ("options.sps.adaptive", "sps: adaptive K"),
    ("options.lookahead.window", "lookahead: W"),
    ("options.lookahead.ngram", "lookahead: N"),
    ("options.lookahead.guesses", "lookahead: G"),
    ("options.lookup.draft_max", "lookup: K"),
    ("options.lookup.ngram_max", "lookup: n-gram max"),
    ("options.tree.depth", "tree: depth"),
    ("options.tree.top_k", "tree: top-k"),
    ("options.tree.nodes", "tree: nodes M"),
    ("options.tree.shape", "tree: shape"),
    ("options.tree.p_split", "tree: p_split"),
    ("system_prompt", "System prompt"),
    ("n_ctx", "Context size"),
    ("speculation_view", "Speculation view"),
)
# Fields that may be left empty (None): an empty seed means a random one.
OPTIONAL = frozenset({"target", "draft", "params.seed"})
# Number fields that also take a word.
WORDS = {"options.tree.nodes": (AUTO,)}


def _field_id(path: str) -> str:
    return "f-" + path.replace(".", "-").replace("_", "-")


def parse_value(path: str, text: str, current: Any) -> Any:
    """The typed value of a field's text; the type is the current value's."""
    text = text.strip()
    if path in OPTIONAL and not text:
        return None
    if path in WORDS and text in WORDS[path]:
        return text
    if path == "params.seed" or (isinstance(current, int) and not isinstance(current, bool)):
        return _number(int, text)
    if isinstance(current, float):
        return _number(float, text)
    return text


def _number(kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None


class SettingsScreen(ModalScreen[Settings | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "apply", "Apply")]

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-panel"):
            yield Static("Settings — applied from the next turn", classes="title")
            with VerticalScroll():
                for path, label in FIELDS:
                    with Horizontal(classes="field"):
                        yield Label(label)
                        yield self._editor(path)
            yield Static("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Apply (Ctrl+S)", variant="primary", id="apply", compact=True)
                yield Button("Cancel (Esc)", id="cancel", compact=True)

    def _editor(self, path: str):
        value = get_path(self.settings, path)
        if path == "strategy":
            return Select([(s, s) for s in STRATEGIES], value=value, allow_blank=False, id=_field_id(path),
                          compact=True)
        if isinstance(value, bool):
            return Switch(value=value, id=_field_id(path))
        return Input("" if value is None else str(value), id=_field_id(path), compact=True)

    def collect(self) -> Settings:
        """The settings as edited; raises ValueError naming the first bad field."""
        out = self.settings
        for path, label in FIELDS:
            widget = self.query_one(f"#{_field_id(path)}")
            current = get_path(self.settings, path)
            try:
                if isinstance(widget, (Select, Switch)):
                    value = widget.value
                else:
                    value = parse_value(path, widget.value, current)
                out = with_path(out, path, value)
            except (ValueError, TypeError) as e:
                raise ValueError(f"{label}: {e}") from None
        return out

    def action_apply(self) -> None:
        try:
            self.dismiss(self.collect())
        except ValueError as e:
            self.query_one("#settings-error", Static).update(Text(str(e), style="bold red"))

    def action_cancel(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.action_cancel()
