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

from typing import TYPE_CHECKING, Sequence

from app.chat_template import ChatMessage, ChatTemplateError, render_chat

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

    def render(self, messages: Sequence[ChatMessage], system_prompt: str = "",
               tools: Sequence[dict] | None = None) -> str:
        """The text the model reads (for a template: with the assistant's turn opened)."""
        if self.plain:
            text = f"{system_prompt}\n" if system_prompt else ""
            for m in messages:
                if m.role == "user" and text and not text.endswith("\n"):
                    text += "\n"
                text += m.content
            return text
        system = [ChatMessage("system", system_prompt)] if system_prompt else []
        info, model = self.engine.target_info, self.engine.target_model
        bos = model.token_text(info.bos_id) if info.bos_id is not None else ""
        eos = model.token_text(info.eos_id) if info.eos_id is not None else ""
        try:
            return render_chat(self.template or "", [*system, *messages], bos_token=bos, eos_token=eos, tools=tools)
        except ChatTemplateError as e:  # which model's template: the file it came from
            raise ChatTemplateError(f"{self.engine.config.target.name}: {e}") from None

    def tokens(self, messages: Sequence[ChatMessage], system_prompt: str = "",
               tools: Sequence[dict] | None = None) -> list[int]:
        """The conversation's tokens; `tools` go to a template that uses them (app.serve.tools decides)."""
        text = self.render(messages, system_prompt, tools)
        if self.plain:
            return self.engine.tokenize(text)
        model, info = self.engine.target_model, self.engine.target_info
        bos = model.token_text(info.bos_id) if info.bos_id is not None else ""
        # Templates usually write the BOS text themselves; adding it again would double it.
        add_special = not (bos and text.startswith(bos))
        return model.tokenize(text, add_special=add_special, parse_special=True)

    def prompt(self, text: str, system_prompt: str = "", raw: bool = False) -> list[int]:
        """A one-shot prompt (`run`, `bench`): one user message through the template, or `text` as it is."""
        if raw or (self.plain and not system_prompt):
            return self.raw(text)
        return self.tokens([ChatMessage("user", text)], system_prompt)
