"""The Textual app: `make_app` builds it from saved settings (or given ones).

Textual's own conventions (oterm, posting, harlequin): one App, screens for
each job, one stylesheet, widgets in their own modules, work in thread workers.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import App

from app.conversations import ConversationStore
from app.settings import SETTINGS_FILE, Settings, config_dir, load_settings, save_settings
from app.tui.chat_screen import ChatScreen


class SpecchatApp(App):
    CSS_PATH = "specchat.tcss"
    TITLE = "specchat"

    def __init__(self, settings: Settings, settings_path: Path, store: ConversationStore,
                 warning: str | None = None, calibrate: bool = True, resume: str | None = None) -> None:
        super().__init__()
        self.settings_path = settings_path
        self.chat = ChatScreen(settings, store, self._save_settings, calibrate=calibrate, resume=resume)
        self._warning = warning

    def on_mount(self) -> None:
        self.push_screen(self.chat)
        if self._warning:
            self.notify(self._warning, severity="warning", timeout=10)

    def _save_settings(self, settings: Settings) -> None:
        try:
            save_settings(settings, self.settings_path)
        except OSError as e:
            self.notify(f"could not save settings: {e}", severity="error")

    def on_unmount(self) -> None:
        self.chat.close_engine()


def make_app(settings: Settings | None = None, *, settings_path: Path | None = None,
             conversations: Path | None = None, calibrate: bool = True,
             warning: str | None = None, resume: str | None = None) -> SpecchatApp:
    """The chat app. Without `settings`, the saved ones (defaults on first start).

    `calibrate` measures plain decoding after each load, the baseline of the
    speedup shown; tests that pin the picture turn it off. `resume` reopens a
    saved conversation (its id, or "last") once the model is loaded.
    """
    path = settings_path or config_dir() / SETTINGS_FILE
    if settings is None:
        settings, warning = load_settings(path)
    return SpecchatApp(settings, path, ConversationStore(conversations), warning, calibrate, resume)
