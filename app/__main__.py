"""`python -m app` is the `specchat` command."""

from app.cli import entry

entry()
