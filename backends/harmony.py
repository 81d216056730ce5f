"""gpt-oss's harmony channels: its analysis split from its answer, as llama.cpp's common/parsers/gpt-oss.cpp.

gpt-oss answers in messages, each with a channel in its header:

    <|start|>assistant<|channel|>analysis<|message|>…thinking…<|end|>
    <|start|>assistant<|channel|>final<|message|>…answer…<|return|>

The generation prompt writes the first `<|start|>assistant` itself, so the
output starts at the first `<|channel|>`. llama.cpp recognises the format by
`<|channel|>` in the chat template (chat.cpp, common_chat_try_specialized_template)
and parses: `analysis` messages are reasoning, `final` and `commentary`
(a preamble) messages are the answer, a `<|channel|>commentary to=assistant`
the model sometimes writes before a channel is dropped, and a message to a
recipient (` to=functions.NAME`, ` to=python`: a tool call, not asked for
here) is left out of both (test-chat.cpp's "unsolicited tool calls"). The
splitter keeps such messages apart, each as (recipient, body) in `calls`, for
the server's tool calls (app.serve.harmony_tools), which are theirs to read.

For backends.reasoning the format is a ReasoningFormat whose start is the
analysis header (`<|channel|>analysis<|message|>`), whose end is `<|end|>`, and
whose `after` is the final message's header, which a reasoning budget forces
with the end (llama-server forces `<|end|>` alone and leaves the next header
to the model, which may then think on in a second analysis message).
`HarmonySplitter` is the Splitter of such a format (`channels=True`): the
same interface (push, close, flush, channel, thinking), over messages
instead of one block. It is robust to headers split across tokens or
spelled as several (a vocabulary without harmony's special tokens), to an
analysis never closed (at the end of the output, all of it is reasoning, as
llama.cpp's lenient parse has it), to a model that goes straight to `final`,
and to one that does not write harmony at all (its text is the answer).
Like the tag splitter, it trims each analysis message and the answer's start.

Under a grammar (a response_format, a required or named tool call) gpt-oss
may write analysis messages first, as llama.cpp's grammar has it
(common/parsers/gpt-oss.cpp:97-135, not lazy, the generation prompt's
`<|start|>assistant` fed to it first: common/sampling.cpp:278-308):
`(<|start|>assistant analysis)* <|start|>assistant` and then the final
channel's header and the answer, or the call's header and its arguments.
`opening_grammar` is what the model may write at such a message's start:
an analysis header (the analysis itself is free text, backends.reasoning
runs it as its thinking phase), or the answer's header and the answer under
its grammar. `marker_terminal` writes a marker the way the vocabulary has it
(gpt-oss's are control tokens, which a grammar must name by id).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Callable

from backends.events import Channel

if TYPE_CHECKING:
    from backends.grammar import Grammar
    from backends.reasoning import ReasoningFormat

CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
START = "<|start|>assistant"
END = "<|end|>"
ANALYSIS = f"{CHANNEL}analysis{MESSAGE}"
FINAL = f"{START}{CHANNEL}final{MESSAGE}"
# What ends a message: <|end|> (more follow), <|return|> (the answer's end), <|call|> (a tool call's end). The
# last two are end-of-generation tokens in gpt-oss's vocabulary; spelled as text they end a message too.
TERMINATORS = (END, "<|return|>", "<|call|>")
# The markers llama.cpp's gpt-oss handler keeps in the text it parses (its preserved_tokens), with the terminators:
# a vocabulary that has them as control tokens must render them for a parse to see them (backends.text.rendering).
PRESERVED = ("<|channel|>", "<|constrain|>", MESSAGE, "<|start|>", END, "<|return|>", "<|call|>")
MAX_HEADER = 256  # characters: a "header" longer than this, with no <|message|>, is text

# A message's header, up to its <|message|>: its start (the prompt writes the first), a recipient in the role
# (` to=functions.NAME`), its channel(s) (a stray `<|channel|>commentary to=assistant` may come first), the
# recipient or a `<|constrain|>json` after the channel.
_HEADER = re.compile(r"\s*(?:<\|start\|>assistant)?(?:\s*to=(?P<to>[^\s<]*))?"
                     r"(?P<channels>(?:\s*<\|channel\|>[^<]*)*)\s*(?:<\|constrain\|>[^<]*)?")
# The markers a header is made of: a header cut off before its <|message|> ends in a part of one.
_MARKERS = (START, CHANNEL, "<|constrain|>", MESSAGE, "to=")

REASONING: Channel = "reasoning"
CONTENT: Channel = "content"


def is_harmony(template: str) -> bool:
    """Whether a chat template is gpt-oss's (llama.cpp's test: the template writes `<|channel|>`)."""
    return CHANNEL in template


def template_messages(messages: list[dict[str, object]]) -> list[dict[str, object]]:
    """Messages as gpt-oss's template reads them: an assistant's reasoning as `thinking` (its template drops the
    thinking of answered turns, and writes that of a tool call's turn), and, on a turn with tool calls and
    reasoning, no content (the template refuses both), as llama.cpp's gpt-oss handler passes them."""
    out = []
    for m in messages:
        if isinstance(m.get("reasoning_content"), str):
            m = {**m, "thinking": m["reasoning_content"]}
            if m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    return out


def _header_channel(header: str) -> tuple[bool, Channel | None, str]:
    """(whether `header` is a message's header, the channel its body goes to: None for a message to a recipient,
    which is neither reasoning nor answer, and that recipient: `functions.NAME`, `python`, ...)."""
    m = _HEADER.fullmatch(header)
    if m is None:
        return False, None, ""
    channels = re.findall(r"<\|channel\|>([^<]*)", m.group("channels"))
    last = channels[-1].strip() if channels else ""
    in_channel = re.search(r"\bto=(\S+)", last)
    to = m.group("to") or (in_channel.group(1) if in_channel else "")
    if to and to != "assistant":
        return True, None, to
    return True, REASONING if last.split(" ", 1)[0] == "analysis" else CONTENT, ""


def _may_be_header(text: str) -> bool:
    """Whether `text` (no <|message|> in it yet) may still become a header."""
    if len(text) > MAX_HEADER:
        return False
    cuts = [0, *(n for n in range(1, min(len(text), len(START)) + 1)
                 if any(len(t) > n and t.startswith(text[-n:]) for t in _MARKERS))]
    return any(_HEADER.fullmatch(text[:len(text) - n]) is not None for n in cuts)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-n:]) and len(t) > n for t in tags):
            return n
    return 0


