"""The settings panel: models, strategy and its knobs, sampling, thinking, system prompt.

Each field names a path into `app.settings.Settings` (e.g.
`options.sps.draft_max`). The strategies' rows, their labels and the words
their number fields take (`auto`) come from the fields' declarations in
backends.config; the other rows' types come from the current value. The
dataclasses' own checks validate the result, so the panel has no rules of
its own to drift from the CLI's. Changes apply from the next turn.
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
from backends.settings_schema import Knob, knobs, parse_text

# (path in Settings, label) before and after the strategies' rows; the strategy is a Select, booleans are Switches.
HEAD_FIELDS: tuple[tuple[str, str], ...] = (
    ("target", "Target model"),
    ("draft", "Draft model"),
    ("strategy", "Strategy"),
    ("params.max_tokens", "Max tokens"),
    ("params.temperature", "Temperature"),
    ("params.top_p", "Top-p"),
    ("params.top_k", "Top-k"),
    ("params.min_p", "Min-p"),
    ("params.seed", "Seed"),
)
TAIL_FIELDS: tuple[tuple[str, str], ...] = (
    ("thinking", "Thinking"),  # a thinking model thinks before it answers
    ("params.reasoning_budget", "Thinking budget"),  # tokens; empty: no bound
    ("system_prompt", "System prompt"),
    ("n_ctx", "Context size"),
    ("speculation_view", "Speculation view"),
)
# Fields that may be left empty (None): an empty seed means a random one, an empty thinking budget no bound.
OPTIONAL = frozenset({"target", "draft", "params.seed", "params.reasoning_budget"})
# Whole numbers whose value may be None (so the current value's type cannot say).
OPTIONAL_INTS = frozenset({"params.seed", "params.reasoning_budget"})


def strategy_rows(settings: Settings) -> dict[str, Knob]:
    """The strategies' fields that declare a label, by their path in Settings, in declaration order."""
    return {f"options.{k.path}": k for k in knobs(settings.options) if k.setting.label is not None}


def screen_fields(settings: Settings) -> tuple[tuple[str, str], ...]:
    """Every row of the panel: (path in Settings, label)."""
    rows = tuple((path, str(k.setting.label)) for path, k in strategy_rows(settings).items())
    return HEAD_FIELDS + rows + TAIL_FIELDS


def _field_id(path: str) -> str:
    return "f-" + path.replace(".", "-").replace("_", "-")


def parse_value(path: str, text: str, current: Any, knob: Knob | None = None) -> Any:
    """The typed value of a field's text: as a strategy's field declares it (`knob`), else the current value's
    type."""
    if knob is not None:
        return parse_text(knob, text)
    text = text.strip()
    if path in OPTIONAL and not text:
        return None
    if path in OPTIONAL_INTS or (isinstance(current, int) and not isinstance(current, bool)):
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
        self.rows = screen_fields(settings)
        self.row_knobs = strategy_rows(settings)

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-panel"):
            yield Static("Settings — applied from the next turn", classes="title")
            with VerticalScroll():
                for path, label in self.rows:
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
        for path, label in self.rows:
            widget = self.query_one(f"#{_field_id(path)}")
            current = get_path(self.settings, path)
            try:
                if isinstance(widget, (Select, Switch)):
                    value = widget.value
                else:
                    value = parse_value(path, widget.value, current, self.row_knobs.get(path))
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
