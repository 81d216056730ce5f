"""A chat conversation over one loaded `Engine`.

Every turn hands the strategy the whole conversation as its prompt; the
target's `KvSequence` keeps the longest common prefix of what it already holds
and decodes only the rest, so a new turn costs only its new tokens, whichever
strategy ran the turns before (all strategies of an engine share that cache).

The conversation is formatted by `app.prompt_format.PromptFormat`: the GGUF's
chat template when the model has one, one continuing plain-text document for a
base model (the demo), tokenized whole each turn so the model sees the
canonical tokens of what the transcript shows.

When the conversation outgrows the context, the prompt is the largest suffix
of whole user/assistant pairs that fits. Trying suffixes one by one from the
full conversation costs a render and a tokenization of a nearly whole
conversation per pair dropped: a turn's cost grows with the square of the
conversation's length. Instead each message's tokens are counted once (its
text alone, cached) plus a per-message template overhead learned from the
last real prompt; that estimate says where the cut should be, and real
renders and tokenizations around it decide (`first_fitting_cut`), in the
usual case two of them, each of a prompt about the context's size. The cut
found is the one trying every suffix from the oldest would find, given that
dropping a pair never makes the prompt longer (true of chat templates and
tokenizers in practice; tests/test_chat_session.py checks it against the
simple rule on random conversations).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

from app.chat_template import ChatMessage
from app.prompt_format import PromptFormat
from backends.config import StrategyOptions
from backends.engine import Engine
from backends.events import Done, Event, until_done
from backends.kv import common_prefix
from backends.kv_store import DISK_BYTES, KvDiskStore, kv_dir, restore, snapshot
from backends.sampling import GenParams
from backends.strategies.base import never

# When old turns must leave the prompt, the answer is kept room for its whole max_tokens, up to this share of the
# context (the rest is the conversation's): a fixed 256 had cut every later answer of a full chat short, and left
# a thinking model's answer empty once its thinking took that room.
ANSWER_SHARE = 0.5
CALIBRATION_PROMPT = "The history of the printing press"
CALIBRATION_TOKENS = 24


@dataclass(frozen=True)
class TurnRequest:
    """How to generate one turn: applied per turn, so settings change between turns freely."""

    strategy: str
    params: GenParams  # params.reasoning_budget bounds a thinking model's thinking
    options: StrategyOptions
    thinking: bool = True  # a thinking model thinks first (its template's enable_thinking)
    reasoning_effort: str | None = None  # for a template that reads it (gpt-oss: low, medium, high)


def estimated_cut(cost: Callable[[int], float], n_messages: int, new_cost: float, budget: float) -> int:
    """The fewest pairs to drop from the front of `n_messages` messages (message i costing `cost(i)`)
    so that the rest and a new message costing `new_cost` stay within `budget`.

    Walks back from the newest message, so it costs the length of what is kept, not of the conversation.
    """
    total = new_cost
    for k in range((n_messages + 1) // 2 - 1, -1, -1):  # keep messages[2k:] while they fit
        total += sum(cost(i) for i in range(2 * k, min(2 * k + 2, n_messages)))
        if total > budget:
            return k + 1
    return 0


def first_fitting_cut(fits: Callable[[int], bool], hint: int, last: int) -> int:
    """The smallest k in [0, last] with fits(k), for a monotone fits (false ... false, true ... true)
    that is true at `last`.

    Gallops away from `hint` (steps of 1, 2, 4, ...) until the answer is bracketed, then bisects:
    two calls of fits when the hint is right, O(log of the hint's error) when it is not.
    """
    k = min(max(hint, 0), last)
    if fits(k):
        hi, step = k, 1  # fits(hi); below, lo is -1 or not fits(lo)
        lo = hi - step
        while lo >= 0 and fits(lo):
            hi, step = lo, 2 * step
            lo = hi - step
        lo = max(lo, -1)
    else:
        lo, step = k, 1  # not fits(lo); below, fits(hi)
        hi = min(lo + step, last)
        while not fits(hi):
            lo, step = hi, 2 * step
            hi = min(lo + step, last)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


class ChatSession:
    def __init__(self, engine: Engine, system_prompt: str = "", kv_store: KvDiskStore | None | bool = True,
                 kv_bytes: int = DISK_BYTES) -> None:
        """`kv_store`: where each turn's cells are kept on disk, so that a conversation reopened later (F5,
        another day) decodes only what is new (backends.kv_store); True: the data dir's, at most `kv_bytes`
        (off where $SPECCHAT_KV_DIR is empty or `kv_bytes` is 0), None or False: none."""
        self.engine = engine
        if kv_store is True:
            folder = kv_dir()
            kv_store = KvDiskStore(folder, engine.kv_key(), kv_bytes) if folder is not None and kv_bytes else None
        self.kv_store: KvDiskStore | None = kv_store or None
        self.restored: tuple[int, float] | None = None  # tokens restored from disk for the last turn, seconds
        self._unkept = False  # the last turn's cells are not on disk yet
        self.system_prompt = system_prompt
        self.format = PromptFormat(engine)
        self.messages: list[ChatMessage] = []
        self.dropped = 0  # messages of the last prompt left out because the context is full
        self.kept: list[ChatMessage] = []  # the messages of the last prompt (the new one last)
        self.rendered = ""  # the last prompt's text, as the template rendered it (read again for its reasoning)
        self._text_tokens: dict[str, int] = {}  # tokens of each message's text alone, counted once
        self._overhead = 0.0  # template tokens per message, learned from the last prompt

    @property
    def plain(self) -> bool:
        return self.format.plain

    def reset(self, messages: Sequence[ChatMessage] = ()) -> None:
        """A new chat, or a saved one reopened."""
        self.messages = list(messages)
        self._text_tokens.clear()

    @property
    def n_ctx(self) -> int:
        """The positions a prompt and its answer share (the smaller of the target's and the draft's contexts)."""
        return min(seq.n_ctx for seq in (self.engine.target, self.engine.draft) if seq is not None)

    def answer_reserve(self, max_tokens: int) -> int:
        """The room a turn's prompt leaves for its answer when old turns must leave it (ANSWER_SHARE)."""
        return min(max_tokens, int(ANSWER_SHARE * self.n_ctx))

    def prompt_tokens(self, user_text: str, reserve: int = 0, kwargs: Mapping[str, object] | None = None
                      ) -> list[int]:
        """The conversation plus the new message, as the target will see it (`kwargs`: the template's
        variables, `PromptFormat.thinking_kwargs`). Earlier answers carry their reasoning back
        (ChatMessage.reasoning): the template decides what of it the model reads.

        When it does not fit the context with `reserve` tokens left for the
        answer, the oldest turns are left out of the prompt (they stay in the
        transcript), as chat apps do; `dropped` says how many messages.
        """
        n_ctx = self.n_ctx
        history, user = self.messages, ChatMessage("user", user_text)
        last = (len(history) + 1) // 2  # dropping this many pairs leaves no history
        tried: dict[int, tuple[str, list[int]]] = {}

        def fits(k: int) -> bool:  # one real render and tokenization of a prompt about the context's size
            if k not in tried:
                text = self.format.render([*history[2 * k:], user], self.system_prompt, kwargs=kwargs)
                tried[k] = text, self.format.encode(text)
            return k == last or len(tried[k][1]) + reserve <= n_ctx

        def cost(i: int) -> float:
            return self._text_cost(history[i].content) + self._overhead

        hint = estimated_cut(cost, len(history), self._text_cost(user_text) + self._overhead, n_ctx - reserve)
        k = first_fitting_cut(fits, hint, last)
        self.rendered, tokens = tried[k]
        kept = self.kept = [*history[2 * k:], user]
        self._overhead = (len(tokens) - sum(self._text_cost(m.content) for m in kept)) / len(kept)
        self.dropped = min(2 * k, len(history))
        return tokens

    def _text_cost(self, text: str) -> int:
        if text not in self._text_tokens:
            self._text_tokens[text] = len(self.engine.target_model.tokenize(text, add_special=False))
        return self._text_tokens[text]

    def request_params(self, user_text: str, request: TurnRequest) -> tuple[list[int], GenParams]:
        """The turn's prompt and parameters. A thinking model's prompt is rendered with thinking on or off as
        asked, and its output split into reasoning and answer (GenParams.reasoning) with the request's budget;
        thinking asked off where its template cannot turn it off is a ThinkingError (a ChatTemplateError)."""
        params, kwargs = request.params, None
        if self.format.reasoning is not None:
            # The effort where the template reads it: a setting kept across models is no error on the others.
            effort = request.reasoning_effort if self.format.takes_effort else None
            kwargs = self.format.thinking_kwargs(request.thinking, effort=effort)
        prompt = self.prompt_tokens(user_text, reserve=self.answer_reserve(params.max_tokens), kwargs=kwargs)
        if kwargs is not None:
            params = replace(params, reasoning=self.format.reasoning_for(self.kept, self.system_prompt, kwargs=kwargs,
                                                                         rendered=self.rendered))
        return prompt, params

    def turn(self, user_text: str, request: TurnRequest, should_stop: Callable[[], bool] = never) -> Iterator[Event]:
        """Generate the answer; the turn joins the conversation unless it failed.

        A cancelled answer is kept as far as it got (as chat apps do), its
        reasoning with it. Raises PromptError (before any event) when the
        conversation no longer fits, ThinkingError when thinking is asked off
        where the model cannot turn it off.
        """
        prompt, params = self.request_params(user_text, request)
        strategy = self.engine.strategy(request.strategy, request.options)
        self._restore(prompt)
        events = strategy.generate(prompt, params, should_stop)
        for event in events:
            # Committed before Done is handed on: a consumer may stop iterating at Done.
            if isinstance(event, Done) and event.reason != "error":
                self.messages += [ChatMessage("user", user_text),
                                  ChatMessage("assistant", event.text, reasoning=event.reasoning)]
                self._unkept = True
            yield event
        self.keep_cells()

    def keep_cells(self) -> None:
        """The last turn's cells onto disk (backends.kv_store), once: after the answer was shown, since copying
        them takes a moment (docs/results.md, "KV cells on disk"; the write runs on a thread of its own).
        turn() does it when its consumer reads past Done; the chat app, whose stream stops at Done, calls it once
        the chat is idle (a next message sent at once meets no copy, no write), and close() does at the end."""
        if not self._unkept or self.kv_store is None:
            return
        self._unkept = False
        slot = self.engine.slots[0]
        entry = snapshot(slot.target, slot.draft)
        if entry is not None:
            self.kv_store.put(entry)

    def close(self) -> None:
        """Before the engine goes: what the last turn left kept, and every write on disk. A failure here loses
        only cells (the conversation's text is saved apart): the prompt decodes next time."""
        try:
            self.keep_cells()
        except Exception:  # noqa: BLE001 - a cache, not the conversation
            pass
        if self.kv_store is not None:
            self.kv_store.close()

    def _restore(self, prompt: list[int]) -> None:
        """The conversation's cells from disk where they start the prompt beyond what the cache holds (a
        conversation reopened, or the app started again)."""
        self.restored = None
        if self.kv_store is None:
            return
        slot = self.engine.slots[0]
        t0 = time.perf_counter()
        entry = self.kv_store.best(prompt, common_prefix(slot.target.tokens, prompt))
        if entry is not None:
            n = restore(entry, slot.target, slot.draft, prompt)
            if n:
                self.restored = (n, time.perf_counter() - t0)


def measure_plain_decoding(engine: Engine, n_tokens: int = CALIBRATION_TOKENS) -> float:
    """Tokens/s of plain decoding on this device now: the baseline the speedup is shown against."""
    prompt = engine.tokenize(CALIBRATION_PROMPT)
    return until_done(engine.strategy("ar").generate(prompt, GenParams(max_tokens=n_tokens))).stats.tokens_per_second
