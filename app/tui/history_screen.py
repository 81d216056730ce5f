"""Past conversations, newest first; Enter reopens one."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from app.conversations import Conversation


class HistoryScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__()
        self.conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical(id="history-panel"):
            yield Static("Conversations — Enter to reopen, Escape to close", classes="title")
            if not self.conversations:
                yield Static("No saved conversations yet.")
            options = [
                Option(f"{c.updated[:16].replace('T', ' ')}  {c.title}  ({c.turns})", id=c.id)
                for c in self.conversations
            ]
            yield OptionList(*options)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
