"""gpt-oss's tool calls (the `harmony` tool format), as llama.cpp's common/parsers/gpt-oss.cpp.

gpt-oss calls a function by writing a message to it: the recipient in the
role's header or after the channel,

    <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

(the channel may be `analysis`, the `<|constrain|>json` may be missing;
gpt-oss.cpp:118-124), and `<|call|>` is an end-of-generation token in its
vocabulary. The tools go to the template, which describes them in its
developer message (`namespace functions`), and earlier calls and tool results
go back through it as it reads them (an assistant's `tool_calls`, `tool`
messages). backends.harmony.HarmonySplitter already leaves such a message out
of the reasoning and the answer, and keeps it in its `calls`: a message to
`functions.NAME`, NAME one of the offered tools, whose body is a JSON value,
is a call {name, arguments}; a message to anything else (a builtin: `python`,
`container.exec`) is dropped, as gpt-oss.cpp:92-93 consumes "unsolicited"
calls. The parse reads the output as written, its markers rendered even where
the vocabulary has them as control tokens (`PRESERVED`, llama.cpp's
`preserved_tokens`, gpt-oss.cpp:48-52): the server re-renders the tokens for
it (`HarmonyToolStream`), so the answer's split is untouched. A call streams
once it is whole: at its message's end, or at the output's end (gpt-oss's
`<|call|>` ends the generation and is not text).

`tool_choice` required or named: llama.cpp's grammar (gpt-oss.cpp:106-135,
not lazy, fed the generation prompt's `<|start|>assistant` first) lets the
model write analysis messages first and then holds it to a call. specchat does
the same (backends.reasoning.Thinking, under any grammar on a harmony model):
at each message's start the model writes an analysis header, and the analysis
is free text up to `<|end|>`, or the call's header (`forced_header`'s text,
in the channel: `<|channel|>commentary to=functions.`) and then what
`grammar` holds: the name among the offered tools, the
`<|constrain|>json<|message|>` and arguments that match the function's schema
(backends.harmony.opening_grammar). After an analysis the model ended, the
next message starts the same way; a reasoning budget spent inside an analysis
forces `<|end|>` and the call's header (llama-server forces `<|end|>` alone),
and counts from an analysis header written with its own tokens, as
llama.cpp's budget does. A call in the role's header (`<|start|>assistant
to=functions.NAME<|channel|>...`), which llama.cpp's grammar also allows, is
parsed but not offered by the grammar.

Beside llama-server (reference build, `--jinja`, SmolLM2 re-packed with
gpt-oss's template, temperature 0; docs/serve.md has the figures): both let
the model think before the answer. SmolLM2 under specchat, on "What is the
weather like in Paris today?", calls at once under named or required; on "What
is 17 times 3? Answer in JSON." under a schema it thinks, ends that analysis,
opens a second that the budget ends, and answers JSON. On that request
llama-server's grammar sampler takes any spelling of the header's bytes, and
SmolLM2's best after
`<|` is `c` (-7.41 against `channel`'s -7.53), so it spells the header letter
by letter, takes the stray `commentary` channel the grammar allows before an
analysis, and thinks to max_tokens: its budget, waiting for the analysis
header's own tokens, never starts. llguidance allows the canonical tokens of
bytes the grammar forces (only `channel` there), hence the other path.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from app.chat_template import ToolCall, new_call_id
from backends.grammar import JSON_LAYOUT, llama_server_schema
from backends.harmony import START, HarmonySplitter
from backends.reasoning import HARMONY
from backends.text import TextStream

# What a call's message starts with; the name and the rest of its header follow (gpt-oss.cpp:114-124).
CALL_HEADER = f"{START}<|channel|>commentary to=functions."
CALL_HEADER_END = " <|constrain|>json<|message|>"


def as_call(recipient: str, body: str, names: Sequence[str]) -> ToolCall | None:
    """A message to `recipient` as a call: None unless it is `functions.NAME` with NAME among `names` and its body
    a JSON value (a call cut short, max_tokens, is none)."""
    name = recipient[len("functions."):] if recipient.startswith("functions.") else None
    if name not in names:
        return None
    try:
        arguments = json.loads(body)
    except json.JSONDecodeError:
        return None
    return ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))  # type: ignore[arg-type]


def new_splitter() -> HarmonySplitter:
    return HarmonySplitter(HARMONY, opened=False)


def parse(text: str, names: Sequence[str]) -> tuple[str, str, list[ToolCall]]:
    """A whole output as written (after the generation prompt's `<|start|>assistant`): (reasoning, content, calls)."""
    s = new_splitter()
    s.push(text)
    s.flush()
    calls = [c for to, body in s.calls if (c := as_call(to, body, names)) is not None]
    return s.reasoning, s.content, calls


class HarmonyToolStream:
    """An answer's token ids in, its calls out as each is whole (the content and reasoning come from the split
    the thinking wrapper made: `push` passes the content through; must_call: there is none)."""

    def __init__(self, piece: Callable[[int], bytes], names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._text = TextStream(piece)
        self._split = new_splitter()
        self._seen = 0  # messages to recipients looked at
        self.sent_calls = 0

    def push(self, text: str) -> tuple[str, list[tuple[int, ToolCall]]]:
        return text, []

    def push_token(self, token: int) -> list[tuple[int, ToolCall]]:
        """The calls that this output token completes, with their indices."""
        self._split.push(self._text.push(token))
        return self._new()

    def finish(self) -> tuple[str, list[tuple[int, ToolCall]]]:
        """At the output's end: the call whose `<|call|>` ended the generation."""
        self._split.push(self._text.flush())
        self._split.flush()
        return "", self._new()

    def _new(self) -> list[tuple[int, ToolCall]]:
        out = []
        for to, body in self._split.calls[self._seen:]:
            call = as_call(to, body, self.names)
            if call is not None:
                out.append((self.sent_calls, call))
                self.sent_calls += 1
        self._seen = len(self._split.calls)
        return out


def calls_of(tokens: Sequence[int], piece: Callable[[int], bytes], names: Sequence[str]) -> list[ToolCall]:
    """A whole answer's calls, from its token ids."""
    stream = HarmonyToolStream(piece, names)
    calls = [c for t in tokens for _, c in stream.push_token(t)]
    return calls + [c for _, c in stream.finish()[1]]


# -- tool_choice required / named --------------------------------------------


def forced_header(names: Sequence[str]) -> str:
    """What the answer starts with under required/named (the thinking wrapper forces it, less what the prompt
    ends with): the call's header, whole for one function, up to its name for several (the grammar picks)."""
    return CALL_HEADER + (f"{names[0]}{CALL_HEADER_END}" if len(names) == 1 else "")


def grammar(tools: Sequence[tuple[str, dict]], marker: Callable[[str], str]) -> tuple[str, object]:
    """(grammar kind, source) for what follows `forced_header`: the arguments' schema for one function; for
    several, a Lark grammar over the name, the header's end and the arguments. `marker(text)` is a marker's Lark
    terminal: its control token (`<[id]>`) where the vocabulary has one, else its text as a string."""
    if len(tools) == 1:
        return "json_schema", dict(tools[0][1])
    rules = [f"start: {' | '.join(f'call{i}' for i in range(len(tools)))}"]
    for i, (name, schema) in enumerate(tools):
        args = json.dumps({**llama_server_schema(schema), "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
        rules.append(f'call{i}: {json.dumps(name)} " " {marker("<|constrain|>")} "json" {marker("<|message|>")} '
                     f'args{i}')
        rules.append(f"args{i}: %json {args}")
    return "lark", "\n".join(rules) + "\n"
