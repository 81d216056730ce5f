"""`specchat serve`: the OpenAI-compatible local server (being built; see app/serve.py)."""

from __future__ import annotations

import argparse
from typing import Callable

from app.settings import Settings


def add_serve_parser(sub: argparse._SubParsersAction, parser_class: type[argparse.ArgumentParser],
                     add_model_flags: Callable[[argparse.ArgumentParser], None],
                     add_generation_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible local server with speculative decoding")
    add_model_flags(serve)
    add_generation_flags(serve)


def run_serve(args: argparse.Namespace, settings: Settings) -> int:
    raise NotImplementedError("specchat serve is not built yet")
