"""Driving the chat app in tests: build it on tiny GGUFs, type, wait for the workers."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from textual.pilot import Pilot
from textual.widgets import Input, OptionList

from app.settings import Settings
from app.tui import SpecchatApp, make_app
from app.tui.transcript import Note
from backends.sampling import GenParams

WAIT_SECONDS = 60.0


def tiny_settings(target: Path | str, draft: Path | str | None, strategy: str = "sps", max_tokens: int = 40,
                  **overrides) -> Settings:
    return Settings(target=str(target), draft=str(draft) if draft else None, strategy=strategy,
                    params=GenParams(max_tokens=max_tokens), threads=1, **overrides)


def app_for(settings: Settings, tmp_path: Path, calibrate: bool = False) -> SpecchatApp:
    return make_app(settings, settings_path=tmp_path / "config" / "settings.json",
                    conversations=tmp_path / "conversations", calibrate=calibrate)


async def wait_for(pilot: Pilot, condition: Callable[[], bool], what: str, timeout: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)


def errors(chat) -> list[str]:
    """The error lines the app showed in its transcript."""
    return [str(n.render()) for n in chat.query(Note) if n.has_class("error")]


async def wait_loaded(pilot: Pilot) -> None:
    chat = pilot.app.chat
    await wait_for(pilot, lambda: not chat.loading and (chat.session is not None or errors(chat)), "the model")


async def send(pilot: Pilot, text: str) -> None:
    """Type a message, press Enter, wait until the answer is finished (or refused with an error)."""
    chat = pilot.app.chat
    before, n_errors = chat.last_done, len(errors(chat))
    chat.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: not chat.generating and (chat.last_done is not before or len(errors(chat)) > n_errors),
                   "the answer")
    await pilot.pause()


def char_styles(*texts) -> list[tuple[str, str]]:
    """Each visible character of rich Texts with the styles on it (a space's or a newline's shows nowhere)."""
    out = []
    for text in texts:
        styles: list[list[str]] = [[] for _ in text.plain]
        for span in text.spans:
            for i in range(span.start, span.end):
                styles[i].append(str(span.style))
        out += [(ch, "+".join(st)) for ch, st in zip(text.plain, styles) if not ch.isspace()]
    return out


def option_labels(options: OptionList) -> dict[str, bool]:
    """An option list's rows: option text -> selectable."""
    return {str(options.get_option_at_index(i).prompt): not options.get_option_at_index(i).disabled
            for i in range(options.option_count)}
