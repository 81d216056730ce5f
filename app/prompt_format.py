"""A conversation as the target model sees it: one place for `run`, `bench`, the chat app and the server.

Two ways to format, chosen by the model file:
- the GGUF's chat template (rendered in a jinja2 sandbox, `app.chat_template`)
  when the model has one: the conversation ends with the assistant's turn
  opened, and the model ends its answer with its end-of-turn token;
- plain text completion for a base model without one (the Gemma demo): the
  conversation is one continuing document. A first user message is exactly the
  user's text (so it equals `specchat run TEXT`); each later message starts on
  a new line after the previous answer; a system prompt is the first line.
The text is tokenized whole, as llama.cpp's server does: the model sees the
canonical tokens of what the transcript shows, and a KV cache still reuses
everything up to the first token that differs.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Mapping, Sequence

from app.chat_template import ChatMessage, ChatTemplateError, render_chat
from backends.reasoning import ReasoningFormat, detect_format

if TYPE_CHECKING:
    from backends.engine import Engine


class PromptFormat:
    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self.template = engine.target_info.chat_template

    @property
    def plain(self) -> bool:
        """No chat template: the conversation is plain text."""
        return self.template is None

    def raw(self, text: str) -> list[int]:
        """`text` tokenized as it is (BOS added as the model asks), no template."""
        return self.engine.tokenize(text)

    @cached_property
    def reasoning(self) -> ReasoningFormat | None:
        """The model's thinking format (backends.reasoning), from its template; None for a model that does not
        think (or has no template)."""
        if self.plain:
            return None
        try:
            return detect_format(self.template or "", lambda kw: self.render([ChatMessage("user", "Hi")], kwargs=kw))
        except ChatTemplateError:
            return None

    @property
    def takes_effort(self) -> bool:
        """Whether the template reads `reasoning_effort` (gpt-oss's does)."""
        return "reasoning_effort" in (self.template or "")

    def thinking_kwargs(self, thinking: bool, kwargs: Mapping[str, object] | None = None,
                        effort: str | None = None) -> dict[str, object]:
        """The template's variables for a request that asks for thinking on or off, and for an effort (llama-server's
        `chat_template_kwargs` win); off on a template that cannot turn it off, or an effort for one that reads
        none, is a ThinkingError."""
        out: dict[str, object] = {"enable_thinking": thinking}
        if effort is not None:
            if not self.takes_effort:
                raise ThinkingError(f"{self.engine.config.target.name}: its chat template takes no reasoning_effort "
                                    f"(gpt-oss's does); bound the thinking with a reasoning budget instead")
            out["reasoning_effort"] = effort
        out.update(kwargs or {})
        fmt = self.reasoning
        if fmt is not None and out.get("enable_thinking") is False and not fmt.can_disable:
            # gpt-oss's thinks less at reasoning_effort "low" (its template's variable: low, medium, high)
            effort = "; it takes reasoning_effort" if "reasoning_effort" in (self.template or "") else ""
            raise ThinkingError(f"{self.engine.config.target.name}: its chat template cannot turn thinking off "
                                f"(it takes no enable_thinking{effort}); bound it with a reasoning budget instead")
        return out

    def reasoning_for(self, messages: Sequence[ChatMessage], system_prompt: str = "",
                      tools: Sequence[dict] | None = None, kwargs: Mapping[str, object] | None = None,
                      rendered: str | None = None) -> ReasoningFormat | None:
        """The thinking format for this conversation's answer: whether its generation prompt leaves the block open
        (a template that opens it, as QwQ's does). Only the generation prompt says so, as llama.cpp reads it: a
        message that writes a tag ("What does `<think>` do?") opens nothing. None for a model that does not think.
        `rendered`: the conversation's `render` already made, so that it is not rendered again."""
        fmt = self.reasoning
        if fmt is None:
            return None
        text = self.generation_prompt(messages, system_prompt, tools, kwargs, rendered)
        return replace(fmt, opened=text.rfind(fmt.start) > text.rfind(fmt.end))

    def generation_prompt(self, messages: Sequence[ChatMessage], system_prompt: str = "",
                          tools: Sequence[dict] | None = None, kwargs: Mapping[str, object] | None = None,
                          rendered: str | None = None) -> str:
        """What the assistant's opened turn adds to the conversation's text: its rendering with the turn less its
        rendering without it (add_generation_prompt false), from where they differ, as llama.cpp computes it
        (common/chat.cpp, common_chat_template_generation_prompt). "" without a template. `rendered`: the
        rendering with the turn (`render`), when the caller has it already."""
        if self.plain:
            return ""
        with_turn = self.render(messages, system_prompt, tools, kwargs) if rendered is None else rendered
        # The template with its variable set false at its top (the newline after the tag is trim_blocks', so the
        # template's own text is untouched): render_chat always opens the turn.
        try:
            without = self._render(f"{{% set add_generation_prompt = false %}}\n{self.template}", messages,
                                   system_prompt, tools, kwargs)
        except ChatTemplateError:  # a template that will not end on a user's turn: its whole text, as before
            return with_turn
        if with_turn.startswith(without):  # the usual case: the turn is appended
            return with_turn[len(without):]
        n = 0
        while n < min(len(with_turn), len(without)) and with_turn[n] == without[n]:
            n += 1
        return with_turn[n:]

    def render(self, messages: Sequence[ChatMessage], system_prompt: str = "",
               tools: Sequence[dict] | None = None, kwargs: Mapping[str, object] | None = None) -> str:
        """The text the model reads (for a template: with the assistant's turn opened)."""
        if self.plain:
            text = f"{system_prompt}\n" if system_prompt else ""
            for m in messages:
                if m.role == "user" and text and not text.endswith("\n"):
                    text += "\n"
                text += m.content
            return text
        return self._render(self.template or "", messages, system_prompt, tools, kwargs)

    def _render(self, template: str, messages: Sequence[ChatMessage], system_prompt: str,
                tools: Sequence[dict] | None, kwargs: Mapping[str, object] | None) -> str:
        system = [ChatMessage("system", system_prompt)] if system_prompt else []
        info, model = self.engine.target_info, self.engine.target_model
        bos = model.token_text(info.bos_id) if info.bos_id is not None else ""
        eos = model.token_text(info.eos_id) if info.eos_id is not None else ""
        try:
            return render_chat(template, [*system, *messages], bos_token=bos, eos_token=eos, tools=tools,
                               kwargs=dict(kwargs or {}))
        except ChatTemplateError as e:  # which model's template: the file it came from
            raise ChatTemplateError(f"{self.engine.config.target.name}: {e}") from None

    def tokens(self, messages: Sequence[ChatMessage], system_prompt: str = "",
               tools: Sequence[dict] | None = None, kwargs: Mapping[str, object] | None = None) -> list[int]:
        """The conversation's tokens; `tools` go to a template that uses them (app.serve.tools decides), `kwargs`
        are the template's variables (`thinking_kwargs`)."""
        return self.encode(self.render(messages, system_prompt, tools, kwargs))

    def encode(self, text: str) -> list[int]:
        """The tokens of a conversation's `render`."""
        if self.plain:
            return self.engine.tokenize(text)
        model, info = self.engine.target_model, self.engine.target_info
        bos = model.token_text(info.bos_id) if info.bos_id is not None else ""
        # Templates usually write the BOS text themselves; adding it again would double it.
        add_special = not (bos and text.startswith(bos))
        return model.tokenize(text, add_special=add_special, parse_special=True)

    def prompt(self, text: str, system_prompt: str = "", raw: bool = False,
               kwargs: Mapping[str, object] | None = None) -> list[int]:
        """A one-shot prompt (`run`, `bench`): one user message through the template, or `text` as it is."""
        if raw or (self.plain and not system_prompt):
            return self.raw(text)
        return self.tokens([ChatMessage("user", text)], system_prompt, kwargs=kwargs)


class ThinkingError(ChatTemplateError):
    """Thinking asked off where the model's template cannot turn it off, or an effort where it reads none."""
