"""Incremental detokenization: token ids in, whole characters out.

A UTF-8 character can span several byte-fallback tokens, so pieces go through
an incremental UTF-8 decoder that keeps an incomplete sequence until the token
that completes it arrives. Stop strings are matched on the decoded text; text
that could still turn out to be the start of a stop string is held back
until it cannot (as llama.cpp's server and llama-cpp-python do).

A control token renders as nothing, which is right for an end-of-turn token
and wrong for a thinking model's tags where its vocabulary has them as
control tokens: the tag would never be seen, so never end the thinking as a
stop string, nor split the answer from it. `rendering` renders those tags'
tokens as their text, as llama-server renders a format's `preserved_tokens`
(tools/server/server-context.cpp, accept_special_token).
"""

from __future__ import annotations

import codecs
from typing import Callable, Protocol, Sequence


class Vocabulary(Protocol):
    def tokenize(self, text: str, add_special: bool = ..., parse_special: bool = ...) -> list[int]: ...

    def piece(self, token: int, special: bool = False) -> bytes: ...


def rendering(model: Vocabulary, tags: Sequence[str]) -> Callable[[int], bytes]:
    """The pieces of `model`'s tokens, with the tokens of `tags` that are control tokens (which render as
    nothing) rendered as their text; `model.piece` itself when there are none."""
    kept = frozenset(t for tag in tags if tag for t in model.tokenize(tag, add_special=False, parse_special=True)
                     if not model.piece(t) and model.piece(t, True))
    if not kept:
        return model.piece
    return lambda token: model.piece(token, token in kept)


class TextStream:
    def __init__(self, piece: Callable[[int], bytes], stop: tuple[str, ...] = ()) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._text = ""  # everything decoded so far (may include a stop string)
        self._released = 0  # characters of _text handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """The output text released so far."""
        return self._text[: self._released]

    def push(self, token: int) -> str:
        """Add one output token; return the text it releases ('' while held back)."""
        if self.stopped:
            return ""
        self._text += self._decoder.decode(self._piece(token))
        end = len(self._text)
        if self._stop:
            hit = self._find_stop()
            if hit is not None:
                self.stopped = True
                end = hit
            else:
                end -= self._held_suffix()
        return self._release(end)

    def flush(self) -> str:
        """At the end of generation: release whatever was held back."""
        if self.stopped:
            return ""
        self._text += self._decoder.decode(b"", final=True)
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        out = self._text[self._released : end]
        self._released = max(self._released, end)
        return out

    def _find_stop(self) -> int | None:
        # A stop string can only newly appear in the unreleased tail plus a
        # stop-length overlap into what was released.
        start = max(0, self._released - max(len(s) for s in self._stop))
        hits = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_suffix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), longest, -1):
                if self._text.endswith(s[:n]):
                    longest = n
                    break
        return longest
