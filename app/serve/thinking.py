"""A chat request's thinking fields, checked, with llama-server's names and meanings (its server-common.cpp).

- `reasoning_format`: "auto" (the default) and "deepseek" split a thinking
  model's output into `reasoning_content` and `content` (backends.reasoning);
  "none" leaves the answer as the model wrote it, tags and all, in `content`
  (the same generation, budget and grammar included: only what the client
  sees differs, app.serve.responses.Reply.raw). llama.cpp's
  "deepseek-legacy" (both at once) is refused.
- `chat_template_kwargs`: more variables for the chat template, e.g.
  `{"enable_thinking": false}` (a boolean, as llama-server insists).
- `reasoning_effort`: "none" turns thinking off; any other value goes to the
  template as its `reasoning_effort` variable (gpt-oss reads it).
- `reasoning_budget_tokens` (or `thinking_budget_tokens`): the thinking ends
  after this many tokens, the end tag forced after `reasoning_budget_message`
  if given; -1, as llama-server reads it, is the server's default (`serve
  --reasoning-budget N`, else no bound). 0 is llama-server's "immediate end"
  (common/arg.cpp, common/reasoning-budget.cpp:85), on every template: the
  block is closed as soon as it is open (QwQ's, which its prompt opens: an
  empty thinking), and thinking is not turned off (Qwen3's prompt stays
  thinking on's: only enable_thinking and reasoning_effort turn it off).

Thinking off on a template that cannot turn it off is a 400 naming the field
that asked (`template_kwargs`); `serve --no-think` on such a model is refused
when the server starts. A model that does not think takes the fields and is
unchanged by them, as llama-server has it. /v1/completions is the model's raw
text: these fields belong to chat, except `reasoning_format: "none"`, which
is what a completion is anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from app.prompt_format import PromptFormat, ThinkingError
from app.serve.fields import bad

if TYPE_CHECKING:
    from app.settings import Settings
    from backends.reasoning import ReasoningFormat

REASONING_FORMATS = ("auto", "deepseek", "none")
BUDGET_FIELDS = ("reasoning_budget_tokens", "thinking_budget_tokens")
CHAT_FIELDS = ("reasoning_format", "chat_template_kwargs", "reasoning_effort", *BUDGET_FIELDS,
               "reasoning_budget_message")
# Variables the server sets itself (app.chat_template.render_chat): a request may not.
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")


@dataclass(frozen=True)
class ThinkingRequest:
    """What a chat request asks of a thinking model.

    `split`: the reasoning goes to `reasoning_content` (not reasoning_format "none"); `thinking`: the template's
    enable_thinking; `kwargs`: the template's other variables (`template_kwargs` adds enable_thinking);
    `asked_off`: the field that turned thinking off (None: the server's default); `budget` / `message`:
    GenParams.reasoning_budget / reasoning_message.
    """

    split: bool = True
    thinking: bool = True
    kwargs: Mapping[str, object] = field(default_factory=dict)
    asked_off: str | None = None
    budget: int | None = None
    message: str = ""


def thinking_request(body: Mapping[str, Any], chat: bool, defaults: "Settings") -> ThinkingRequest:
    """The request's thinking fields over the server's defaults (`serve --no-think`, `--reasoning-budget`)."""
    if not chat:
        for name in CHAT_FIELDS:
            if body.get(name) is not None and not (name == "reasoning_format" and body[name] == "none"):
                raise bad(f"'{name}' belongs to /v1/chat/completions; a completion is the model's raw text", name)
        return ThinkingRequest(split=False)
    fmt = body.get("reasoning_format")
    if fmt == "deepseek-legacy":
        raise bad("'reasoning_format' 'deepseek-legacy' is not supported: send 'auto' (the reasoning in "
                  "reasoning_content) or 'none' (in content, tags and all)", "reasoning_format", "unsupported_parameter")
    if fmt is not None and fmt not in REASONING_FORMATS:
        raise bad(f"'reasoning_format' must be one of {', '.join(repr(f) for f in REASONING_FORMATS)}",
                  "reasoning_format")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object (the template's variables)", "chat_template_kwargs")
    kwargs = dict(kwargs)
    for name in RESERVED:
        if name in kwargs:
            raise bad(f"'chat_template_kwargs.{name}' is the server's to set", f"chat_template_kwargs.{name}")
    thinking, asked_off = defaults.thinking, None
    if "enable_thinking" in kwargs:
        thinking = kwargs.pop("enable_thinking")
        if not isinstance(thinking, bool):
            raise bad("'chat_template_kwargs.enable_thinking' must be true or false",
                      "chat_template_kwargs.enable_thinking")
        asked_off = "chat_template_kwargs.enable_thinking"
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or not effort:
            raise bad("'reasoning_effort' must be a string ('none' turns thinking off)", "reasoning_effort")
        if effort == "none":
            if asked_off is not None and thinking:
                raise bad("'reasoning_effort' 'none' and 'chat_template_kwargs.enable_thinking' true disagree",
                          "reasoning_effort")
            thinking, asked_off = False, "reasoning_effort"
            kwargs.pop("reasoning_effort", None)
        else:
            kwargs["reasoning_effort"] = effort
    return ThinkingRequest(fmt != "none", thinking, kwargs, asked_off, *_budget(body, defaults))


def _budget(body: Mapping[str, Any], defaults: "Settings") -> tuple[int | None, str]:
    given = {name: body[name] for name in BUDGET_FIELDS if body.get(name) is not None}
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise bad(f"'{name}' must be an integer >= 0 (tokens; -1: the server's default)", name)
    if len(set(given.values())) > 1:
        raise bad(f"{' and '.join(repr(g) for g in given)} disagree; send one of them", BUDGET_FIELDS[1])
    message = body.get("reasoning_budget_message")
    if message is not None and not isinstance(message, str):
        raise bad("'reasoning_budget_message' must be a string", "reasoning_budget_message")
    value = next(iter(given.values()), -1)
    return (defaults.params.reasoning_budget if value == -1 else value), message or ""


def template_kwargs(request: ThinkingRequest, prompt_format: PromptFormat) -> dict[str, object]:
    """The template's variables (enable_thinking included); thinking off where the model's template cannot turn
    it off is a 400 naming the field that asked."""
    try:
        return prompt_format.thinking_kwargs(request.thinking, request.kwargs)
    except ThinkingError as e:
        raise bad(f"{e} ('reasoning_budget_tokens')", request.asked_off) from None


def reasoning_info(fmt: "ReasoningFormat | None") -> dict[str, object] | None:
    """How the model thinks, for /v1/models and /props: its tags, whether its prompt opens the block (the
    output starts inside it), whether its template can turn thinking off; None for a model that does not think."""
    if fmt is None:
        return None
    return {"start": fmt.start, "end": fmt.end, "opened": fmt.opened, "can_disable": fmt.can_disable}
