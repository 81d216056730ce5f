"""Chat formatting with a GGUF's `tokenizer.chat_template`, rendered in jinja2's sandbox.

Templates come from model files downloaded from the internet, so they run in
`ImmutableSandboxedEnvironment` (no attribute tricks, no mutation of the
arguments). The environment mirrors Hugging Face transformers'
`apply_chat_template` (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `strftime_now`, a non-ASCII-escaping `tojson`), because the
templates shipped in GGUFs are written for it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Literal, NoReturn, Sequence

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from backends.harmony import is_harmony, template_messages

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant message made: OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`
    (arguments as the JSON text the model wrote)."""

    id: str
    name: str
    arguments: str


def new_call_id() -> str:
    """A new call's id, as OpenAI spells them."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the function's name
    reasoning: str = ""  # an assistant's thinking (templates read it as `reasoning_content`; gpt-oss's, `thinking`)


def _arguments(text: str) -> object:
    """Templates write a call's arguments with `tojson`: as an object, not the string that holds it."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def message_dict(m: ChatMessage) -> dict[str, object]:
    """A message as Hugging Face's apply_chat_template passes it to a template."""
    out: dict[str, object] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    return out


def is_ministral3(template: str) -> bool:
    """Ministral 3 / Mistral Large 3 (Ministral-3-...-Reasoning), as llama.cpp's common/chat.cpp detects it."""
    return all(tag in template for tag in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]")) and "[CALL_ID]" not in template


def ministral3_messages(messages: list[dict[str, object]]) -> list[dict[str, object]]:
    """System and assistant messages as Ministral 3's template reads them (common_chat_params_init_ministral_3):
    the content a list of blocks, the reasoning a `thinking` block before the `text` one. It never reads
    `reasoning_content`, and it refuses an assistant's empty string (a turn cut short while thinking)."""
    out = []
    for m in messages:
        if m["role"] not in ("system", "assistant"):
            out.append(m)
            continue
        blocks: list[object] = []
        if isinstance(m.get("reasoning_content"), str):
            blocks.append({"type": "thinking", "thinking": m["reasoning_content"]})
        content = m.get("content")
        if isinstance(content, str):
            blocks.append({"type": "text", "text": content})
        elif isinstance(content, list):
            blocks += content
        out.append({**{k: v for k, v in m.items() if k != "reasoning_content"}, "content": blocks})
    return out


class ChatTemplateError(ValueError):
    """The model's chat template cannot render this conversation."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"the model's chat template refused the conversation: {message}")


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


# The most characters or items one `*` in a template may make: a template is code from a downloaded file, and
# `"a" * 10**10` would take the process's memory (jinja2's sandbox bounds range() only).
MAX_PRODUCT = 1_000_000


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with `*` and `**` bounded too."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator: str, left, right):  # type: ignore[no-untyped-def]
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_PRODUCT:
                    raise SecurityError(f"a repetition of {len(seq) * n:,} items is over the sandbox's "
                                        f"{MAX_PRODUCT:,}")
        if operator == "**" and isinstance(right, int) and abs(right) > 1000:
            raise SecurityError("an exponent over 1000 is over the sandbox's limit")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=8)
def _compile(source: str):
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from None


def render_chat(template: str, messages: Sequence[ChatMessage], bos_token: str, eos_token: str,
                tools: Sequence[dict] | None = None, kwargs: dict | None = None) -> str:
    """The conversation as the model expects it, ending with the assistant's turn opened. `tools` (OpenAI's
    function definitions) go to a template that uses them, as apply_chat_template passes them; `kwargs` are
    more variables for the template (llama-server's `chat_template_kwargs`). `enable_thinking` is true unless
    they say otherwise, as llama.cpp's common/chat.cpp passes it: templates edited for llama.cpp (its QwQ and
    DeepSeek-R1) close the thinking block where it is not."""
    extra: dict[str, object] = {"enable_thinking": True, **(kwargs or {})}
    if tools:
        extra["tools"] = list(tools)
    for reserved in ("messages", "add_generation_prompt", "bos_token", "eos_token"):
        extra.pop(reserved, None)
    dicts = [message_dict(m) for m in messages]
    if is_harmony(template):  # gpt-oss's template reads an assistant's reasoning as `thinking`
        dicts = template_messages(dicts)
    elif is_ministral3(template):
        dicts = ministral3_messages(dicts)
    try:
        return _compile(template).render(
            messages=dicts,
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed: {e}") from None
    except (OverflowError, RecursionError, MemoryError) as e:  # the sandbox's own limits (range, recursion)
        what = "recursion too deep" if isinstance(e, RecursionError) else str(e) or type(e).__name__
        raise ChatTemplateError(f"the model's chat template hit a limit of its sandbox: {what}") from None
