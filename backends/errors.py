"""The engine's own exceptions, importable without loading llama.cpp.

The front ends classify failures by these types (app.errors) before any
model is loaded, so this module imports nothing heavy.
"""

from __future__ import annotations


class PromptError(ValueError):
    """The prompt cannot be generated from (empty, or longer than the context)."""


class DecodeError(RuntimeError):
    """llama_decode failed (e.g. the KV cache is full)."""


class CacheRollbackError(RuntimeError):
    """llama.cpp refused to remove part of a sequence from the KV cache."""


class ContextFullError(ValueError):
    """The tokens do not fit in the context window."""
