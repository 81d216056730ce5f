"""The streaming splitter of a thinking model's output into reasoning and answer, for a format with tags.

backends.reasoning's `Splitter` (re-exported there, with the formats it reads): released text in, the
reasoning and the answer out, as llama.cpp's parsers split a whole output (common/chat-auto-parser-generator.cpp
for the tag formats, common/parsers/gemma4.cpp for Gemma 4's channels), and the same pieces however the text
is cut into tokens. Kept apart from backends.reasoning, whose formats and budget are its users, so that each
file reads top to bottom.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backends.events import Channel

if TYPE_CHECKING:
    from backends.reasoning import ReasoningFormat

REASONING: Channel = "reasoning"
CONTENT: Channel = "content"
GEMMA4_CHANNEL = "<|channel>"  # Gemma 4's channel marker: the start tag's beginning


def _held(text: str, *tags: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `tags` (it may yet become it)."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(len(t) > n and t.startswith(text[-n:]) for t in tags):
            return n
    return 0


def _block_at(text: str, start: str, skip: str) -> int | None:
    """Where the start tag begins in `text`, after any `skip` markers (Gemma 4's `<|channel>`s that open no
    block, which its parser drops before one that does: gemma4.cpp:210); -1: `text` opens no block; None: it
    may yet (a start tag's beginning, or nothing yet)."""
    i = 0
    while True:
        rest = text[i:]
        if rest.startswith(start):
            return i
        if start.startswith(rest):
            return None
        if not skip or not rest.startswith(skip):
            return -1
        i += len(skip)


class Splitter:
    """Released text in, (reasoning, answer) text out, as it streams.

    Before the block (a format whose prompt does not open it), leading
    whitespace is held until the start tag or other text shows whether the
    model thinks. Inside, text is released as reasoning except a tail that
    may begin the end tag, and trailing whitespace (trimmed when the block
    ends). After it, the answer's leading whitespace is dropped. Gemma 4's
    answer is messages, as its parser reads them (common/parsers/gemma4.cpp:
    285-290): each answer runs to the next `<|channel>` or `<channel|>`; a
    `<|channel>thought` there opens another block (more reasoning, after
    stray `<|channel>`s), and a stray `<channel|>` or a `<|channel>` that
    opens none ends the answer: what follows is dropped ("done").
    """

    def __init__(self, fmt: ReasoningFormat, opened: bool | None = None) -> None:
        if fmt.channels:
            raise ValueError("harmony's channels have their own splitter: backends.reasoning.new_splitter(fmt)")
        self.fmt = fmt
        self.state: str = REASONING if (fmt.opened if opened is None else opened) else "before"
        self._skip = GEMMA4_CHANNEL if fmt.start.startswith(GEMMA4_CHANNEL) else ""  # what ends Gemma 4's answer
        self._buf = ""
        self._lead = True  # at the start of a channel: its leading whitespace is dropped
        self.reasoning = ""
        self.content = ""

    @property
    def channel(self) -> Channel:
        return REASONING if self.state == REASONING else CONTENT

    @property
    def thinking(self) -> bool:
        """Inside the reasoning block."""
        return self.state == REASONING

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and answer text that `text` releases (either may be empty)."""
        self._buf += text
        reasoning = content = ""
        start, end = self.fmt.start, self.fmt.end
        while self.state != "done":
            if self.state in ("before", "block?"):  # "block?": Gemma 4's answer met a `<|channel>`
                head = self._buf.lstrip() if self.state == "before" else self._buf
                at = _block_at(head, start, self._skip)
                if at is None:
                    break  # whitespace, or the start tag's beginning: not known yet
                if at >= 0:
                    self._buf, self.state, self._lead = head[at + len(start):], REASONING, True
                else:
                    self.state = CONTENT if self.state == "before" else "done"
                continue
            if self.state == REASONING:
                if self._lead:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._lead = False
                i = self._buf.find(end)
                if i >= 0:
                    reasoning += self._buf[:i].rstrip()
                    self._buf, self.state = self._buf[i + len(end):], CONTENT
                    self._lead = not (self.content or content)  # the answer's start: a later one is kept as written
                    continue
                keep = _held(self._buf, end)
                body = self._buf[:len(self._buf) - keep]
                stripped = body.rstrip()
                reasoning += stripped
                self._buf = body[len(stripped):] + self._buf[len(self._buf) - keep:]
                break
            if self._lead:  # the answer
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._lead = False
            if not self._skip:
                content, self._buf = content + self._buf, ""
                break
            marks = [i for i in (self._buf.find(self._skip), self._buf.find(end)) if i >= 0]
            if not marks:
                keep = _held(self._buf, self._skip, end)
                content, self._buf = content + self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                break
            content, self._buf = content + self._buf[:min(marks)], self._buf[min(marks):]
            self.state = "done" if self._buf.startswith(end) else "block?"
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def close(self) -> str:
        """The block ends here (its end tag was a stop string, or was forced): the answer follows. Returns the
        reasoning it releases (a tail held back as the end tag's possible start is reasoning after all). Gemma 4's
        answer ends at an end tag outside the block."""
        out = ""
        if self.state == REASONING and not self._lead:
            out = self._buf.rstrip()
            self.reasoning += out
        if self.state in (REASONING, "before"):
            self.state, self._buf, self._lead = CONTENT, "", not self.content
        elif self._skip:
            self.state, self._buf = "done", ""
        return out

    def flush(self) -> tuple[str, str]:
        """At the end of the output: what was held back. A block never closed keeps its text as reasoning; a
        tail that might have begun a tag is dropped, as llama.cpp's lenient parse has it (an until() stops
        before a delimiter's start at the end of the input: peg-parser.cpp:718)."""
        buf, self._buf = self._buf, ""
        if self.state == REASONING:
            out = buf[:len(buf) - _held(buf, self.fmt.end)].rstrip() if not self._lead else ""
            self.reasoning += out
            return out, ""
        if self.state == "before":
            buf = buf.strip()
        elif self.state != CONTENT or self._skip:
            buf = ""  # Gemma 4's held tail, or what follows the end of its answer
        self.content += buf
        return "", buf
