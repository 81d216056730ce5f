"""`specchat run --json-schema FILE|JSON` and `--grammar-file FILE`: the grammar a run's output must follow.

A JSON schema is given inline or as a file; a grammar file is llama.cpp's
GBNF (as `llama-cli --grammar-file` takes it) or, named `*.lark`, Lark. Both
compile with llguidance against the target's vocabulary (backends.grammar);
one that does not compile is one error line, before anything is generated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import UserError

if TYPE_CHECKING:  # llama.cpp and llguidance load only for the commands that generate
    from backends.grammar import Grammar
    from backends.llama import LlamaModel


def add_grammar_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output").add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE|JSON",
                   help="the output is JSON matching this schema (a file, or the schema itself); with --json the "
                        "last line carries it parsed")
    g.add_argument("--grammar-file", "--grammar", dest="grammar_file", metavar="FILE",
                   help="the output follows this grammar: llama.cpp's GBNF, or Lark for a .lark file")


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the {what} {path}: {e.strerror if isinstance(e, OSError) else e}") from None


def grammar_from_flags(args: argparse.Namespace, model: "LlamaModel") -> "Grammar | None":
    from backends.grammar import compile_grammar

    schema_arg = getattr(args, "json_schema", None)
    grammar_file = getattr(args, "grammar_file", None)
    if schema_arg is not None:
        text = schema_arg if schema_arg.lstrip().startswith("{") else _read(schema_arg, "JSON schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--json-schema is not valid JSON: {e}") from None
        return compile_grammar("json_schema", schema, model.guidance_tokenizer, model.n_vocab)
    if grammar_file is not None:
        kind = "lark" if grammar_file.endswith(".lark") else "gbnf"
        return compile_grammar(kind, _read(grammar_file, "grammar"), model.guidance_tokenizer, model.n_vocab)
    return None
