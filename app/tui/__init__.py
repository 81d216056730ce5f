"""specchat's terminal chat app (Textual). `make_app` builds it; see app.tui.app."""

from app.tui.app import SpecchatApp, make_app

__all__ = ["SpecchatApp", "make_app"]