class HarmonySplitter:
    """Released text in, (reasoning, answer) text out, as it streams, for harmony's channels (see the module)."""

    def __init__(self, fmt: "ReasoningFormat", opened: bool | None = None) -> None:
        self.fmt = fmt
        opened = fmt.opened if opened is None else opened
        self._body: Channel | None = REASONING  # the current message's channel (None: left out)
        self._in_body = opened  # in a message's body (else: before a header)
        self._buf = ""
        self._ws = ""  # an analysis message's trailing whitespace, held until more text follows
        self._lead = True  # at an analysis message's start: its leading whitespace is dropped
        self._answered = False  # some of the answer was released (its leading whitespace is dropped before)
        self.reasoning = ""
        self.content = ""
        self._to = ""  # the current message's recipient (a message left out of both)
        self._call = ""  # that message's body so far
        self.calls: list[tuple[str, str]] = []  # the messages to recipients, ended: (recipient, body)

    @property
    def channel(self) -> Channel:
        return REASONING if self.thinking else CONTENT

    @property
    def thinking(self) -> bool:
        """Inside an analysis message."""
        return self._in_body and self._body == REASONING

    def _release(self, piece: str, final: bool, tag: str = "") -> tuple[str, str]:
        """A piece of the current body: (reasoning, answer); `final`: the message ends after it (at `tag`, where
        a terminator ended it)."""
        if self._body == REASONING:
            text = self._ws + piece
            if self._lead:
                text = text.lstrip()
            out = text.rstrip()
            self._ws = "" if final else text[len(out):]
            if out:
                self._lead = False
            return out, ""
        if self._body == CONTENT:
            if not self._answered:
                piece = piece.lstrip()  # the answer's leading whitespace
                self._answered = bool(piece)
            return "", piece
        self._call += piece
        if final:
            self.calls.append((self._to, self._call))
            self._call = ""
        return "", ""

    def _header(self) -> bool | None:
        """Reads a header at the buffer's start: True when a body begins, None when more text is needed."""
        j = self._buf.find(MESSAGE)
        if j >= 0:
            ok, body, to = _header_channel(self._buf[:j])
            if ok:
                self._buf, self._body, self._to, self._call = self._buf[j + len(MESSAGE):], body, to, ""
                self._in_body, self._ws, self._lead = True, "", True
                return True
        elif _may_be_header(self._buf):
            return None
        # Not harmony (a model that does not write it, or a broken header): the text is the answer, as written.
        self._body, self._in_body = CONTENT, True
        return True

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and answer text that `text` releases (either may be empty)."""
        self._buf += text
        reasoning = content = ""
        while self._buf:
            if not self._in_body:
                if self._header() is None:
                    break
                continue
            ends = [(i, t) for t in TERMINATORS if (i := self._buf.find(t)) >= 0]
            if ends:
                i, tag = min(ends)
                r, c = self._release(self._buf[:i], final=True, tag=tag)
                self._buf, self._in_body = self._buf[i + len(tag):], False
            else:
                keep = _held(self._buf, TERMINATORS)
                r, c = self._release(self._buf[:len(self._buf) - keep], final=False)
                self._buf = self._buf[len(self._buf) - keep:]
            reasoning, content = reasoning + r, content + c
            if not ends:
                break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def close(self) -> str:
        """The message ends here (its <|end|> was a stop string, or was forced): another header follows. Returns
        the reasoning it releases (a tail held back as a terminator's possible start)."""
        out = ""
        if self._in_body:
            out, _ = self._release(self._buf, final=True) if self._body != CONTENT else ("", "")
            self.reasoning += out
            self._buf, self._in_body = "", False
        return out

    def flush(self) -> tuple[str, str]:
        """At the end of the output: what was held back (an analysis never closed keeps its text as reasoning, a
        message to a recipient goes to `calls`: gpt-oss's `<|call|>` ends the generation; a header cut off is
        dropped)."""
        buf, self._buf = self._buf, ""
        if not self._in_body:
            return "", ""
        reasoning, content = self._release(buf, final=True)
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


class AsWritten(HarmonySplitter):
    """reasoning_format none for gpt-oss, as llama.cpp's gpt-oss parser has it (common/parsers/gpt-oss.cpp:79-83,
    test-chat.cpp:6442): nothing taken out as reasoning, all of it content, where an analysis message stays as
    written (its header less the `<|start|>assistant` before it, its body untrimmed, its terminator), and the
    final and commentary messages give their bodies alone, as written; a message to a recipient is left out
    (a call, read apart, as in the split), and text that is not harmony is the content as it is."""

    def __init__(self, fmt: "ReasoningFormat", opened: bool | None = None) -> None:
        super().__init__(fmt, opened)
        self._head = ""  # an analysis message's header, released with its body

    def _header(self) -> bool | None:
        before = self._buf
        began = super()._header()
        if began and self._body == REASONING:
            self._head = re.sub(r"^\s*(?:<\|start\|>assistant)?", "", before[:len(before) - len(self._buf)])
        return began

    def _release(self, piece: str, final: bool, tag: str = "") -> tuple[str, str]:
        if self._body == REASONING:
            out, self._head = self._head + piece + tag, ""
            return "", out
        if self._body == CONTENT:
            return "", piece
        return super()._release(piece, final, tag)


# -- under a grammar: analysis first, then the answer ---------------------------------------------------------------

_MARKER = re.compile(r"(<\|[a-z]+\|>)")


def marker_terminal(model: object) -> Callable[[str], str]:
    """A marker's Lark terminal for a model (backends.llama.LlamaModel, or anything with its tokenize and piece):
    a marker that is one control token (its piece empty unless rendered special, as gpt-oss's `<|channel|>`) is
    that token, by id; any other text, a Lark string (SmolLM2 spells the markers with ordinary tokens)."""
    def terminal(text: str) -> str:
        ids = model.tokenize(text, add_special=False, parse_special=True)  # type: ignore[attr-defined]
        if len(ids) == 1 and not model.piece(ids[0]) and model.piece(ids[0], True):  # type: ignore[attr-defined]
            return f"<[{ids[0]}]>"
        return json.dumps(text)
    return terminal


def lark_text(text: str, marker: Callable[[str], str]) -> str:
    """Harmony text as a Lark sequence: each marker through `marker`, the text between as strings."""
    parts = [marker(p) if _MARKER.fullmatch(p) else json.dumps(p) for p in _MARKER.split(text) if p]
    return " ".join(parts) if parts else '""'


def opening_grammar(grammar: "Grammar", header: str, marker: Callable[[str], str], lead: str = "") -> "Grammar":
    """What gpt-oss may write at a message's start where `grammar` holds the answer after `header` (the final
    channel's, or a call's: harmony_tools.forced_header), as llama.cpp's grammar has it (gpt-oss.cpp:97-135):
    an analysis header, after which anything (backends.reasoning ends the phase at it, a stop string, and thinks
    freely up to `<|end|>`), or the answer's header and the answer. `header` is what follows `<|start|>assistant`;
    `lead`: what of that start is the model's to write (all of it after an analysis it ended itself; none where
    the generation prompt wrote it). The final header may carry a constraint (` <|constrain|>json`), as
    llama.cpp's grammar allows."""
    from backends.grammar import ANSWER, under_opening  # llguidance only where a grammar is in use

    answer = lark_text(header, marker)
    if header.endswith(f"{CHANNEL}final{MESSAGE}"):
        constraint = f'(" " {marker("<|constrain|>")}? CONSTRAINT)?'
        answer = f"{lark_text(header[:-len(MESSAGE)], marker)} {constraint} {marker(MESSAGE)}"
    lark = (f"start: {lark_text(lead, marker) + ' ' if lead else ''}(opener | {answer} @{ANSWER})\n"
            f"opener: {lark_text(ANALYSIS, marker)} ANY\n"
            "CONSTRAINT: /[A-Za-z0-9_-]+/\nANY: /(?s:.*)/\n")
    return under_opening(grammar, "harmony_opening", lark, "an analysis")
