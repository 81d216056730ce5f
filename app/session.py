"""A chat conversation over one loaded `Engine` (SPEC section 7).

Every turn hands the strategy the whole conversation as its prompt; the
target's `KvSequence` keeps the longest common prefix of what it already holds
and decodes only the rest, so a new turn costs only its new tokens, whichever
strategy ran the turns before (all strategies of an engine share that cache).

The conversation is formatted by `app.prompt_format.PromptFormat`: the GGUF's
chat template when the model has one, one continuing plain-text document for a
base model (the demo), tokenized whole each turn so the model sees the
canonical tokens of what the transcript shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from app.chat_template import ChatMessage
from app.prompt_format import PromptFormat
from backends.config import StrategyOptions
from backends.engine import Engine
from backends.events import Done, Event, until_done
from backends.sampling import GenParams
from backends.strategies.base import never

# Context kept free for an answer when old turns must leave the prompt.
ANSWER_ROOM = 256
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
        self.format = PromptFormat(engine)
        self.messages: list[ChatMessage] = []
        self.dropped = 0  # messages of the last prompt left out because the context is full

    @property
    def plain(self) -> bool:
        return self.format.plain

    def reset(self, messages: Sequence[ChatMessage] = ()) -> None:
        """A new chat, or a saved one reopened."""
        self.messages = list(messages)

    def prompt_tokens(self, user_text: str, reserve: int = 0) -> list[int]:
        """The conversation plus the new message, as the target will see it.

        When it does not fit the context with `reserve` tokens left for the
        answer, the oldest turns are left out of the prompt (they stay in the
        transcript), as chat apps do; `dropped` says how many messages.
        """
        n_ctx = min(seq.n_ctx for seq in (self.engine.target, self.engine.draft) if seq is not None)
        history = self.messages
        while True:
            tokens = self._tokens([*history, ChatMessage("user", user_text)])
            if len(tokens) + reserve <= n_ctx or not history:
                self.dropped = len(self.messages) - len(history)
                return tokens
            history = history[2:]  # one user message and its answer

    def _tokens(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self.format.tokens(messages, self.system_prompt)

    def turn(self, user_text: str, request: TurnRequest, should_stop: Callable[[], bool] = never) -> Iterator[Event]:
        """Generate the answer; the turn joins the conversation unless it failed.

        A cancelled answer is kept as far as it got (as chat apps do). Raises
        PromptError (before any event) when the conversation no longer fits.
        """
        prompt = self.prompt_tokens(user_text, reserve=min(request.params.max_tokens, ANSWER_ROOM))
        strategy = self.engine.strategy(request.strategy, request.options)
        events = strategy.generate(prompt, request.params, should_stop)
        for event in events:
            # Committed before Done is handed on: a consumer may stop iterating at Done.
            if isinstance(event, Done) and event.reason != "error":
                self.messages += [ChatMessage("user", user_text), ChatMessage("assistant", event.text)]
            yield event


def measure_plain_decoding(engine: Engine, n_tokens: int = CALIBRATION_TOKENS) -> float:
    """Tokens/s of plain decoding on this device now: the baseline the speedup is shown against."""
    prompt = engine.tokenize(CALIBRATION_PROMPT)
    return until_done(engine.strategy("ar").generate(prompt, GenParams(max_tokens=n_tokens))).stats.tokens_per_second
