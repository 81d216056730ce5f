"""A chat conversation over one loaded `Engine` (SPEC section 7).

Every turn hands the strategy the whole conversation as its prompt; the
target's `KvSequence` keeps the longest common prefix of what it already holds
and decodes only the rest, so a new turn costs only its new tokens, whichever
strategy ran the turns before (all strategies of an engine share that cache).

Two ways to format a conversation:
- the GGUF's chat template (rendered in a jinja2 sandbox, `app.chat_template`)
  when the model has one; the rendered text is tokenized whole each turn, as
  llama.cpp's server does, and the cache reuses the common prefix;
- plain text completion for a base model without one (the demo model): the
  conversation is one continuing document. The first turn's prompt is exactly
  the user's text (so it equals `specchat run TEXT`); each later message
  starts on a new line after the previous answer. The document is kept as the
  exact tokens the model saw and produced, so nothing is re-decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from app.chat_template import ChatMessage, render_chat
from backends.engine import Engine, StrategyOptions
from backends.events import Done, Event
from backends.sampling import GenParams
from backends.strategies.base import never

CALIBRATION_PROMPT = "The history of the printing press"
CALIBRATION_TOKENS = 24


@dataclass(frozen=True)
class TurnRequest:
    """How to generate one turn: applied per turn, so settings change between turns freely."""

    strategy: str
    params: GenParams
    options: StrategyOptions


class ChatSession:
    def __init__(self, engine: Engine, system_prompt: str = "") -> None:
        self.engine = engine
        self.system_prompt = system_prompt
        self.template = engine.target_info.chat_template
        self.messages: list[ChatMessage] = []
        self._document: list[int] = []  # plain mode: every token so far

    @property
    def plain(self) -> bool:
        return self.template is None

    def reset(self, messages: Sequence[ChatMessage] = ()) -> None:
        """A new chat, or a saved one reopened (its plain document is tokenized afresh)."""
        self.messages = list(messages)
        self._document = self.engine.tokenize(self._plain_text(self.messages)) if self.plain and messages else []

    def _plain_text(self, messages: Sequence[ChatMessage]) -> str:
        text = f"{self.system_prompt}\n" if self.system_prompt else ""
        for m in messages:
            if m.role == "user" and text and not text.endswith("\n"):
                text += "\n"
            text += m.content
        return text

    def prompt_tokens(self, user_text: str) -> list[int]:
        """The whole conversation plus the new message, as the target will see it."""
        if not self.plain:
            system = [ChatMessage("system", self.system_prompt)] if self.system_prompt else []
            info, model = self.engine.target_info, self.engine.target_model
            text = render_chat(
                self.template or "", [*system, *self.messages, ChatMessage("user", user_text)],
                bos_token=model.token_text(info.bos_id) if info.bos_id is not None else "",
                eos_token=model.token_text(info.eos_id) if info.eos_id is not None else "",
            )
            # Templates usually write the BOS text themselves; adding it again would double it.
            bos = model.token_text(info.bos_id) if info.bos_id is not None else None
            add_special = not (bos and text.startswith(bos))
            return model.tokenize(text, add_special=add_special, parse_special=True)
        if not self._document:
            return self.engine.tokenize(self._plain_text([ChatMessage("user", user_text)]))
        last = self.messages[-1].content if self.messages else ""
        separator = "" if last.endswith("\n") else "\n"
        return self._document + self.engine.target_model.tokenize(
            separator + user_text, add_special=False, parse_special=True
        )

    def turn(self, user_text: str, request: TurnRequest, should_stop: Callable[[], bool] = never) -> Iterator[Event]:
        """Generate the answer; the turn joins the conversation unless it failed.

        A cancelled answer is kept as far as it got (as chat apps do). Raises
        PromptError (before any event) when the conversation no longer fits.
        """
        prompt = self.prompt_tokens(user_text)
        strategy = self.engine.strategy(request.strategy, request.options)
        events = strategy.generate(prompt, request.params, should_stop)
        for event in events:
            # Committed before Done is handed on: a consumer may stop iterating at Done.
            if isinstance(event, Done) and event.reason != "error":
                self.messages += [ChatMessage("user", user_text), ChatMessage("assistant", event.text)]
                if self.plain:
                    self._document = prompt + list(event.tokens)
            yield event


def measure_plain_decoding(engine: Engine, n_tokens: int = CALIBRATION_TOKENS) -> float:
    """Tokens/s of plain decoding on this device now: the baseline the speedup is shown against."""
    prompt = engine.tokenize(CALIBRATION_PROMPT)
    done = None
    for event in engine.strategy("ar").generate(prompt, GenParams(max_tokens=n_tokens)):
        if isinstance(event, Done):
            done = event
    assert done is not None
    return done.stats.tokens_per_second
