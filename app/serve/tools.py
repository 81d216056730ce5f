"""Tool calls: OpenAI's `tools` and `tool_choice` over a model's chat template, as llama.cpp's common/chat.cpp.

Four formats, by what the model's chat template knows (`tool_format`):
- `harmony` (gpt-oss; the template writes `<|channel|>`): the tools go to
  the template, and a call is a message to `functions.NAME`, read from the
  output's harmony messages (app.serve.harmony_tools, as llama.cpp's
  common/parsers/gpt-oss.cpp);
- `hermes` (Qwen 2.5 and 3, Hermes; the template writes `<tool_call>`): the
  tools go to the template, and the model writes each call as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `llama3` (Llama 3.1 and 3.2; the template knows `<|python_tag|>`): the
  tools go to the template, and the model answers a call with one JSON
  object `{"name": ..., "parameters": {...}}`;
- `generic` (any other template, SmolLM2's and Gemma 3's included, and
  plain text models): as llama.cpp's generic format, the tools are described
  in the system message and the answer is held by a JSON grammar to either
  `{"tool_call": {"name", "arguments"}}` or `{"response": "..."}`; earlier
  calls and tool results go back as the same JSON, in the assistant's and the
  user's turns.

`tool_choice` "required" or a named function is enforced by a grammar in
every format (backends.grammar), so a call always parses and its arguments
always match the function's JSON schema; "auto" constrains only the generic
format (whose JSON shape is how the model says which it chose); "none" sends
no tools at all. `ToolStream` turns the text as it is generated into content
deltas and whole calls: content streams as it comes, a call goes out when it
is complete.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from app.chat_template import ChatMessage, ToolCall, new_call_id
from backends.grammar import JSON_LAYOUT
from app.serve.harmony_tools import grammar as harmony_grammar
from backends.harmony import is_harmony

ToolFormat = Literal["hermes", "llama3", "generic", "harmony"]

GENERIC_SYSTEM = (
    "You can call these tools:\n{tools}\n\n"
    "Answer in JSON: either {{\"tool_call\": {{\"name\": <a tool's name>, \"arguments\": <its arguments>}}}} to "
    "call a tool, or {{\"response\": <your answer>}} to answer the user."
)
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class ToolError(ValueError):
    """A tools request that cannot be honoured (the client's mistake, a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]

    def openai(self) -> dict[str, object]:
        """OpenAI's function definition, as chat templates expect it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's `tool_choice`: "none", "auto", "required", or one function by name (`mode` "named").

    A mode and a name apart, so that a tool may be called "auto" or "required" (a bare string could not tell
    the keyword from the name). What the model is offered and whether it must call are decided here only."""

    mode: Literal["none", "auto", "required", "named"] = "none"
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named tool choice, and only it, has a name")

    def offered(self, tools: Sequence[Tool]) -> list[Tool]:
        """The tools the model may call: none, the named one, or all."""
        if self.mode == "none":
            return []
        return [t for t in tools if t.name == self.name] if self.mode == "named" else list(tools)

    @property
    def must_call(self) -> bool:
        return self.mode in ("required", "named")


def parse_tools(body: Mapping[str, Any]) -> tuple[Tool, ...]:
    """OpenAI's `tools` (functions only); llama-server's and OpenAI's old `functions` are refused by the caller."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'",
                            f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                            f"tools[{i}].function.parameters")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"tools[{i}].function.description must be a string", f"tools[{i}].function.description")
        if any(o.name == name for o in out):
            raise ToolError(f"two tools are named {name!r}", f"tools[{i}].function.name")
        out.append(Tool(name, description, params))
    return tuple(out)


def parse_tool_choice(body: Mapping[str, Any], tools: Sequence[Tool]) -> ToolChoice:
    choice = body.get("tool_choice")
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                            "'function': {'name': ...}}", "tool_choice")
        if choice == "required" and not tools:
            raise ToolError("'tool_choice' is 'required' but no tools were given", "tool_choice")
        return ToolChoice(choice)  # type: ignore[arg-type]
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":
        raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
                        "'function': {'name': ...}}", "tool_choice")
    if not any(t.name == name for t in tools):
        raise ToolError(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
    return ToolChoice("named", name)


def tool_format(template: str | None) -> ToolFormat:
    """Which way this chat template lets a model call tools."""
    if template and is_harmony(template):
        return "harmony"
    if template and _HERMES_OPEN in template:
        return "hermes"
    if template and _PYTHON_TAG in template:
        return "llama3"
    return "generic"


# -- the prompt ---------------------------------------------------------------


def _generic_call(call: ToolCall) -> str:
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError:
        arguments = call.arguments
    return json.dumps({"tool_call": {"name": call.name, "arguments": arguments}}, ensure_ascii=False)


def prompt_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool], choice: ToolChoice,
                    fmt: ToolFormat) -> tuple[list[ChatMessage], list[dict] | None]:
    """The conversation and the tools the template gets. The native formats hand the tools to the template
    and its messages as they are; the generic one describes the tools in the system message and writes
    calls and results as the JSON it asks for (a template without a tool role reads them as turns)."""
    offered = choice.offered(tools)
    if fmt != "generic":
        return list(messages), [t.openai() for t in offered] or None
    out: list[ChatMessage] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            out.append(ChatMessage("assistant", "\n".join(_generic_call(c) for c in m.tool_calls),
                                   reasoning=m.reasoning))
        elif m.role == "tool":
            out.append(ChatMessage("user", json.dumps({"tool_response": {"name": m.name, "id": m.tool_call_id,
                                                                         "content": m.content}},
                                                      ensure_ascii=False)))
        else:
            out.append(m)
    if offered:
        described = json.dumps([t.openai()["function"] for t in offered], ensure_ascii=False, indent=2)
        system = GENERIC_SYSTEM.format(tools=described)
        if out and out[0].role == "system":
            out[0] = ChatMessage("system", f"{out[0].content}\n\n{system}")
        else:
            out.insert(0, ChatMessage("system", system))
    return out, None


# -- the grammar --------------------------------------------------------------


def _call_schema(tool: Tool, args_key: str = "arguments") -> dict[str, object]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: dict(tool.parameters)},
            "required": ["name", args_key], "additionalProperties": False}


def _any(schemas: list[dict[str, object]]) -> dict[str, object]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def grammar_for(tools: Sequence[Tool], choice: ToolChoice, fmt: ToolFormat, parallel: bool = False,
                marker: Callable[[str], str] = json.dumps) -> tuple[str, object] | None:
    """(grammar kind, source) the answer must follow, or None for free text. `parallel` (OpenAI's
    parallel_tool_calls, asked for explicitly): a Hermes answer may hold several calls. `marker`: a harmony
    marker's Lark terminal (backends.harmony.marker_terminal)."""
    callable_ = choice.offered(tools)
    if not callable_:
        return None
    must = choice.must_call
    if fmt == "harmony":  # what follows the call's header, which is forced (harmony_tools.forced_header)
        return harmony_grammar([(t.name, dict(t.parameters)) for t in callable_], marker) if must else None
    if fmt == "generic":
        call = {"type": "object", "properties": {"tool_call": _any([_call_schema(t) for t in callable_])},
                "required": ["tool_call"], "additionalProperties": False}
        if must:
            return "json_schema", call
        response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
        return "json_schema", {"anyOf": [call, response]}
    if not must:
        return None  # the model chooses in its own words; its calls are found in the text
    if fmt == "llama3":
        return "json_schema", _any([_call_schema(t, "parameters") for t in callable_])
    # Inside Lark, the JSON layout rides on the schema itself (llguidance's "x-guidance" options).
    schema = json.dumps({**_any([_call_schema(t) for t in callable_]), "x-guidance": JSON_LAYOUT}, ensure_ascii=False)
    # One call (or, asked for, several: Qwen's and Hermes' templates allow parallel calls), nothing else.
    return "lark", (f'start: call{"+" if parallel else ""}\ncall: "{_HERMES_OPEN}\\n" body "\\n</tool_call>" "\\n"?\n'
                    f'body: %json {schema}\n')


# -- the answer -----------------------------------------------------------------


def _as_call(obj: object, args_key: str, names: Sequence[str], bare: bool = False) -> ToolCall | None:
    """`obj` as a call: None unless it names one of the offered functions (`names`), as OpenAI never answers
    with a call to another; `bare` (a JSON object with no tag around it, Llama 3.x's), only with its arguments
    key too, as llama.cpp's parser reads one: an answer in JSON with a "name" of its own is content."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    if bare and args_key not in obj and "arguments" not in obj:
        return None
    arguments = obj.get(args_key, obj.get("arguments", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(new_call_id(), obj["name"], text)


def parse_answer(text: str, fmt: ToolFormat, names: Sequence[str]) -> tuple[str, list[ToolCall]]:
    """The content and the calls (to the offered functions, `names`) of a whole answer."""
    if fmt == "hermes":
        calls = []
        for body in _HERMES_CALL.findall(text):
            try:
                call = _as_call(json.loads(body), "arguments", names)
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        content = _HERMES_CALL.sub("", text).strip() if calls else text
        if calls and _HERMES_OPEN in content:  # a call cut short by max_tokens is no content
            content = content[:content.index(_HERMES_OPEN)].strip()
        return content, calls
    stripped = text.strip()
    if fmt == "llama3":
        body = stripped[len(_PYTHON_TAG):] if stripped.startswith(_PYTHON_TAG) else stripped
        try:
            call = _as_call(json.loads(body), "parameters", names, bare=True)
        except json.JSONDecodeError:
            call = None
        return ("", [call]) if call is not None else (text, [])
    try:
        obj = json.loads(stripped)
    except json.JSONDecodeError:  # cut short (max_tokens, a stop string): a response as far as it came, as streamed
        if stripped.startswith(ToolStream.GENERIC_RESPONSE):
            return _json_string_prefix(stripped[len(ToolStream.GENERIC_RESPONSE):])[0], []
        return text, []
    if isinstance(obj, dict) and "tool_call" in obj:
        call = _as_call(obj["tool_call"], "arguments", names)
        return ("", [call]) if call is not None else (text, [])
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], []
    return text, []


def _json_string_prefix(s: str) -> tuple[str, bool, int]:
    """The decoded text of a JSON string's body as far as it is written (`s` starts after its opening quote),
    whether the closing quote came, and how many characters of `s` were decoded (an escape still incomplete
    waits for its next characters: decoding goes on from there)."""
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c == '"':
            return "".join(out), True, i
        if c == "\\":
            if i + 1 >= len(s):
                break
            if s[i + 1] == "u":
                if i + 6 > len(s):
                    break
                n = 6
                if s[i + 2:i + 4].lower() in ("d8", "d9", "da", "db"):  # a high surrogate: its pair follows
                    if i + 12 > len(s):
                        break
                    if s[i + 6:i + 8] == "\\u":
                        n = 12
                try:
                    out.append(json.loads(f'"{s[i:i + n]}"'))
                except json.JSONDecodeError:
                    out.append(s[i:i + n])
                i += n
                continue
            out.append(json.loads(f'"{s[i:i + 2]}"') if s[i + 1] in '"\\/bfnrt' else s[i + 1])
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out), False, i


class ToolStream:
    """Generated text in, deltas out: content as soon as it is surely content, each call once it is whole."""

    GENERIC_RESPONSE = '{"response": "'

    def __init__(self, fmt: ToolFormat, must_call: bool, names: Sequence[str]) -> None:
        self.fmt = fmt
        self.must_call = must_call
        self.names = names  # the offered functions: a call to another is none
        self.text = ""
        self.sent_content = ""  # content already streamed
        self.sent_calls = 0
        # The generic format's response string, decoded as it comes (each character once, not the whole
        # text again per token): what is decoded, how much of the string's body that was, and whether it closed.
        self._decoded, self._consumed, self._closed = "", 0, False
        self._closes = 0  # Hermes: "</tool_call>" tags seen (new calls can only end at one)

    def push(self, piece: str) -> tuple[str, list[tuple[int, ToolCall]]]:
        """The content delta and the newly complete calls after `piece`, each with its index in the answer."""
        self.text += piece
        if self.must_call:
            return "", self._new_calls()
        if self.fmt == "generic":
            if self.text.startswith(self.GENERIC_RESPONSE):
                if not self._closed:
                    body = self.text[len(self.GENERIC_RESPONSE) + self._consumed:]
                    more, self._closed, used = _json_string_prefix(body)
                    self._decoded += more
                    self._consumed += used
                return self._content_delta(self._decoded), []
            return "", []
        if self.fmt == "llama3":
            head = self.text.lstrip()
            if not head or head.startswith("{") or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)]):
                return "", []  # maybe a call: held until the end
            return self._content_delta(self.text), []
        # hermes: content until a call opens (holding back what may be the start of "<tool_call>")
        opened = self.text.find(_HERMES_OPEN)
        if opened < 0:
            safe = self.text
            for k in range(min(len(_HERMES_OPEN) - 1, len(safe)), 0, -1):
                if _HERMES_OPEN.startswith(safe[-k:]):
                    safe = safe[:-k]
                    break
            return self._content_delta(safe), []
        return self._content_delta(self.text[:opened].rstrip()), self._new_calls()

    def finish(self) -> tuple[str, list[tuple[int, ToolCall]]]:
        """What is left once the answer is whole: the rest of the content and the calls not sent yet."""
        content, calls = parse_answer(self.text, self.fmt, self.names)
        return self._content_delta(content) if not calls or content else "", self._unsent(calls)

    def _content_delta(self, content: str) -> str:
        if not content.startswith(self.sent_content):
            return ""
        delta = content[len(self.sent_content):]
        self.sent_content = content
        return delta

    def _new_calls(self) -> list[tuple[int, ToolCall]]:
        if self.fmt != "hermes":
            return []  # one JSON object: whole only at the end
        closes = self.text.count(_HERMES_CLOSE)
        if closes == self._closes:  # no call ended since the last look
            return []
        self._closes = closes
        return self._unsent(parse_answer(self.text, "hermes", self.names)[1])

    def _unsent(self, calls: list[ToolCall]) -> list[tuple[int, ToolCall]]:
        """The calls past those sent, with their indices; they count as sent from now on."""
        new = list(enumerate(calls))[self.sent_calls:]
        self.sent_calls = len(calls)
        return new
